"""Decoding throughput of our decoder against peers running the same weights.

    python -m bench.decode --device cpu|cuda --beam-size N [--limit N]
        [--systems ours,ours-full,ctranslate2,ctranslate2-int8,marian,naive] [--weights weights/de-en]
        [--threads 2] [--batch-size 64] [--naive-limit 100] [--dtype float32] [--repeat 3]
        [--rounds 1] [--no-isolate] [--malloc auto|mimalloc|glibc] [--peer-malloc glibc|auto|mimalloc]
        [--streams 1]

Translates test_2016_flickr de->en and prints one JSON line per system: system, device,
beam_size, sentences, seconds, sentences_per_s, tokens_per_s, peak_mem_mb, setup_mem_mb, bleu
(plus batch_size, threads, streams, dtype for context).

Systems (all load the same checkpoint folder):
- ``ours``: ``model.engine.decoding`` (batched, KV cache, vectorized beam), scoring the checkpoint's
  lexical shortlist where it ships one (``model.engine.shortlist``; float precisions), as the service does;
  ``ours-full`` (not in the default list): the same over the whole vocabulary.
- ``ctranslate2`` / ``ctranslate2-int8``: the checkpoint converted by
  ``bench.ctranslate2_convert`` into a temporary directory (not timed), run as float32 /
  with ``compute_type="int8"``; ``inter_threads=--streams, intra_threads=--threads / --streams``.
- ``marian``: ``transformers``' ``MarianMTModel.generate`` with our weights mapped by
  ``bench.marian_convert`` (post-LN checkpoints only).
- ``naive``: ``bench.naive``: one sentence at a time, greedy, no cache, on the first
  ``--naive-limit`` sentences; ``ours-single`` (not in the default list) is our cached
  greedy search on the same sentences one at a time, so naive vs ours-single isolates the cache.

Protocol: the same sentences, sorted by source length and cut into the same batches of
``--batch-size`` for every batched system; the same beam size and length penalty (the
checkpoint's recommended decoding settings) and the same length limit: a batch may generate
``model.engine.decoding.max_steps`` tokens (EOS included) for its longest source, in every system
(ours too, although it could limit each sentence separately, because CTranslate2 and
``generate`` take one limit per call). Greedy search then gives the same tokens in all systems
(up to floating-point ties). Beam search differs in length normalization: CTranslate2
divides scores by length ** alpha (EOS not counted), Marian by length ** alpha (EOS counted),
ours by GNMT's ((5 + length) / 6) ** alpha (EOS counted). It differs in stopping too: ours
and Marian (``generate``'s default ``early_stopping=False``) end a sentence once ``beam``
finished hypotheses outscore every live one, CTranslate2 once ``beam`` hypotheses have
finished (alpha > 0) or the best one has (alpha = 0). With alpha = 0 the three gave the same
tokens in the tests. torch runs with ``torch.set_num_threads(--threads)``, and every system's
process with oneDNN's primitive caches bounded by ``bound_onednn_cache`` (as the service runs;
CTranslate2's oneDNN reads the same variable). Allocator: our systems' processes run on what
``--malloc`` means (default ``auto``: mimalloc where installed, as ``translator serve`` runs;
``model.engine.allocator``), the peers' on ``--peer-malloc`` (default glibc, as they ship and
where CTranslate2's peaks are lower:
docs/benchmarks/log/2026-11-28.md#the-allocator-session-of-2026-11-28-1058); glibc's malloc is
tuned by ``tune_malloc`` in every process it serves. Each row names its process's allocator
(``malloc``). Each system translates ``--warmup`` sentences, then times ``--repeat`` passes and reports the median
(``runs_s`` lists them all); a pass covers tokenization, batching, decoding and
detokenization (source strings to target strings). A shared host's speed drifts from minute
to minute (docs/benchmarks/README.md), so ratios are best read with ``--rounds N``: every
system's process runs N times, round-robin, and the median round is reported (``rounds_s`` lists them all).
``--streams N`` (batched systems): the sorted batches are dealt in turn to N threads, each
decoding its own on ``--threads / N`` threads of arithmetic (ours: a translator of its own each
with ``torch.set_num_threads`` in its thread; CTranslate2: N replicas, its ``inter_threads``), so
one stream's bookkeeping overlaps another's matrix products and no thread waits at a parallel
region's barrier; at 1 (the default) one stream runs every batch on all ``--threads``.
Systems are not timed in one process: their thread pools (torch's and CTranslate2's OpenMP
threads spin after each parallel region) slow whichever runs next
(docs/benchmarks/README.md#bench-decode).

Metrics: ``tokens_per_s`` counts generated target pieces of the returned translations (EOS not
counted). ``peak_mem_mb`` on the CPU is the process's peak resident set size during the timed run
minus its resident size just before the system was set up (after importing its runtime): roughly the
system's weights, runtime buffers and decoding working memory, in MiB. The peak comes from
/proc/self/status ``VmHWM``, reset through /proc/self/clear_refs right before the timed run, so it
covers C++ allocations (CTranslate2) as well as torch's; memory freed during setup (e.g. the float32
weights a converter read) is handed back to the OS (``malloc_trim``, mimalloc's ``mi_collect``)
before the run so it is not counted. ``setup_mem_mb`` is the resident size after setup and warm-up,
just before the timed run, above the same baseline: the weights and what the runtime keeps between
passes; ``peak_mem_mb - setup_mem_mb`` is a pass's working memory. By default each system runs in
its own process (``--no-isolate`` runs them all in this one), so systems share no memory, thread
pools or allocator caches, and a CTranslate2 process imports ``ctranslate2`` before torch: the other
way round, CTranslate2 binds to torch's OpenMP runtime and runs far slower
(docs/benchmarks/README.md#numbers-behind-the-code). On CUDA it is
``torch.cuda.max_memory_allocated`` during the run minus the allocation before setup (torch systems
only; null for CTranslate2, whose allocator torch cannot see).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, get_args

import torch

from bench import naive
from bench.memory import status_kib
from bench.stats import median, median_row
from model import checkpoint
from model.engine import kernels, loading
from model.engine.allocator import (
    MallocChoice,
    active_malloc,
    bound_onednn_cache,
    freeing_at_once,
    malloc_env,
    release_free_memory,
    tune_malloc,
)
from model.engine.batches import pad, token_batches
from model.engine.decoding import max_steps
from model.engine.features import detected
from model.engine.loading import Checkpoint
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.network.precision import PRECISIONS
from model.training.data import MULTI30K_DIR, read_lines
from model.training.evaluate import score_translations
from model.training.progress import progress

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")
R = TypeVar("R")


def _reset_peak_rss() -> None:
    """Set VmHWM back to the current RSS (Linux >= 4.0); without it the peak covers setup too."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as err:
        log.warning("cannot reset the peak RSS (%s); peak_mem_mb includes setup", err)


def release_garbage() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc's trim, mimalloc's
    collect), so memory freed during setup (e.g. the float32 weights a converter read) is not
    counted as resident."""
    gc.collect()
    release_free_memory()


class PeakMemory:
    """Peak memory of a timed run, in MiB above a baseline taken at construction (see docstring)."""

    def __init__(self, device: str, tracks_torch: bool) -> None:
        self.cuda = device == "cuda"
        self.tracks_torch = tracks_torch
        self.baseline = torch.cuda.memory_allocated() if self.cuda else status_kib("VmRSS")

    def current(self) -> float | None:
        """Memory now, in MiB above the baseline: after setup and warm-up, the weights and what
        the runtime keeps between passes (the rest of ``stop``'s peak is a pass's working memory)."""
        if self.cuda:
            return (torch.cuda.memory_allocated() - (self.baseline or 0)) / 2**20 if self.tracks_torch else None
        now = status_kib("VmRSS")
        return None if now is None or self.baseline is None else (now - self.baseline) / 1024

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            _reset_peak_rss()

    def stop(self) -> float | None:
        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - (self.baseline or 0)) / 2**20 if self.tracks_torch else None
        peak = status_kib("VmHWM")
        return None if peak is None or self.baseline is None else (peak - self.baseline) / 1024


def cpu_name() -> str | None:
    """The CPU's model name, as lscpu shows it (None off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else None


def greedy(options: DecodingOptions) -> DecodingOptions:
    return dataclasses.replace(options, beam_size=1, n_best=1)


@dataclass(frozen=True)
class Settings:
    """One benchmark invocation; ``options`` are the checkpoint's decoding settings."""

    weights: Path
    device: str
    dtype: str
    beam_size: int
    batch_size: int
    threads: int
    options: DecodingOptions
    streams: int = 1  # batches decoded at once, each on threads / streams threads (see the module doc)


@dataclass(frozen=True)
class Output:
    texts: list[str]
    tokens: int  # generated target pieces, EOS not counted


Translate = Callable[[list[str]], Output]


def in_length_order(items: Sequence[T], lengths: Sequence[int], size: int, fn: Callable[[list[T]], list[R]]) -> list[R]:
    """Apply ``fn`` to length-sorted chunks of at most ``size`` items; results in input order."""
    results: list[R | None] = [None] * len(items)
    for chunk in token_batches(lengths, math.inf, max_items=size):
        for i, result in zip(chunk, fn([items[i] for i in chunk]), strict=True):
            results[i] = result
    return [r for r in results if r is not None]


def in_streams(
    items: Sequence[T], lengths: Sequence[int], size: int, streams: Sequence[Callable[[list[T]], list[R]]]
) -> list[R]:
    """``in_length_order`` with the sorted chunks dealt in turn to ``streams``, each run on a
    thread of its own (one stream: on this thread); results in input order."""
    if len(streams) == 1:
        return in_length_order(items, lengths, size, streams[0])
    chunks = list(token_batches(lengths, math.inf, max_items=size))
    results: list[R | None] = [None] * len(items)

    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            for chunk in chunks[k :: len(streams)]:
                for i, result in zip(chunk, streams[k]([items[i] for i in chunk]), strict=True):
                    results[i] = result
        except BaseException as err:  # re-raised on the calling thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(k,), name=f"stream-{k}") for k in range(len(streams))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def _own_threads(threads: int, fn: Callable[[list[T]], list[R]]) -> Callable[[list[T]], list[R]]:
    """``fn`` on ``threads`` of torch's threads, set in the calling thread (OpenMP's count is a
    thread's own), so streams on threads of their own do not share one team."""

    def run(chunk: list[T]) -> list[R]:
        torch.set_num_threads(threads)
        return fn(chunk)

    return run


def batch_limit(src_lengths: Sequence[int], options: DecodingOptions, cap: int) -> int:
    """Most tokens (EOS included) a batch may generate: ours' limit for its longest source (+EOS)."""
    return max(max_steps([n + 1 for n in src_lengths], options, cap))


def setup_ours(
    ckpt: Checkpoint, batch_size: int, options: DecodingOptions, shortlist: bool = True, streams: int = 1
) -> Translate:
    """Ours as the service runs it: with the checkpoint's shortlist where it has one (float
    precisions: ``loading.use_shortlist``), unless ``shortlist`` is False (``ours-full``).
    ``streams`` > 1: that many translators of the one model, each on its own thread (``in_streams``)."""
    short = loading.use_shortlist(ckpt, shortlist)
    translators = [Translator(ckpt.model, ckpt.tokenizer, shortlist=short) for _ in range(streams)]
    cap = ckpt.config.max_tokens

    def decoder(translator: Translator) -> Callable[[list[list[int]]], list[tuple[int, ...]]]:
        def decode(chunk: list[list[int]]) -> list[tuple[int, ...]]:
            limit = batch_limit([len(x) for x in chunk], options, cap)  # the peers' per-batch limit
            same = dataclasses.replace(options, max_length_a=0.0, max_length_b=limit, max_length=None)
            return [hyps[0].ids for hyps in translator.decode_ids(chunk, same)]

        return decode

    threads = max(1, torch.get_num_threads() // streams)
    decoders = [decoder(t) if streams == 1 else _own_threads(threads, decoder(t)) for t in translators]

    def translate(texts: list[str]) -> Output:
        ids = translators[0].encode(texts)
        out = in_streams(ids, [len(x) for x in ids], batch_size, decoders)
        return Output(ckpt.tokenizer.decode(out), sum(len(x) for x in out))

    return translate


def setup_naive(ckpt: Checkpoint, options: DecodingOptions) -> Translate:
    def translate(texts: list[str]) -> Output:
        out = naive.translate(ckpt.model, ckpt.tokenizer, texts, options)
        return Output(ckpt.tokenizer.decode(out), sum(len(x) for x in out))

    return translate


def setup_ctranslate2(ckpt: Checkpoint, settings: Settings, folder: Path, int8: bool) -> Translate:
    import ctranslate2

    from bench.ctranslate2_convert import build_spec, write

    write(build_spec(ckpt.model, ckpt.tokenizer), folder)
    compute_type = settings.dtype  # ctranslate2 with --dtype int8 is CTranslate2's int8 too
    if int8 and settings.dtype != "int8":
        compute_type = "int8" if settings.dtype == "float32" else f"int8_{settings.dtype}"
    streams = settings.streams
    model = ctranslate2.Translator(
        str(folder),
        device=settings.device,
        compute_type=compute_type,
        inter_threads=streams,
        intra_threads=max(1, settings.threads // streams),
    )
    sp, options, cap = ckpt.tokenizer.sp, settings.options, ckpt.config.max_tokens

    def decode(chunk: list[list[str]]) -> list[list[str]]:
        results = model.translate_batch(
            chunk,
            max_batch_size=settings.batch_size,
            batch_type="examples",
            beam_size=options.beam_size,
            length_penalty=options.length_penalty,
            max_decoding_length=batch_limit([len(x) for x in chunk], options, cap),
            min_decoding_length=0,
            max_input_length=0,
        )
        return [r.hypotheses[0] for r in results]

    def translate(texts: list[str]) -> Output:
        pieces = sp.encode(texts, out_type=str)
        out = in_streams(pieces, [len(x) for x in pieces], settings.batch_size, [decode] * streams)
        return Output(list(sp.decode(out)), sum(len(x) for x in out))

    return translate


def setup_marian(ckpt: Checkpoint, settings: Settings) -> Translate:
    from bench.marian_convert import to_marian

    marian: Any = to_marian(ckpt.model)  # transformers' typing of .to() confuses mypy
    marian.to(settings.device, kernels.FLOAT_DTYPES[settings.dtype])
    cfg, tokenizer, options, device = ckpt.config, ckpt.tokenizer, settings.options, torch.device(settings.device)
    beam: dict[str, Any] = {}
    if options.beam_size > 1:  # generate's default early_stopping=False is ours' stopping rule
        beam = {"num_beams": options.beam_size, "length_penalty": options.length_penalty}

    def decode(chunk: list[list[int]]) -> list[list[int]]:
        src = pad([[*x, cfg.eos_id] for x in chunk], cfg.pad_id).to(device)
        generated = marian.generate(
            input_ids=src,
            attention_mask=(src != cfg.pad_id).long(),
            max_new_tokens=batch_limit([len(x) for x in chunk], options, cfg.max_tokens),
            **beam,
        )
        return [_until_eos(row[1:], cfg.eos_id) for row in generated.tolist()]

    def translate(texts: list[str]) -> Output:
        ids = tokenizer.encode(texts)
        out = in_length_order(ids, [len(x) for x in ids], settings.batch_size, decode)
        return Output(tokenizer.decode(out), sum(len(x) for x in out))

    return translate


def _until_eos(row: list[int], eos_id: int) -> list[int]:
    """Generated ids after the start token, cut before the first EOS (the rest is padding)."""
    return row[: row.index(eos_id)] if eos_id in row else row


def _setup_ctranslate2(int8: bool) -> Callable[[Settings, Path], Translate]:
    def setup(settings: Settings, workdir: Path) -> Translate:  # the converter reads float32 CPU weights
        ckpt = loading.load(settings.weights, "cpu", keep_float_weights=True, fused=False)
        return setup_ctranslate2(ckpt, settings, workdir / "ctranslate2", int8)

    return setup


def _setup_marian(settings: Settings, workdir: Path) -> Translate:
    if settings.dtype not in kernels.FLOAT_DTYPES:
        raise ValueError(f"marian runs float dtypes only, not {settings.dtype}")
    # (the converter reads the float weights: no fused kernels to build, which a GPU machine would do first)
    return setup_marian(loading.load(settings.weights, "cpu", keep_float_weights=True, fused=False), settings)


def _ours(settings: Settings) -> Checkpoint:
    return loading.load(settings.weights, settings.device, settings.dtype)


@dataclass(frozen=True)
class System:
    """One system the benchmark can time: how to set it up, and what sets it apart."""

    setup: Callable[[Settings, Path], Translate]  # (settings, an empty scratch folder) -> translate
    runtime: str | None = None  # imported before the memory baseline, so library code is not counted
    batched: bool = True  # False: one sentence at a time, greedy, on the first --naive-limit sentences
    ctranslate2: bool = False  # CTranslate2's own allocator and OpenMP (see run_isolated, PeakMemory)
    default: bool = True  # in --systems' default list
    peer: bool = False  # another project's decoder: isolated, it runs on --peer-malloc, ours on --malloc


SYSTEMS: dict[str, System] = {
    "ours": System(lambda s, _: setup_ours(_ours(s), s.batch_size, s.options, streams=s.streams)),
    "ours-full": System(lambda s, _: setup_ours(_ours(s), s.batch_size, s.options, shortlist=False), default=False),
    "ctranslate2": System(_setup_ctranslate2(int8=False), "bench.ctranslate2_convert", ctranslate2=True, peer=True),
    "ctranslate2-int8": System(_setup_ctranslate2(int8=True), "bench.ctranslate2_convert", ctranslate2=True, peer=True),
    "marian": System(_setup_marian, "bench.marian_convert", peer=True),
    "naive": System(lambda s, _: setup_naive(_ours(s), greedy(s.options)), batched=False),
    "ours-single": System(lambda s, _: setup_ours(_ours(s), 1, greedy(s.options)), batched=False, default=False),
}
DEFAULT_SYSTEMS = ",".join(name for name, system in SYSTEMS.items() if system.default)


def measure(
    system: str, settings: Settings, src: list[str], ref: list[str], warmup: int, repeat: int = 1
) -> dict[str, Any]:
    """Set up one system, warm it up, time ``repeat`` passes over ``src`` (the median counts:
    a small machine's speed drifts between runs) and score the output."""
    spec = SYSTEMS[system]
    if spec.runtime is not None:
        importlib.import_module(spec.runtime)
    release_garbage()
    meter = PeakMemory(settings.device, tracks_torch=not spec.ctranslate2)
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        # ours loads and warms up as the service does, handing what that frees back as it goes
        with contextlib.nullcontext() if spec.peer else freeing_at_once():
            translate = spec.setup(settings, Path(tmp))
            release_garbage()
            translate(src[:warmup])
        settled = meter.current()
        meter.start()
        runs = []
        with progress(repeat, f"{system}: timed passes of {len(src)} sentences", unit="pass") as bar:
            for _ in range(repeat):
                start = time.perf_counter()
                out = translate(src)
                runs.append(time.perf_counter() - start)
                bar.update()
        peak = meter.stop()
    seconds = median(runs)
    unbatched = not spec.batched
    return {
        "system": system,
        "device": settings.device,
        "beam_size": 1 if unbatched else settings.beam_size,
        "sentences": len(src),
        "seconds": round(seconds, 3),
        "sentences_per_s": round(len(src) / seconds, 2),
        "tokens_per_s": round(out.tokens / seconds, 1),
        "peak_mem_mb": None if peak is None else round(peak, 1),
        "setup_mem_mb": None if settled is None else round(settled, 1),
        "bleu": score_translations(out.texts, ref)["bleu"],
        "batch_size": 1 if unbatched else settings.batch_size,
        "threads": settings.threads,
        "streams": settings.streams if spec.batched else 1,
        "dtype": settings.dtype,
        "cpu": cpu_name(),
        "isa": detected().isa if settings.device == "cpu" else None,
        "malloc": active_malloc(),
        "runs_s": [round(r, 3) for r in runs],
    }


def run_rounds(
    systems: Sequence[str], child_argv: list[str], rounds: int, malloc: MallocChoice, peer_malloc: MallocChoice
) -> None:
    """Each system in its own process, ``rounds`` times round-robin (so a drift in machine
    speed hits every system alike), ours on the allocator ``malloc`` means and the peers on
    ``peer_malloc``'s (``allocator.malloc_env``); print each system's median round, with all
    rounds' times."""
    rows: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
    failed: set[str] = set()
    for _ in range(rounds):
        for system in systems:
            if system in failed:
                continue
            try:
                choice = peer_malloc if SYSTEMS[system].peer else malloc
                rows[system] += [json.loads(line) for line in run_isolated(system, child_argv, choice)]
            except RuntimeError as err:  # e.g. a peer that cannot run on this device: report the rest
                log.error("%s", err)
                failed.add(system)
    for system in systems:
        if rows[system]:
            middle = median_row(rows[system], key=lambda r: r["seconds"])
            print(json.dumps({**middle, "rounds_s": [r["seconds"] for r in rows[system]]}), flush=True)
    if failed:
        raise SystemExit(f"failed: {', '.join(sorted(failed))}")


CTRANSLATE2_FIRST = "import ctranslate2, runpy; runpy.run_module('bench.decode', run_name='__main__', alter_sys=True)"


def run_isolated(system: str, argv: Sequence[str], malloc: MallocChoice = "glibc") -> list[str]:
    """Run one system in a child process of this module (same cwd) on the allocator ``malloc``
    means (``allocator.malloc_env``); return its JSON lines."""
    cmd = [sys.executable, "-m", "bench.decode", *argv, "--systems", system, "--no-isolate"]
    if SYSTEMS[system].ctranslate2:
        # CTranslate2 first, then torch (bench.decode imports it): both libraries bring an
        # OpenMP runtime and the order of loading decides which one CTranslate2 binds to;
        # imported after torch it ran several times slower (docs/benchmarks/README.md#numbers-behind-the-code).
        cmd[1:3] = ["-c", CTRANSLATE2_FIRST]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = malloc_env(malloc, {**os.environ, "PYTHONPATH": path})
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False, env=env)
    if proc.returncode:
        raise RuntimeError(f"{system}: benchmark process exited with {proc.returncode} (its stderr is above)")
    return [line for line in proc.stdout.splitlines() if line.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--beam-size", type=int, default=1)
    parser.add_argument("--limit", type=int, default=0, help="only the first N test sentences (0 = all)")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--weights", type=Path, default=ROOT / "weights" / "de-en", help="checkpoint folder")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per system")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    parser.add_argument("--naive-limit", type=int, default=100, help="sentences for naive and ours-single")
    parser.add_argument(
        "--dtype", default="float32", choices=PRECISIONS, help="precision of ours and ctranslate2 (int8: CPU)"
    )
    parser.add_argument("--warmup", type=int, default=16, help="sentences translated before timing")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per system; the median is reported")
    parser.add_argument("--data-dir", type=Path, default=MULTI30K_DIR, help="folder with test_2016_flickr.{de,en}.gz")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True, help="one process per system")
    parser.add_argument(
        "--malloc",
        default="auto",
        choices=get_args(MallocChoice),
        help="allocator of our systems' processes (auto: mimalloc where installed, as translator serve runs)",
    )
    parser.add_argument(
        "--peer-malloc",
        default="glibc",
        choices=get_args(MallocChoice),
        help="allocator of the peers' processes (glibc: as they ship)",
    )
    parser.add_argument(
        "--streams",
        type=int,
        default=1,
        help="batches decoded at once by the batched systems, each on --threads / --streams threads",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="isolated runs of every system, round-robin; the median run is reported"
    )
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    meta = checkpoint.read_meta(args.weights)
    options = loading.decoding_options(meta, args.beam_size)
    if not 1 <= args.streams <= args.threads:
        raise SystemExit(f"--streams {args.streams}: between 1 and --threads ({args.threads})")
    return Settings(
        args.weights, args.device, args.dtype, args.beam_size, args.batch_size, args.threads, options, args.streams
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.isolate:
        child_argv = _without_systems(sys.argv[1:] if argv is None else argv)
        run_rounds(systems, child_argv, args.rounds, args.malloc, args.peer_malloc)
        return
    settings = settings_from(args)
    src = read_lines(args.data_dir / "test_2016_flickr.de.gz")
    ref = read_lines(args.data_dir / "test_2016_flickr.en.gz")
    n = args.limit or len(src)
    torch.set_num_threads(args.threads)
    tune_malloc()  # glibc: every system under the same settings (another allocator: its own)
    bound_onednn_cache()  # and oneDNN's caches bounded as the service bounds them (CTranslate2's oneDNN too)
    for system in systems:
        batched = SYSTEMS[system].batched
        k = n if batched else min(n, args.naive_limit)
        warmup = args.warmup if batched else min(args.warmup, 2)
        repeat = args.repeat if batched else 1
        print(json.dumps(measure(system, settings, src[:k], ref[:k], warmup, repeat)), flush=True)


def _without_systems(argv: list[str]) -> list[str]:
    """argv minus any --systems option (the child gets its own)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--systems":
            skip = True
        elif not arg.startswith("--systems="):
            out.append(arg)
    return out


if __name__ == "__main__":
    main()
