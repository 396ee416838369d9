"""The batch scheduler on its own: the worker thread owns the model, from warm-up on."""

from __future__ import annotations

import threading

import pytest

from app.batching import BatchLimits, BatchScheduler
from app.metrics import Metrics
from model.decoding import Decoded, DecodingOptions

LIMITS = BatchLimits(max_sentences=8, max_tokens=1000, max_wait_s=0.0, queue_size=100)


def never_called(ids: list[list[int]], options: DecodingOptions) -> Decoded:
    raise AssertionError("no batch was submitted")


def test_warm_up_runs_on_the_worker_thread_before_start_returns() -> None:
    seen: list[str] = []

    def warm_up() -> None:
        seen.append(threading.current_thread().name)

    scheduler = BatchScheduler(never_called, LIMITS, Metrics(), "xx-yy")
    scheduler.start(warm_up=warm_up)
    try:
        assert seen == ["batcher-xx-yy"]  # done, and not on this thread
    finally:
        scheduler.close(timeout=5)


def test_a_failing_warm_up_fails_start() -> None:
    def warm_up() -> None:
        raise RuntimeError("model is broken")

    scheduler = BatchScheduler(never_called, LIMITS, Metrics(), "xx-yy")
    with pytest.raises(RuntimeError, match="model is broken"):
        scheduler.start(warm_up=warm_up)
