"""The models as the service sees them: a loaded checkpoint and its scheduler (``LoadedModel``),
and each direction it serves (``TranslationService``: text handling, limits, cache)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from app.formats.markup import Aligned
from app.formats.segmentation import Segment, rejoin, segment, sentences
from app.observability import timing
from app.observability.metrics import Metrics
from app.serving.scheduler import BatchLimits, BatchScheduler, Job, ModelThread, Work
from app.settings import Settings
from model import checkpoint
from model.engine import kernels, loading
from model.engine.allocator import release_free_memory
from model.engine.binding import step_dtype
from model.engine.decoding import Hypothesis
from model.engine.kernels import KernelPlan
from model.engine.options import DecodingOptions, Repetition
from model.engine.translator import AttentionResult, Translator
from model.network.attention_words import merge_pieces, word_alignment
from model.network.precision import resolve_precision

log = logging.getLogger(__name__)

T = TypeVar("T")

# sentences aligned per model call (``translate_aligned``): a document's hundreds of sentences
# would otherwise hold the model thread, and every other model, for one long call
ALIGN_CHUNK = 8

# A model's freed heap goes back to the OS (``release_free_memory``) once it has had no work for
# this long, not between one client's back-to-back requests: handing it back after each one
# made the next one fault its pages in again, slowing its admission and decoding
# (docs/benchmarks/README.md#allocator); the memory falls back once the traffic pauses.
TRIM_AFTER_IDLE_S = 0.5


class TranslationError(Exception):
    """What the service refuses to translate; the HTTP edge gives each kind its status
    (``app.http.errors.refusal``). The message is the client's."""


class TextTooLong(TranslationError):
    """A text has more tokens than ``/attention`` (or the model) takes."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"/attention takes at most {limit} tokens; this text has {tokens}")
        self.tokens, self.limit = tokens, limit


class SentenceTooLong(TranslationError):
    """A sentence has more tokens than the model takes (the text should be split)."""

    def __init__(self, item: int, tokens: int, limit: int) -> None:
        super().__init__(
            f"item {item}: a sentence has {tokens} tokens; the model takes at most {limit} per sentence "
            "(split the text)"
        )
        self.item, self.tokens, self.limit = item, tokens, limit


class Timeout(TranslationError):
    """The translation did not finish within the request timeout (its work is withdrawn)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"translation took longer than {seconds:g} s")
        self.seconds = seconds


@dataclass(frozen=True)
class SentenceResult:
    source: str
    source_ids: list[int]
    hypotheses: list[Hypothesis]
    cached: bool


@dataclass(frozen=True)
class ItemResult:
    """One text of a request: n-best texts (best first) and per-sentence details."""

    texts: list[str]
    sentences: list[SentenceResult]
    queue_ms: float
    total_ms: float


@dataclass(eq=False)
class Sentence:
    """One sentence of a request on its way through ``TranslationService.translate``: built
    once, then its hypotheses filled in from the cache or from its job."""

    item: int  # the text it belongs to
    source: str
    ids: list[int]
    hypotheses: list[Hypothesis] | None = None
    job: Job | None = None  # None when the cache answered

    def result(self) -> SentenceResult:
        assert self.hypotheses is not None, "not translated yet"
        return SentenceResult(self.source, self.ids, self.hypotheses, cached=self.job is None)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("TRANSLATOR_DEVICE=cuda but no CUDA device is available")
    return torch.device(name)


def kernel_plan(settings: Settings) -> KernelPlan:
    """What the settings ask for, checked against this machine before anything is loaded:
    raises ``RuntimeError`` or ``UnsupportedPrecision`` naming the setting."""
    device = resolve_device(settings.device)
    return kernels.choose(device, resolve_precision(settings.dtype, device.type), fused=settings.fused_step)


class LoadedModel:
    """A checkpoint loaded once, with the batching scheduler that all the directions it serves
    share (its work runs on the process's one model thread, ``ModelThread``): a many-to-many
    model's sentences of different directions decode in the same batches (each source led by
    its target's tag). The scheduler's metrics are labelled with the direction, or the
    folder's name for a many-to-many model."""

    def __init__(self, path: Path, settings: Settings, metrics: Metrics, thread: ModelThread | None = None) -> None:
        """Loads the checkpoint on the calling thread: the service calls this on ``thread``."""
        self.device = resolve_device(settings.device)
        self.precision = resolve_precision(settings.dtype, self.device.type)
        self.ckpt = loading.load(path, self.device, self.precision, fused=settings.fused_step)
        self.shortlist = loading.use_shortlist(self.ckpt, settings.shortlist)
        self.vocabulary = loading.vocabulary_label(self.shortlist)
        self.path, self.meta, self.plan = path, self.ckpt.meta, self.ckpt.plan
        self.directions = checkpoint.directions(self.meta)
        self.tagged = bool(self.meta.get("target_tags"))
        self.label = path.name if self.tagged else f"{self.directions[0][0]}-{self.directions[0][1]}"
        self.quality = _read_metrics(path)  # metrics.json: per direction for a many-to-many model
        self.translator = Translator(self.ckpt.model, self.ckpt.tokenizer, shortlist=self.shortlist)  # tagged sources
        limits = BatchLimits(
            settings.max_batch_sentences, settings.max_batch_tokens, settings.max_wait_ms / 1000, settings.queue_size,
            settings.join_group, settings.max_join_wait_ms / 1000,
        )  # fmt: skip
        self.scheduler = BatchScheduler(
            self.translator.open_session,
            limits,
            metrics,
            self.label,
            on_idle=release_free_memory,
            thread=thread,
            idle_delay_s=TRIM_AFTER_IDLE_S,
        )
        self.metrics = metrics

    def start(self) -> None:
        self.scheduler.start(warm_up=self.warm_up)
        for family in (self.metrics.decode_steps, self.metrics.source_tokens, self.metrics.target_tokens):
            family.labels(self.label)  # the series exist (at 0) before the first request

    def warm_up(self) -> None:
        """Run greedy and beam decoding once so the first request pays no one-time costs."""
        target = self.directions[0][1]
        translator = Translator(self.ckpt.model, self.ckpt.tokenizer, self.ckpt.source_prefix(target), self.shortlist)
        ids = translator.encode(["Ein Mann fährt mit dem Fahrrad.", "Zwei Hunde spielen im Schnee."])
        for beam in (1, 4):
            translator.decode_batch(ids, DecodingOptions(beam_size=beam))


class TranslationService:
    """One direction of a loaded model: its text handling, limits and LRU cache; the model's
    scheduler is shared with the model's other directions (``LoadedModel``)."""

    def __init__(self, loaded: LoadedModel, source: str, target: str, settings: Settings) -> None:
        self.loaded = loaded
        self.device, self.precision, self.plan = loaded.device, loaded.precision, loaded.plan
        self.meta, self.path = loaded.meta, loaded.path
        self.source, self.target = source, target
        self.direction = f"{source}-{target}"
        self.prefix = loaded.ckpt.source_prefix(target)
        self.translator = Translator(loaded.ckpt.model, loaded.ckpt.tokenizer, self.prefix)
        self.settings, self.metrics = settings, loaded.metrics
        self.scheduler = loaded.scheduler
        self._cache: OrderedDict[tuple[str, str, str, DecodingOptions], list[Hypothesis]] = OrderedDict()
        self.quality = loaded.quality.get(self.direction, {}) if loaded.tagged else loaded.quality

    def start(self) -> None:
        """The model's scheduler runs (``LoadedModel.start``); this direction is announced."""
        self.metrics.model_info.labels(self.direction, self.device.type, self.precision, self.loaded.vocabulary).set(1)

    def _submit(self, sentences: Sequence[Sequence[int]], options: DecodingOptions) -> list[Job]:
        return self.scheduler.submit([[*self.prefix, *ids] for ids in sentences], options)

    # --- translation ----------------------------------------------------------------------
    def decoding_options(
        self, beam_size: int | None, n_best: int, max_length: int | None, repetition: Repetition | None = None
    ) -> DecodingOptions:
        """A request's options on top of this model card's decoding (``loading.decoding_options``,
        as ``model.training.evaluate`` builds them); the server's limits are checked at the HTTP edge."""
        return loading.decoding_options(self.meta, beam_size, n_best, max_length, self.direction, repetition)

    def prepare(self, texts: Sequence[str]) -> tuple[list[list[Segment]], list[Sentence]]:
        """Segment and tokenize: each text's segments, and every sentence of every text in
        order. A sentence longer than the model can take raises ``SentenceTooLong``."""
        segmented: list[list[Segment]] = []
        found: list[Sentence] = []
        for index, text in enumerate(texts):
            segs = segment(text)
            sources = sentences(segs)
            ids = self.translator.encode(sources)
            longest = max((len(i) for i in ids), default=0)
            if longest > self.translator.max_source_tokens:
                raise SentenceTooLong(index, longest, self.translator.max_source_tokens)
            segmented.append(segs)
            found.extend(Sentence(index, source, i) for source, i in zip(sources, ids, strict=True))
        return segmented, found

    async def translate(self, texts: Sequence[str], options: DecodingOptions, timeout: float) -> list[ItemResult]:
        """Translate every text; all their sentences go through the batcher together."""
        start = time.perf_counter()
        with timing.phase("prepare"):
            segmented, sents = self.prepare(texts)
        for sent in sents:
            sent.hypotheses = self._cache_get(sent.source, options)
        missing = [sent for sent in sents if sent.hypotheses is None]
        jobs = self._submit([sent.ids for sent in missing], options) if missing else []
        for sent, job in zip(missing, jobs, strict=True):
            sent.job = job
        await self.wait(jobs, timeout)
        for sent in missing:
            assert sent.job is not None
            sent.hypotheses = sent.job.future.result()
            self._cache_put(sent.source, options, sent.hypotheses)
        record_sentence_phases(jobs)
        queue_ms = max((1000 * (j.started - j.enqueued) for j in jobs), default=0.0)
        total_ms = 1000 * (time.perf_counter() - start)
        per_item: list[list[SentenceResult]] = [[] for _ in texts]
        for sent in sents:
            per_item[sent.item].append(sent.result())
        with timing.phase("detokenize"):
            return [
                ItemResult(self._texts(segs, results, options.n_best), results, queue_ms, total_ms)
                for segs, results in zip(segmented, per_item, strict=True)
            ]

    async def wait(self, jobs: Sequence[Work], timeout: float) -> None:
        """Await jobs; on timeout or cancellation withdraw whatever is still queued."""
        if not jobs:
            return
        try:
            async with asyncio.timeout(timeout):
                await (jobs[0].future if len(jobs) == 1 else asyncio.gather(*(j.future for j in jobs)))
        except TimeoutError:
            self.scheduler.cancel(jobs)
            raise Timeout(timeout) from None
        except asyncio.CancelledError:
            self.scheduler.cancel(jobs)
            raise

    def _texts(self, segs: list[Segment], sents: list[SentenceResult], n_best: int) -> list[str]:
        """n-best texts: the k-th alternative joins every sentence's k-th hypothesis."""
        texts = []
        for k in range(n_best):
            hyps = [s.hypotheses[min(k, len(s.hypotheses) - 1)].ids for s in sents]
            texts.append(rejoin(segs, self.translator.tokenizer.decode(hyps)))
        return texts

    def _cache_get(self, sentence: str, options: DecodingOptions) -> list[Hypothesis] | None:
        if self.settings.cache_size == 0:
            return None
        key = (self.precision, self.loaded.vocabulary, sentence, options)  # int8 and float32 results never mix
        hit = self._cache.get(key)
        if hit is None:
            self.metrics.cache_misses.inc()
            return None
        self._cache.move_to_end(key)
        self.metrics.cache_hits.inc()
        return hit

    def _cache_put(self, sentence: str, options: DecodingOptions, hyps: list[Hypothesis]) -> None:
        if self.settings.cache_size == 0:
            return
        key = (self.precision, self.loaded.vocabulary, sentence, options)
        self._cache[key] = hyps
        self._cache.move_to_end(key)
        while len(self._cache) > self.settings.cache_size:
            self._cache.popitem(last=False)

    # --- attention ------------------------------------------------------------------------
    async def attention(self, text: str, options: DecodingOptions, timeout: float) -> tuple[str, AttentionResult]:
        """Translate one text as a single sequence, then get exact maps of the returned hypothesis."""
        with timing.phase("prepare"):
            src_ids = self.translator.encode([text.strip()])[0]
        limit = min(self.settings.attention_max_tokens, self.translator.max_source_tokens)
        if len(src_ids) > limit:
            raise TextTooLong(len(src_ids), limit)
        deadline = time.perf_counter() + timeout
        jobs = self._submit([src_ids], options)
        await self.wait(jobs, timeout)
        record_sentence_phases(jobs)
        hyp = jobs[0].future.result()[0]
        with timing.phase("maps"):
            maps = functools.partial(self.translator.attention, src_ids, hyp.ids)
            result = await self.on_model_thread(maps, max(deadline - time.perf_counter(), 0.001))
        return self.translator.tokenizer.decode([hyp.ids])[0], result

    async def translate_aligned(
        self, sentences: Sequence[str], options: DecodingOptions, timeout: float
    ) -> tuple[list[ItemResult], list[Aligned | None]]:
        """Translate sentences as ``translate`` does, and align each best translation's words
        with its source's (``model.network.attention_words.word_alignment``, one teacher-forced pass
        each on the model's thread). A text that is more than one sentence gets no alignment."""
        deadline = time.perf_counter() + timeout
        items = await self.translate(sentences, options, timeout)
        pairs = [
            (text, item.sentences[0]) if len(item.sentences) == 1 else None
            for text, item in zip(sentences, items, strict=True)
        ]
        with timing.phase("align"):
            # a few sentences per model call: other models take their turns in between
            chunks = [pairs[i : i + ALIGN_CHUNK] for i in range(0, len(pairs), ALIGN_CHUNK)]
            calls = [self.scheduler.call(functools.partial(self._align_all, chunk)) for chunk in chunks]
            await self.wait(calls, max(deadline - time.perf_counter(), 0.001))
        return items, [aligned for call in calls for aligned in call.future.result()]

    async def on_model_thread(self, fn: Callable[[], T], timeout: float) -> T:
        """``fn()`` run on the model thread between steps: torch work belongs there (one OpenMP
        pool per process, ``app.serving.scheduler.ModelThread``)."""
        call = self.scheduler.call(fn)
        await self.wait([call], timeout)
        return cast(T, call.future.result())

    def _align_all(self, pairs: Sequence[tuple[str, SentenceResult] | None]) -> list[Aligned | None]:
        return [None if p is None else self._align(*p) for p in pairs]

    def _align(self, text: str, sentence: SentenceResult) -> Aligned | None:
        tokenizer = self.translator.tokenizer
        ids, spans = tokenizer.piece_spans(text.strip())
        if ids != sentence.source_ids:  # (the text was not the sentence itself)
            return None
        lead = len(text) - len(text.lstrip())
        hyp = sentence.hypotheses[0].ids
        result = self.translator.attention(ids, hyp)
        _, source_groups = merge_pieces(result.source[:-1])  # (</s> last)
        _, target_groups = merge_pieces(result.target[:-1])
        return Aligned(
            words=tuple(tokenizer.decode([[hyp[i] for i in group] for group in target_groups])),
            links=tuple(word_alignment(result.cross, result.source, result.target)),
            source_spans=tuple((lead + spans[g[0]][0], lead + spans[g[-1]][1]) for g in source_groups),
        )

    def info(self) -> dict[str, Any]:
        cfg = self.translator.config
        return {
            "source": self.source,
            "target": self.target,
            "model": cfg.to_dict(),
            "parameters": self.translator.model.num_parameters(),
            "n_layers": cfg.decoder_layers,
            "n_encoder_layers": cfg.encoder_layers,
            "n_heads": cfg.n_heads,
            "device": self.device.type,
            "dtype": self.precision,
            "vocabulary": self.loaded.vocabulary,
            "kernel": self.plan.kernel,
            "step_kernel": self.plan.step,
            "cpu_isa": self.plan.isa if self.device.type == "cpu" else None,
            "fused_step": self.translator.model.fused_step,
            "int8_products": kernels.int8_products(self.precision, self.translator.model.fused_step),
            "kv_cache": str(self.translator.model.kv_dtype or step_dtype(self.translator.model)).removeprefix("torch."),
            "max_source_tokens": self.translator.max_source_tokens,
            "recommended_decoding": checkpoint.recommended_decoding(self.meta, self.direction),
            "quality": self.quality,
        }


def record_sentence_phases(jobs: Sequence[Job]) -> None:
    """The request's queue/encode/decode/handoff phases: those of its sentence that finished
    last, which decided when the request could answer (app/observability/timing.py)."""
    done = [job for job in jobs if job.delivered]
    if not done:
        return
    last = max(done, key=lambda job: job.finished)
    timing.record_interval("queue", last.enqueued, last.started)
    timing.record_interval("encode", last.started, last.encoded)
    timing.record_interval("decode", last.encoded, last.finished)
    timing.record_interval("handoff", last.finished, last.delivered)


def _read_metrics(path: Path) -> dict[str, Any]:
    file = path / checkpoint.METRICS
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def discover(weights_dir: Path, languages: Sequence[str] = ()) -> list[Path]:
    """Every checkpoint folder (one holding config.json) directly under ``weights_dir``; with
    ``languages``, only those with a direction between two of them."""
    if not weights_dir.is_dir():
        raise RuntimeError(f"weights folder {weights_dir} not found")
    found = sorted(p for p in weights_dir.iterdir() if (p / checkpoint.CONFIG).is_file())
    if not found:
        raise RuntimeError(f"no checkpoint folders (with {checkpoint.CONFIG}) in {weights_dir}")
    if languages:
        # (a checkpoint whose config cannot be read stays: its load fails later, as without the setting)
        found = [p for p in found if (pairs := _served(p)) is None or any(between(d, languages) for d in pairs)]
        if not found:
            raise RuntimeError(
                f"TRANSLATOR_LOAD_ONLY={','.join(languages)}: no checkpoint in {weights_dir} translates between these "
                "languages"
            )
    return found


def between(pair: tuple[str, str], languages: Sequence[str]) -> bool:
    """Whether ``pair`` is a direction between two of ``languages`` (all, when none are named:
    the load_only setting)."""
    return not languages or set(pair) <= set(languages)


def _served(path: Path) -> list[tuple[str, str]] | None:
    """A checkpoint's directions, or None when its config cannot be read (its load fails later,
    in the background: the server runs, unhealthy, without naming paths)."""
    try:
        return checkpoint.directions(checkpoint.read_meta(path))
    except (checkpoint.CheckpointError, KeyError, IndexError, TypeError):
        return None


def assign_directions(paths: Sequence[Path], languages: Sequence[str] = ()) -> dict[Path, list[tuple[str, str]] | None]:
    """Which checkpoint serves each direction, when more than one could: the one with the
    higher validation BLEU in its metrics.json (a many-to-many model scores each direction), a
    single-direction model on a tie or without scores. -> the checkpoints to load, each with
    the directions it serves (None: unreadable, loaded to fail). With ``languages``, only
    directions between two of them."""
    chosen: dict[tuple[str, str], tuple[float, int, Path]] = {}
    unreadable: dict[Path, list[tuple[str, str]] | None] = {}
    for path in paths:
        pairs = _served(path)
        if pairs is None:
            unreadable[path] = None
            continue
        quality = _read_metrics(path)
        for pair in (p for p in pairs if between(p, languages)):
            scores = quality.get(f"{pair[0]}-{pair[1]}", {}) if len(pairs) > 1 else quality
            rank = (_val_bleu(scores), -len(pairs), path)
            if pair not in chosen or rank[:2] > chosen[pair][:2]:
                chosen[pair] = rank
    assigned: dict[Path, list[tuple[str, str]]] = {}
    for pair, (_, _, path) in sorted(chosen.items()):
        assigned.setdefault(path, []).append(pair)
    return dict(sorted({**unreadable, **assigned}.items()))


def _val_bleu(scores: dict[str, Any]) -> float:
    """Beam-search BLEU on val from a metrics.json section (greedy when no beam): -inf if none."""
    val = scores.get("val")
    if not isinstance(val, dict):
        return -math.inf
    beams = [k for k in val if k.startswith("beam")] or [k for k in val if k == "greedy"]
    try:
        return float(val[beams[0]]["bleu"]) if beams else -math.inf
    except (KeyError, TypeError, ValueError):
        return -math.inf
