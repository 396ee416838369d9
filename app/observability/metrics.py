"""Prometheus metrics of one service instance (its own registry, with process metrics)."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.metrics import MetricWrapperBase

disable_created_metrics()  # no *_created series: they double the exposition and nobody graphs them

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192)
# Phases of a request and single decoder steps run from tens of microseconds (tokenizing a short
# text) to seconds.
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class Metrics:
    """The ``translator_`` families of DESIGN.md. Label values are few and fixed."""

    def __init__(self) -> None:
        self._series: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.requests = Counter(
            "translator_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.request_duration = Histogram(
            "translator_request_duration_seconds",
            "Request latency",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "translator_queue_wait_seconds",
            "Time a sentence waits before it joins a batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_phase = Histogram(
            "translator_request_phase_seconds",
            "Where a request's time goes, by phase (app/observability/timing.py; also its Server-Timing header)",
            ["endpoint", "phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.decode_step = Histogram(
            "translator_decode_step_seconds",
            "Duration of one decoder step of the running batch (all its sentences)",
            ["direction"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("translator_queue_depth", "Sentences waiting to be batched", registry=r)
        self.inflight = Gauge("translator_inflight_requests", "Requests being handled", registry=r)
        self.batch_sentences = Histogram(
            "translator_batch_sentences", "Sentences per decoder step", buckets=SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "translator_batch_tokens", "Padded source tokens per decoder step", buckets=TOKEN_BUCKETS, registry=r
        )
        self.source_tokens = Counter("translator_source_tokens", "Source tokens translated", ["direction"], registry=r)
        self.target_tokens = Counter("translator_target_tokens", "Target tokens generated", ["direction"], registry=r)
        self.decode_steps = Counter("translator_decode_steps", "Decoder steps run", ["direction"], registry=r)
        self.cancelled = Counter(
            "translator_cancelled_sentences",
            "Sentences whose request timed out or whose client left: withdrawn from the queue or the running batch",
            ["stage"],
            registry=r,
        )
        for stage in ("queued", "running"):
            self.cancelled.labels(stage)  # both series exist (at 0) from start-up
        self.rate_limited = Counter(
            "translator_rate_limited_requests",
            "Requests refused with 429 because their client used up a window (app/storage/ratelimit.py)",
            ["window"],
            registry=r,
        )
        for window in ("minute", "hour", "day"):
            self.rate_limited.labels(window)
        self.rate_limit_errors = Counter(
            "translator_rate_limit_storage_errors",
            "Requests let through unlimited because the rate-limit storage (Redis) failed",
            registry=r,
        )
        self.cache_hits = Counter("translator_cache_hits", "Sentences answered from the cache", registry=r)
        self.cache_misses = Counter("translator_cache_misses", "Sentences not in the cache", registry=r)
        self.model_info = Gauge(
            "translator_model_info",
            "Loaded models (value 1)",
            ["direction", "device", "dtype", "vocabulary"],
            registry=r,
        )

    def series(self, family: MetricWrapperBase, *labels: str) -> Any:
        """``family.labels(*labels)``, looked up once: each ``labels`` call checks the values and
        takes the family's lock, and a request observes a dozen labelled series (its phases).
        The label values are few (``app.middleware.endpoint_label``, phases, directions), so
        this dictionary stays small."""
        key = (family, labels)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = family.labels(*labels)
        return found
