"""Memory of training on streamed corpora ([[data.corpora]]) against the corpus's size.

    python -m bench.train_memory [--pairs 3000000,300000] [--steps 1000] [--folder /tmp/train-memory]

For each size, a generated corpus of that many distinct pairs (sentences of 4-20 words from a
2,000-word vocabulary, the target a word-by-word rewrite of the source: learnable, cheap to
make; written once, as a pair of gzip files, into ``--folder``) trains a tiny model for
``--steps`` updates in a fresh interpreter, which reads its own resident memory
(``bench.memory.rss_mib``) every 0.2 s. Prints one JSON line per size: the corpus's pairs and
bytes, the seconds and the peak RSS of the read that counts and samples the corpus (``scan``)
and of the trainer's set-up as a whole (scan, tokenizer training, the model), then of training:
the RSS when training starts, at the end, its peak, and its quartiles over time, the pairs the
stream gave out and the updates made; then, without a model, the whole of the next epoch's
batches (every pair read, cleaned, mixed, shuffled, tokenized and batched): its seconds, batches,
RSS quartiles and peak. Flat memory: these figures do not grow with the corpus, nor from the
start of training to its end.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.memory import rss_mib

CONFIG = """
name = "memory"
[data]
dir = "{folder}"
source = "xx"
target = "yy"
eval_limit = 50
[[data.corpora]]
files = ["{{dir}}/{stem}.xx.gz", "{{dir}}/{stem}.yy.gz"]
[[data.corpora]]
files = ["{{dir}}/valid.xx.gz", "{{dir}}/valid.yy.gz"]
split = "valid"
[tokenizer]
vocab_size = 1000
[model]
d_model = 64
n_heads = 4
encoder_layers = 1
decoder_layers = 1
d_ff = 128
max_positions = 128
[optim]
max_epochs = 1
max_tokens = 4096
lr = 1e-3
warmup_steps = 100
bf16 = false
threads = 1
"""


def words() -> tuple[list[str], dict[str, str]]:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    source = sorted({"".join(rng.choices(letters, k=rng.randint(3, 9))) for _ in range(2100)})[:2000]
    return source, {w: w[::-1].upper() for w in source}


def generate(folder: Path, stem: str, pairs: int, seed: int) -> int:
    """``stem``.xx.gz / ``stem``.yy.gz with ``pairs`` distinct lines (each ends in its number);
    -> bytes written (compressed). Kept when already there."""
    files = [folder / f"{stem}.xx.gz", folder / f"{stem}.yy.gz"]
    if not all(f.exists() for f in files):
        source, rewrite = words()
        rng = random.Random(seed)
        tmp = [f.with_name(f.name + ".tmp") for f in files]
        with gzip.open(tmp[0], "wt", compresslevel=1) as xs, gzip.open(tmp[1], "wt", compresslevel=1) as ys:
            for i in range(pairs):
                sentence = rng.choices(source, k=rng.randint(4, 20))
                xs.write(" ".join(sentence) + f" {i}\n")
                ys.write(" ".join(rewrite[w] for w in sentence) + f" {i}\n")
        for t, f in zip(tmp, files, strict=True):
            t.replace(f)
    return sum(f.stat().st_size for f in files)


class Sampler:
    """This process's RSS every ``every`` seconds, each sample tagged with the current phase."""

    def __init__(self, every: float = 0.2) -> None:
        self.samples: list[tuple[float, str, float]] = []
        self.phase = "start"
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self.phase, rss_mib()))
            self._stop.wait(self.every)

    def mark(self, phase: str) -> None:
        """Enter ``phase``, with a sample at its start (a phase may be shorter than the interval)."""
        self.phase = phase
        self.samples.append((time.perf_counter(), phase, rss_mib()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def of(self, phase: str) -> list[float]:
        return [rss for _, p, rss in self.samples if p == phase]


def child(config: Path, out: Path, steps: int) -> dict[str, Any]:
    """One training run in this process: set-up, then ``steps`` updates; -> its memory figures."""
    import logging

    import torch

    import model.training.train as train_module
    from model.training.config import load_train_config
    from model.training.train import Trainer

    logging.basicConfig(level=logging.WARNING)
    sampler = Sampler()
    cfg = load_train_config(config)
    scan_seconds: list[float] = []
    original_scan = train_module.scan

    def timed_scan(*args: Any, **kwargs: Any) -> Any:
        sampler.mark("scan")
        start = time.perf_counter()
        try:
            return original_scan(*args, **kwargs)
        finally:
            scan_seconds.append(time.perf_counter() - start)
            sampler.mark("setup")

    train_module.scan = timed_scan
    sampler.mark("setup")
    start = time.perf_counter()
    trainer = Trainer(cfg, out, torch.device("cpu"))
    setup = time.perf_counter() - start
    assert trainer.stream is not None
    given = 0
    pairs = trainer.stream.pairs

    def counted(epoch: int) -> Any:
        nonlocal given
        for item in pairs(epoch):
            given += 1
            yield item

    trainer.stream.pairs = counted  # type: ignore[method-assign]
    trainer.model.train()
    sampler.mark("train")
    start = time.perf_counter()
    trainer.run(max_steps_per_epoch=steps)  # (its validation at the end is tagged "train" too)
    seconds = time.perf_counter() - start
    trained_on = given
    # then the whole of the next epoch's batches, without a model: every pair read, cleaned,
    # mixed, shuffled, tokenized and batched
    m = cfg.model
    sampler.mark("stream")
    start = time.perf_counter()
    batches = sum(1 for _ in trainer.stream.batches(1, trainer._encode, cfg.optim.max_tokens, m.max_positions - 1,
                                                    (m.pad_id, m.bos_id, m.eos_id)))  # fmt: skip
    stream_seconds = time.perf_counter() - start
    sampler.mark("end")
    sampler.stop()
    streamed = sampler.of("stream")
    train = sampler.of("train")
    quartiles = statistics.quantiles(train, n=4) if len(train) > 1 else train * 3
    return {
        "scan_s": round(scan_seconds[0], 1),
        "scan_peak_rss_mib": round(max(sampler.of("scan")), 1),
        "setup_s": round(setup, 1),
        "setup_peak_rss_mib": round(max(sampler.of("scan") + sampler.of("setup")), 1),
        "train_s": round(seconds, 1),
        "steps": trainer.step,
        "pairs_streamed": trained_on,
        "train_rss_start_mib": round(train[0], 1),
        "train_rss_q1_median_q3_mib": [round(q, 1) for q in quartiles],
        "train_rss_end_mib": round(train[-1], 1),
        "train_peak_rss_mib": round(max(train), 1),
        "epoch_stream_s": round(stream_seconds, 1),
        "epoch_stream_batches": batches,
        "epoch_stream_pairs": given - trained_on,
        "epoch_stream_rss_q1_median_q3_mib": [round(q, 1) for q in statistics.quantiles(streamed, n=4)],
        "epoch_stream_peak_rss_mib": round(max(streamed), 1),
        "samples": len(sampler.samples),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="3000000,300000", help="corpus sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=1000, help="updates per run")
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "train-memory")
    parser.add_argument("--child", nargs=3, metavar=("CONFIG", "OUT", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.child[0]), Path(args.child[1]), int(args.child[2]))), flush=True)
        return
    args.folder.mkdir(parents=True, exist_ok=True)
    generate(args.folder, "valid", 200, seed=1)
    for size in (int(p) for p in args.pairs.split(",")):
        stem = f"train{size}"
        started = time.perf_counter()
        size_bytes = generate(args.folder, stem, size, seed=size)
        made = time.perf_counter() - started
        config = args.folder / f"{stem}.toml"
        config.write_text(CONFIG.format(folder=args.folder, stem=stem))
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, "-m", "bench.train_memory", "--child", str(config), out, str(args.steps)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(done.stderr[-4000:])
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps({"pairs": size, "corpus_gzip_mib": round(size_bytes / 2**20, 1),
                          "generated_s": round(made, 1), **result}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
