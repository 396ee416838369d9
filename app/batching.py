"""Dynamic batching: sentences from concurrent requests share model batches.

Requests (on the event loop) put sentence jobs into a bounded queue and await futures.
One worker thread per model takes the oldest job, waits at most ``max_wait`` for
company, forms a batch of jobs with the same decoding options bounded by sentence count
and padded tokens (sorted by length, so little padding), runs it off the event loop and
hands each job its result. Cancelled jobs (timeouts, disconnected clients) leave the queue
at once and are never computed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.metrics import Metrics
from model.decoding import DecodingOptions, Finished, Hypothesis

log = logging.getLogger(__name__)

# Decodes a batch, yielding each sentence as soon as it is done (``Translator.decode_stream``).
RunBatch = Callable[[list[list[int]], DecodingOptions], Iterator[Finished]]


class QueueFull(Exception):
    """The queue has no room for the request's sentences; the client should retry later."""


class SchedulerClosed(Exception):
    """The scheduler is shutting down and takes no new work."""


@dataclass(eq=False)
class Job:
    """One sentence to decode, or a callable to run on the model thread (``call``)."""

    ids: list[int]
    options: DecodingOptions | None
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.perf_counter)
    call: Callable[[], Any] | None = None
    started: float = 0.0


@dataclass(frozen=True)
class BatchLimits:
    max_sentences: int
    max_tokens: int
    max_wait_s: float
    queue_size: int


class BatchScheduler:
    """Batches the sentences of one model; ``run_batch`` executes on a dedicated thread."""

    def __init__(self, run_batch: RunBatch, limits: BatchLimits, metrics: Metrics, direction: str) -> None:
        self.run_batch, self.limits, self.metrics, self.direction = run_batch, limits, metrics, direction
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def start(self, warm_up: Callable[[], None] | None = None) -> None:
        """Start the worker; it runs ``warm_up`` first, and this returns (or raises) when that is done.

        All model work runs on the worker thread, warm-up included. torch's OpenMP pool is per
        calling thread, and once more pool threads exist than cores (say, the warm-up's pool
        in another thread that lives on), libgomp throttles their spin-waiting: single-sentence
        decoding on the worker then took 2x as long (86 against 42 ms, beam 4, this machine).
        """
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                if warm_up is not None:
                    warm_up()
            except BaseException as err:
                failure.append(err)
                return
            finally:
                started.set()
            self._work()

        self._thread = threading.Thread(target=run, name=f"batcher-{self.direction}", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]

    def close(self, timeout: float | None = None) -> None:
        """Finish the jobs already queued, then stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def depth(self) -> int:
        return len(self._pending)

    # --- called on the event loop ---------------------------------------------------------
    def submit(self, sentences: Sequence[list[int]], options: DecodingOptions) -> list[Job]:
        """Queue all sentences of a request, or none of them (QueueFull)."""
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, options, loop.create_future(), loop) for ids in sentences]
        self._enqueue(jobs)
        return jobs

    def call(self, fn: Callable[[], Any]) -> Job:
        """Run ``fn`` on the model thread between batches (exclusive use of the model)."""
        loop = asyncio.get_running_loop()
        job = Job([], None, loop.create_future(), loop, call=fn)
        self._enqueue([job])
        return job

    def cancel(self, jobs: Sequence[Job]) -> None:
        """Withdraw jobs that are still queued (timeouts, disconnected clients)."""
        with self._cond:
            for job in jobs:
                if not job.future.done():
                    job.future.cancel()
            before = len(self._pending)
            self._pending = deque(j for j in self._pending if not j.future.done())
            if len(self._pending) != before:
                self.metrics.queue_depth.dec(before - len(self._pending))

    def _enqueue(self, jobs: list[Job]) -> None:
        with self._cond:
            if self._closing:
                raise SchedulerClosed("shutting down")
            if len(self._pending) + len(jobs) > self.limits.queue_size:
                raise QueueFull(f"{len(self._pending)} sentences queued (limit {self.limits.queue_size})")
            self._pending.extend(jobs)
            self.metrics.queue_depth.inc(len(jobs))
            self._cond.notify()

    # --- the worker thread ----------------------------------------------------------------
    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._run(batch)

    def _next_batch(self) -> list[Job] | None:
        """Block until a batch is ready (or None when closing with nothing left)."""
        lim = self.limits
        with self._cond:
            while not self._pending:
                if self._closing:
                    return None
                self._cond.wait()
            deadline = self._pending[0].enqueued + lim.max_wait_s
            while len(self._pending) < lim.max_sentences and not self._closing:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if not self._pending:  # everything was cancelled while we waited
                return []
            batch = self._take_compatible()
            self.metrics.queue_depth.dec(len(batch))
            return batch

    def _take_compatible(self) -> list[Job]:
        """Jobs sharing the oldest job's options, shortest first, within the batch limits."""
        first = self._pending[0]
        if first.call is not None:
            return [self._pending.popleft()]
        lim = self.limits
        same = [j for j in self._pending if j.call is None and j.options == first.options]
        same = sorted(same[: lim.max_sentences * 4], key=lambda j: len(j.ids))
        # The oldest job always goes in; then the shortest others while they fit.
        chosen, longest = [first], len(first.ids) + 1
        for job in same:
            if job is first or len(chosen) >= lim.max_sentences:
                continue
            width = max(longest, len(job.ids) + 1)
            if width * (len(chosen) + 1) > lim.max_tokens:
                break
            chosen.append(job)
            longest = width
        taken = set(map(id, chosen))
        self._pending = deque(j for j in self._pending if id(j) not in taken)
        return chosen

    def _run(self, batch: list[Job]) -> None:
        now = time.perf_counter()
        for job in batch:
            job.started = now
            self.metrics.queue_wait.observe(now - job.enqueued)
        if not batch:
            return
        try:
            if batch[0].call is not None:
                _deliver(batch[0], batch[0].call())
                return
            self._run_sentences(batch)
        except Exception as err:  # the model failed: every waiting request gets the error
            log.exception("batch of %d failed", len(batch))
            for job in batch:
                job.loop.call_soon_threadsafe(_set_exception, job.future, err)

    def _run_sentences(self, batch: list[Job]) -> None:
        """Decode the batch; each sentence goes to its request the moment it is done, so the
        short sentences of a batch do not wait for its longest one."""
        options = batch[0].options
        assert options is not None
        ids = [job.ids for job in batch]
        steps = target_tokens = delivered = 0
        for done in self.run_batch(ids, options):
            best = done.hypotheses[0]
            steps, target_tokens = max(steps, done.steps), target_tokens + len(best.ids) + int(best.finished)
            _deliver(batch[done.index], done.hypotheses)
            delivered += 1
        if delivered != len(batch):
            raise RuntimeError(f"decoding returned {delivered} of {len(batch)} sentences")
        m, d = self.metrics, self.direction
        m.batch_sentences.observe(len(batch))
        m.batch_tokens.observe(len(batch) * (max(len(i) for i in ids) + 1))
        m.decode_steps.labels(d).inc(steps)
        m.source_tokens.labels(d).inc(sum(len(i) + 1 for i in ids))
        m.target_tokens.labels(d).inc(target_tokens)


def _deliver(job: Job, result: list[Hypothesis] | Any) -> None:
    job.loop.call_soon_threadsafe(_set_result, job.future, result)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], err: BaseException) -> None:
    if not future.done():
        future.set_exception(err)
