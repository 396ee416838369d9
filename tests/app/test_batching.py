"""The batch scheduler on its own: the worker thread owns the model, from warm-up on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from app.batching import BatchLimits, BatchScheduler
from app.metrics import Metrics
from model.decoding import DecodingOptions, Finished, Hypothesis

LIMITS = BatchLimits(max_sentences=8, max_tokens=1000, max_wait_s=0.0, queue_size=100)


def never_called(ids: list[list[int]], options: DecodingOptions) -> Iterator[Finished]:
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


def test_each_sentence_is_delivered_as_soon_as_it_is_done() -> None:
    """A short sentence's request is answered while the batch still decodes a long one."""
    release = threading.Event()

    def run_batch(ids: list[list[int]], options: DecodingOptions) -> Iterator[Finished]:
        yield Finished(1, [Hypothesis(tuple(ids[1]), -1.0, -1.0, True)], 2)
        assert release.wait(10), "the test never released the long sentence"
        yield Finished(0, [Hypothesis(tuple(ids[0]), -2.0, -2.0, True)], 12)

    async def scenario(scheduler: BatchScheduler) -> None:
        long_job, short_job = scheduler.submit([[5] * 10, [6]], DecodingOptions(beam_size=1))
        short = await asyncio.wait_for(short_job.future, 10)
        assert short[0].ids == (6,)
        assert not long_job.future.done()  # same batch, still decoding
        release.set()
        long = await asyncio.wait_for(long_job.future, 10)
        assert long[0].ids == (5,) * 10

    metrics = Metrics()
    scheduler = BatchScheduler(run_batch, BatchLimits(8, 1000, 0.05, 100), metrics, "xx-yy")
    scheduler.start()
    try:
        asyncio.run(scenario(scheduler))
    finally:
        release.set()
        scheduler.close(timeout=5)
    assert metrics.registry.get_sample_value("translator_batch_sentences_sum") == 2  # one batch of both
