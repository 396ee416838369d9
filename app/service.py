"""One translation direction as the service sees it: model, scheduler, cache, text handling."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app import timing
from app.batching import BatchLimits, BatchScheduler, Job, Work
from app.errors import ApiError
from app.metrics import Metrics
from app.segmentation import Segment, rejoin, segment, sentences
from app.settings import Settings
from model import checkpoint, kernels
from model.allocator import release_free_memory
from model.decoding import DecodingOptions, Hypothesis
from model.kernels import KernelPlan
from model.translator import AttentionResult, Translator

log = logging.getLogger(__name__)


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("TRANSLATOR_DEVICE=cuda but no CUDA device is available")
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> str:
    """The ``TRANSLATOR_DTYPE`` setting -> a precision of ``model.kernels`` (auto: float16 on
    CUDA, float32 on the CPU)."""
    if name == "auto":
        return "float16" if device.type == "cuda" else "float32"
    return name


def kernel_plan(settings: Settings) -> KernelPlan:
    """What the settings ask for, checked against this machine before anything is loaded:
    raises ``RuntimeError`` or ``UnsupportedPrecision`` naming the setting."""
    device = resolve_device(settings.device)
    return kernels.choose(device, resolve_precision(settings.dtype, device))


class TranslationService:
    """A loaded checkpoint of one direction with its batching scheduler and LRU cache."""

    def __init__(self, path: Path, settings: Settings, metrics: Metrics) -> None:
        self.device = resolve_device(settings.device)
        self.precision = resolve_precision(settings.dtype, self.device)
        ckpt = checkpoint.load(path, self.device, self.precision)
        self.plan = ckpt.plan
        self.meta, self.path = ckpt.meta, path
        self.source, self.target = str(ckpt.meta["source_lang"]), str(ckpt.meta["target_lang"])
        self.direction = f"{self.source}-{self.target}"
        self.translator = Translator(ckpt.model, ckpt.tokenizer)
        self.settings, self.metrics = settings, metrics
        limits = BatchLimits(
            settings.max_batch_sentences, settings.max_batch_tokens, settings.max_wait_ms / 1000, settings.queue_size
        )
        self.scheduler = BatchScheduler(
            self.translator.open_session, limits, metrics, self.direction, on_idle=release_free_memory
        )
        self._cache: OrderedDict[tuple[str, str, DecodingOptions], list[Hypothesis]] = OrderedDict()
        self.quality = _read_metrics(path)

    def start(self) -> None:
        self.scheduler.start(warm_up=self.warm_up)
        for family in (self.metrics.decode_steps, self.metrics.source_tokens, self.metrics.target_tokens):
            family.labels(self.direction)  # the series exist (at 0) before the first request
        self.metrics.model_info.labels(self.direction, self.device.type, self.precision).set(1)

    def warm_up(self) -> None:
        """Run greedy and beam decoding once so the first request pays no one-time costs."""
        ids = self.translator.encode(["Ein Mann fährt mit dem Fahrrad.", "Zwei Hunde spielen im Schnee."])
        for beam in (1, 4):
            self.translator.decode_batch(ids, DecodingOptions(beam_size=beam))

    def close(self, timeout: float | None = None) -> None:
        self.scheduler.close(timeout)

    # --- translation ----------------------------------------------------------------------
    def prepare(self, texts: Sequence[str]) -> list[tuple[list[Segment], list[list[int]]]]:
        """Segment and tokenize; reject (422) a sentence longer than the model can take."""
        prepared = []
        for index, text in enumerate(texts):
            segs = segment(text)
            ids = self.translator.encode(sentences(segs))
            longest = max((len(i) for i in ids), default=0)
            if longest > self.translator.max_source_tokens:
                raise ApiError(
                    422,
                    "text_too_long",
                    f"item {index}: a sentence has {longest} tokens; the model takes at most "
                    f"{self.translator.max_source_tokens} per sentence (split the text)",
                )
            prepared.append((segs, ids))
        return prepared

    async def translate(self, texts: Sequence[str], options: DecodingOptions, timeout: float) -> list[ItemResult]:
        """Translate every text; all their sentences go through the batcher together."""
        start = time.perf_counter()
        with timing.phase("prepare"):
            prepared = self.prepare(texts)
        flat = [(text_index, ids) for text_index, (_, ids_list) in enumerate(prepared) for ids in ids_list]
        sources = [s for segs, _ in prepared for s in sentences(segs)]
        results: list[list[Hypothesis] | None] = [self._cache_get(s, options) for s in sources]
        missing = [i for i, r in enumerate(results) if r is None]
        jobs = self.scheduler.submit([flat[i][1] for i in missing], options) if missing else []
        await self.wait(jobs, timeout)
        for i, job in zip(missing, jobs, strict=True):
            results[i] = job.future.result()
            self._cache_put(sources[i], options, job.future.result())
        record_sentence_phases(jobs)
        queue_ms = max((1000 * (j.started - j.enqueued) for j in jobs), default=0.0)
        total_ms = 1000 * (time.perf_counter() - start)
        out, cursor = [], 0
        with timing.phase("detokenize"):
            for segs, ids_list in prepared:
                sents = [
                    SentenceResult(sources[k], flat[k][1], results[k] or [], k not in missing)
                    for k in range(cursor, cursor + len(ids_list))
                ]
                cursor += len(ids_list)
                out.append(ItemResult(self._texts(segs, sents, options.n_best), sents, queue_ms, total_ms))
        return out

    async def wait(self, jobs: Sequence[Work], timeout: float) -> None:
        """Await jobs; on timeout or cancellation withdraw whatever is still queued."""
        if not jobs:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*(j.future for j in jobs)), timeout)
        except TimeoutError:
            self.scheduler.cancel(jobs)
            raise ApiError(504, "timeout", f"translation took longer than {timeout:g} s") from None
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
        key = (self.precision, sentence, options)  # int8 and float32 results never mix
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
        key = (self.precision, sentence, options)
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
            raise ApiError(
                422, "text_too_long", f"/attention takes at most {limit} tokens; this text has {len(src_ids)}"
            )
        deadline = time.perf_counter() + timeout
        jobs = self.scheduler.submit([src_ids], options)
        await self.wait(jobs, timeout)
        record_sentence_phases(jobs)
        hyp = jobs[0].future.result()[0]
        with timing.phase("maps"):
            call = self.scheduler.call(lambda: self.translator.attention(src_ids, hyp.ids))
            await self.wait([call], max(deadline - time.perf_counter(), 0.001))
        return self.translator.tokenizer.decode([hyp.ids])[0], call.future.result()

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
            "kernel": self.plan.kernel,
            "cpu_isa": self.plan.isa if self.device.type == "cpu" else None,
            "max_source_tokens": self.translator.max_source_tokens,
            "recommended_decoding": self.meta.get("decoding", {}),
            "quality": self.quality,
        }


def record_sentence_phases(jobs: Sequence[Job]) -> None:
    """The request's queue/encode/decode/handoff phases: those of its sentence that finished
    last, which decided when the request could answer (app/timing.py)."""
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


def discover(weights_dir: Path) -> list[Path]:
    """Every checkpoint folder (one holding config.json) directly under ``weights_dir``."""
    if not weights_dir.is_dir():
        raise RuntimeError(f"weights folder {weights_dir} not found")
    found = sorted(p for p in weights_dir.iterdir() if (p / checkpoint.CONFIG).is_file())
    if not found:
        raise RuntimeError(f"no checkpoint folders (with {checkpoint.CONFIG}) in {weights_dir}")
    return found
