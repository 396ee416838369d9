"""Dynamic, continuous batching: sentences from concurrent requests share model batches.

Requests (on the event loop) put sentence jobs into a bounded queue and await futures.
Each model's scheduler owns a running batch (a decoding session); one model thread runs
every model's work, taking turns (``ModelThread``). When the batch is empty, the scheduler
takes the oldest job and starts a batch of jobs with the same decoding
options at once, unless sentences arrive so often that company is expected within
``max_wait`` (then it waits that long at most: a lone client never waits), bounded by sentence count and padded
source tokens (shortest first, so little padding). While the batch runs, queued jobs with
the batch's options join it between decoder steps, as far as the limits allow (under load
in groups of ``join_group``, one encoder pass each: ``BatchScheduler._joiners_wait``), and each
sentence goes back to its request the step it is done. So the batch stays full under load
instead of thinning out as its sentences finish. Jobs with other options wait until the
running batch drains (the oldest job always decides what runs next), and model calls
(``call``) run between steps. Cancelled jobs (timeouts, disconnected clients) leave the
queue at once and are never computed; a sentence already decoding leaves the running batch
at its next step, so abandoned work does not hold up the requests still waiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import itertools
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from app.observability.metrics import Metrics
from model.engine.decoding import Finished, Hypothesis
from model.engine.options import DecodingOptions

log = logging.getLogger(__name__)

T = TypeVar("T")


class Session(Protocol):
    """A running batch (``model.engine.translator.IdsSession``)."""

    @property
    def active(self) -> int: ...

    @property
    def source_width(self) -> int: ...

    def admit(self, batch: Sequence[Sequence[int]], tags: Sequence[int]) -> None: ...

    def step(self) -> list[Finished]: ...

    def cancel(self, tags: Collection[int]) -> int: ...


# Opens an empty running batch for one set of decoding options (``Translator.open_session``).
OpenSession = Callable[[DecodingOptions], Session]


_PR_SET_NAME = 15  # prctl(2): name the calling thread (``name_os_thread``)


class QueueFull(Exception):
    """The queue has no room for the request's sentences now; retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooLarge(Exception):
    """More sentences than the queue can ever hold: retrying cannot help."""


class SchedulerClosed(Exception):
    """The scheduler is shutting down and takes no new work."""


@dataclass(eq=False)
class Job:
    """One sentence to decode, answered with its n-best hypotheses."""

    ids: list[int]
    options: DecodingOptions
    future: asyncio.Future[list[Hypothesis]]
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.perf_counter)
    tag: int | None = None  # its name in the running batch, once admitted
    # perf_counter() when the model thread took it, when its batch's joiners were encoded, when
    # its last step was done and when its event loop had the answer (app/observability/timing.py's phases)
    started: float = 0.0
    encoded: float = 0.0
    finished: float = 0.0
    delivered: float = 0.0


@dataclass(eq=False)
class ModelCall:
    """A callable to run on the model thread between steps (``BatchScheduler.call``), answered
    with what it returns. It queues with the sentences: the oldest work decides what runs next."""

    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.perf_counter)
    started: float = 0.0


Work = Job | ModelCall


# What a model does next (``BatchScheduler.take``): one of these four.
@dataclass(frozen=True)
class Admit:
    """These jobs join the running batch (a new batch when ``fresh``), then it steps."""

    jobs: list[Job]
    fresh: bool


@dataclass(frozen=True)
class Step:
    """The running batch steps; nobody joins it now."""


@dataclass(frozen=True)
class Call:
    """Run a model call now (the running batch, if any, waits a step)."""

    call: ModelCall


@dataclass(frozen=True)
class Idle:
    """The model ran out of work: drop the ended batch and run the idle hook."""


Decision = Admit | Step | Call | Idle


@dataclass(frozen=True)
class BatchLimits:
    max_sentences: int
    max_tokens: int
    max_wait_s: float
    queue_size: int
    # Under load, queued sentences join a running batch once it has room for ``join_group`` of them,
    # waiting at most ``max_join_wait_s`` for that (``BatchScheduler._joiners_wait``)
    join_group: int = 1
    max_join_wait_s: float = 0.0


class BatchScheduler:
    """Batches the sentences of one model; its sessions run on the model thread (``ModelThread``)."""

    def __init__(
        self,
        open_session: OpenSession,
        limits: BatchLimits,
        metrics: Metrics,
        direction: str,
        on_idle: Callable[[], object] | None = None,
        thread: ModelThread | None = None,
        idle_delay_s: float = 0.0,
    ) -> None:
        """``on_idle`` runs on the model thread each time this model runs out of work (the
        running batch ended and nothing waits) and stays out of it for ``idle_delay_s``: the
        service hands freed memory back to the OS there. ``thread``: the model thread shared
        with other schedulers (``ModelThread``); without one the scheduler has a thread of its own."""
        self.open_session, self.limits, self.metrics, self.direction = open_session, limits, metrics, direction
        self.on_idle, self.idle_delay_s = on_idle, idle_delay_s
        self._worked = 0.0  # perf_counter() when this model last took a decision with work in it
        self._owns_thread = thread is None
        self.thread = ModelThread(f"batcher-{direction}") if thread is None else thread
        self._session: Session | None = None  # the running batch (model thread only)
        self._options: DecodingOptions | None = None  # the decoding options of the batch (being) started
        self._session_options: DecodingOptions | None = None  # the ones ``_session`` was opened with
        self._running: dict[int, Job] = {}  # its jobs by tag
        self._cancelled: set[int] = set()  # tags of running jobs whose requests are gone
        self._tags = itertools.count()
        self._pending: deque[Work] = deque()
        self._cond = self.thread.cond  # one lock for the thread and all its schedulers
        self._closing = False
        self._idle_due = False  # work was done since ``on_idle`` last ran
        self._busy = False  # a decision it took (``take``) is being carried out
        self._rate = Throughput()  # sentences answered per second, for Retry-After
        self._arrivals = Throughput()  # sentences queued per second: is company worth waiting for?

    def start(self, warm_up: Callable[[], None] | None = None) -> None:
        """Join the model thread (one of this scheduler's own when none was given) and run
        ``warm_up`` there first; this returns (or raises) when that is done."""
        if warm_up is not None:
            try:
                self.thread.run(warm_up)
            except BaseException:
                if self._owns_thread:
                    self.thread.close()
                raise
        self._idle_due = True  # the idle hook runs once first: loading and warm-up leave free heap behind
        self.thread.add(self)

    def close(self, timeout: float | None = None) -> None:
        """Finish the jobs already queued (waiting up to ``timeout`` in all), then take no
        more; a model thread of its own stops."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._cond:
            self.stop_accepting()
            self._cond.notify_all()
            self._cond.wait_for(self.drained, timeout)
        if self._owns_thread:
            self.thread.close(None if deadline is None else max(0.0, deadline - time.perf_counter()))

    @property
    def depth(self) -> int:
        return len(self._pending)

    def check_room(self, sentences: int) -> None:
        """Raise what ``submit`` would for this many sentences (TooLarge, QueueFull), before
        the request is tokenized: under overload a rejection costs no model-side work."""
        limit = self.limits.queue_size
        if sentences > limit:
            raise TooLarge(f"{sentences} sentences in one request; this server queues at most {limit}: split it")
        depth = len(self._pending)
        if depth + sentences > limit:
            raise QueueFull(f"{depth} sentences queued (limit {limit})", self.retry_after(depth + sentences))

    def retry_after(self, sentences: int) -> int:
        """Seconds until about ``sentences`` queued sentences are done at the measured rate (1-60)."""
        return max(1, min(60, math.ceil(sentences / max(self._rate.per_second(), 1.0))))

    # --- called on the event loop ---------------------------------------------------------
    def submit(self, sentences: Sequence[list[int]], options: DecodingOptions) -> list[Job]:
        """Queue all sentences of a request, or none of them (QueueFull)."""
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, options, loop.create_future(), loop) for ids in sentences]
        self._enqueue(jobs)
        return jobs

    def call(self, fn: Callable[[], Any]) -> ModelCall:
        """Run ``fn`` on the model thread between steps (every model waits meanwhile: keep it short)."""
        loop = asyncio.get_running_loop()
        call = ModelCall(fn, loop.create_future(), loop)
        self._enqueue([call])
        return call

    def cancel(self, jobs: Sequence[Work]) -> None:
        """Withdraw jobs (timeouts, disconnected clients): queued ones leave the queue now,
        decoding ones leave the running batch at its next step. Their futures may be
        cancelled already (``asyncio.gather`` cancels its children when it is cancelled)."""
        with self._cond:
            for job in jobs:
                if not job.future.done():
                    job.future.cancel()
                if isinstance(job, Job) and job.tag is not None:  # admitted: maybe still decoding (checked each step)
                    self._cancelled.add(job.tag)
            before = len(self._pending)
            self._pending = deque(j for j in self._pending if not j.future.done())
            if len(self._pending) != before:
                self.metrics.queue_depth.dec(before - len(self._pending))
                self.metrics.cancelled.labels("queued").inc(before - len(self._pending))

    def _enqueue(self, jobs: Sequence[Work]) -> None:
        with self._cond:
            if self._closing:
                raise SchedulerClosed("shutting down")
            self.check_room(len(jobs))
            self._pending.extend(jobs)
            self._arrivals.add(sum(isinstance(job, Job) for job in jobs))
            self.metrics.queue_depth.inc(len(jobs))
            self._cond.notify_all()  # (the model thread; ``close`` callers share the condition)

    # --- the model thread's side (``ModelThread``), its lock held unless said ------------------
    @property
    def closing(self) -> bool:
        return self._closing

    def stop_accepting(self) -> None:
        """Take no new work (``SchedulerClosed``); what is queued still runs."""
        self._closing = True

    def drained(self) -> bool:
        """Closing, and nothing of this model is left to do."""
        return self._closing and not self._pending and not self._running and not self._busy

    def take(self, now: float) -> Decision | float | None:
        """What this model does next (``_decide``); a decision taken is this model's until the
        thread has carried it out (``carry_out``) and says so (``carried_out``), so ``close``
        waits for it."""
        decision = self._decide(now)
        if decision is not None and not isinstance(decision, float):
            self._busy = True
        return decision

    def carried_out(self) -> None:
        """The decision ``take`` gave is done (``drained`` may now hold)."""
        self._busy = False

    def _decide(self, now: float) -> Decision | float | None:
        """What this model does next, decided under the lock without waiting: a decision; or
        the ``perf_counter()`` time to look again (an idle model waiting for company up to
        ``max_wait``); or None (nothing to do). With a running batch: a model call that is oldest
        in the queue, else the queued jobs that fit join it, else it just steps. Idle with work
        queued: start a batch (or run the call) unless company is expected within ``max_wait``."""
        if self._running:
            oldest = self._pending[0] if self._pending else None
            if isinstance(oldest, ModelCall):
                return Call(self._pop_call())
            if oldest is None or oldest.options != self._options:
                return Step()  # (other options: let this batch drain first)
            if self._joiners_wait(oldest, now):
                return Step()
            jobs = self._take_compatible()
            return Admit(jobs, fresh=False) if jobs else Step()
        if not self._pending:
            if not self._idle_due:
                return None
            due = self._worked + self.idle_delay_s
            return Idle() if now >= due else due
        lim = self.limits
        deadline = self._pending[0].enqueued + lim.max_wait_s
        if self._company_expected() and len(self._pending) < lim.max_sentences and not self._closing and now < deadline:
            return deadline
        oldest = self._pending[0]
        if isinstance(oldest, ModelCall):
            return Call(self._pop_call())
        self._options = oldest.options
        return Admit(self._take_compatible(), fresh=True)

    def carry_out(self, decision: Decision) -> None:
        """Carry out a decision of ``take`` (on the model thread, the lock not held)."""
        if isinstance(decision, Idle):
            # out of work: drop the ended batch's session (its cache buffers are as large as
            # its largest step), then the idle hook
            self._session = None
            self._idle_due = False
            if self.on_idle is not None:
                self.on_idle()
            return
        self._idle_due = True
        try:
            self._work(decision)
        finally:
            self._worked = time.perf_counter()  # (the idle delay counts from when the work ended)

    def _work(self, decision: Call | Admit | Step) -> None:
        if isinstance(decision, Call):
            self._call(decision.call)
            return
        joining = decision.jobs if isinstance(decision, Admit) else []
        try:
            if isinstance(decision, Admit):
                self._admit(decision.jobs, decision.fresh)
            self._step()
        except Exception as err:  # the model failed: every request in the batch gets the error
            failed = {id(j): j for j in [*self._running.values(), *joining]}.values()
            log.exception("decoding %d sentences failed", len(failed))
            self._session, self._running = None, {}
            for job in failed:
                _fail(job, err)

    def _call(self, call: ModelCall) -> None:
        call.started = time.perf_counter()
        self.metrics.queue_wait.observe(call.started - call.enqueued)
        try:
            _deliver(call, call.fn())
        except Exception as err:
            log.exception("model call failed")
            _fail(call, err)

    def _joiners_wait(self, oldest: Job, now: float) -> bool:
        """Whether the queued jobs wait another step before joining the running batch, to join
        it in a larger group: while it has fewer than ``join_group`` free places (the model is
        saturated), for at most ``max_join_wait_s`` after the oldest was queued. Each admission
        runs the encoder once, and much of a pass's cost does not grow with its sentences, so a
        few joiners at every step cost far more a sentence than sorted batches
        (docs/benchmarks/log/2026-11-29.md#joiners-in-groups-session-of-2026-11-29-1952). With
        ``join_group`` places free nobody waits."""
        lim = self.limits
        group = min(lim.join_group, lim.max_sentences)
        if lim.max_sentences - len(self._running) >= group:
            return False
        return now - oldest.enqueued < lim.max_join_wait_s

    def _company_expected(self) -> bool:
        """Whether another sentence is likely to arrive within ``max_wait`` (at the arrival rate
        of the last seconds). Waiting lets joiners be encoded together, but with continuous
        batching later arrivals join the running batch anyway, so an idle model waits only
        when the wait is likely to fill it: never for a lone client (docs/benchmarks/README.md#event-loop)."""
        return self._arrivals.per_second() * self.limits.max_wait_s >= 1

    def _pop_call(self) -> ModelCall:
        call = self._pending.popleft()
        assert isinstance(call, ModelCall)
        self.metrics.queue_depth.dec()
        return call

    def _take_compatible(self) -> list[Job]:
        """Jobs sharing the running batch's options, oldest first, then shortest first, as many
        as the batch limits leave room for (none if the oldest does not fit). Holds the lock."""
        lim = self.limits
        active = len(self._running)
        longest = self._session.source_width if self._session is not None and active else 0
        same = [j for j in self._pending if isinstance(j, Job) and j.options == self._options]
        first, rest = same[0], sorted(same[1 : lim.max_sentences * 4], key=lambda j: len(j.ids))
        chosen: list[Job] = []
        for job in [first, *rest]:
            width = max(longest, len(job.ids) + 1)
            full = active + len(chosen) >= lim.max_sentences or width * (active + len(chosen) + 1) > lim.max_tokens
            if full and (chosen or active):  # (an idle batch always takes the oldest job, however long)
                break
            chosen.append(job)
            longest = width
        taken = set(map(id, chosen))
        self._pending = deque(j for j in self._pending if id(j) not in taken)
        self.metrics.queue_depth.dec(len(chosen))
        return chosen

    def _start(self, jobs: Sequence[Job]) -> None:
        now = time.perf_counter()
        for job in jobs:
            job.started = now
            self.metrics.queue_wait.observe(now - job.enqueued)

    def _admit(self, jobs: list[Job], fresh: bool) -> None:
        """Jobs join the running batch (a new one when ``fresh``: the options may have changed)."""
        self._start(jobs)
        if fresh or self._session is None:
            assert self._options is not None
            # the last batch's session, emptied, when it decodes with these options (a client's
            # back-to-back requests): setting up a new one takes many small tensor operations
            if not (self._session is not None and self._session.active == 0 and self._session_options == self._options):
                self._session, self._session_options = self.open_session(self._options), self._options
        with self._cond:  # a job cancelled before it has a tag is dropped here, after it is in _cancelled
            jobs = [job for job in jobs if not job.future.done()]
            for job in jobs:
                job.tag = next(self._tags)
        if not jobs:
            return
        tags = [job.tag for job in jobs if job.tag is not None]
        self._running.update(zip(tags, jobs, strict=True))
        self._session.admit([job.ids for job in jobs], tags)
        encoded = time.perf_counter()
        for job in jobs:
            job.encoded = encoded
        m = self.metrics
        m.series(m.source_tokens, self.direction).inc(sum(len(job.ids) + 1 for job in jobs))

    def _step(self) -> None:
        """One decoder step of the running batch; each sentence done goes to its request at
        once, so short sentences do not wait for the long ones."""
        session = self._session
        if session is None or not self._running:
            return
        with self._cond:
            cancelled, self._cancelled = self._cancelled, set()
        if cancelled:
            self.metrics.cancelled.labels("running").inc(session.cancel(cancelled))
        m, d = self.metrics, self.direction
        m.batch_sentences.observe(session.active)
        m.batch_tokens.observe(session.active * session.source_width)
        start = time.perf_counter()
        finished = session.step()
        now = time.perf_counter()
        m.series(m.decode_steps, d).inc()
        m.series(m.decode_step, d).observe(now - start)
        answers: list[tuple[Job, list[Hypothesis]]] = []
        tokens = 0
        for done in finished:
            job = self._running.pop(done.tag)
            job.finished = now
            if job.future.cancelled():
                continue
            best = done.hypotheses[0]
            tokens += len(best.ids) + int(best.finished)
            answers.append((job, done.hypotheses))
        if tokens:
            m.series(m.target_tokens, d).inc(tokens)
        self._rate.add(len(answers))
        _deliver_all(answers)


class ModelThread:
    """The one thread that runs all model work of a process: loading, warm-up, and every
    scheduler's steps, admissions and calls, taking turns (one decision of one model at a
    time, round robin over the models with work). torch's OpenMP pool is per calling thread,
    and once more pool threads exist than cores, libgomp throttles their spin-waiting, which
    slows a thread per model down well below one thread for all
    (docs/benchmarks/README.md#numbers-behind-the-code). Steps are milliseconds, so models take
    turns at that grain."""

    def __init__(self, name: str = "model") -> None:
        self.name = name
        self.cond = threading.Condition()
        self._schedulers: list[BatchScheduler] = []
        self._tasks: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._turn = 0  # where the round robin looks first
        self._closing = False
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the model thread (starting it if need be) before any other model
        work, and return what it returns or raise what it raises. Blocks: not for the event
        loop. On the model thread itself, ``fn`` just runs."""
        if threading.current_thread() is self._thread:
            return fn()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self.cond:
            if self._closing:
                raise SchedulerClosed("shutting down")
            self._tasks.append((fn, future))
            self.cond.notify_all()
            self._start()
        return future.result()

    def add(self, scheduler: BatchScheduler) -> None:
        """The thread serves this scheduler from now on (``SchedulerClosed`` once closing)."""
        with self.cond:
            if self._closing:
                raise SchedulerClosed("shutting down")
            self._start()
            self._schedulers.append(scheduler)
            self.cond.notify_all()

    def _start(self) -> None:
        """Start the thread if it is not running yet (lock held)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Every scheduler finishes what it has queued, then the thread stops (waits up to
        ``timeout`` in all)."""
        with self.cond:
            self._closing = True
            for scheduler in self._schedulers:
                scheduler.stop_accepting()
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        name_os_thread(self.name)  # before its first parallel work: its OpenMP workers take the name too
        while True:
            with self.cond:
                work = self._next()
            if work is None:
                return
            scheduler, run = work
            try:
                run()
            except Exception:  # (a decision's own errors go to its requests; this is a bug, not a model failure)
                log.exception("model thread: unexpected error, carrying on")
            if scheduler is not None:
                with self.cond:
                    scheduler.carried_out()
                    if scheduler.closing:
                        self.cond.notify_all()  # (``BatchScheduler.close`` may wait for it)

    def _next(self) -> tuple[BatchScheduler | None, Callable[[], None]] | None:
        """The next piece of work and whose it is (lock held): a task from ``run`` first, else
        the next model with something to do; waits while there is nothing; None once closed
        and drained."""
        while True:
            if self._tasks:
                fn, future = self._tasks.popleft()
                return None, functools.partial(_run_task, fn, future)
            now = time.perf_counter()
            wake = math.inf
            count = len(self._schedulers)
            for i in range(count):
                scheduler = self._schedulers[(self._turn + i) % count]
                decision = scheduler.take(now)
                if isinstance(decision, float):
                    wake = min(wake, decision)
                elif decision is not None:
                    self._turn = (self._turn + i + 1) % count
                    return scheduler, functools.partial(scheduler.carry_out, decision)
            if self._closing and all(s.drained() for s in self._schedulers):
                return None
            self.cond.wait(None if wake == math.inf else max(0.0, wake - now))


def _run_task(fn: Callable[[], Any], future: concurrent.futures.Future[Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as err:  # (handed to the caller of ``ModelThread.run``)
        future.set_exception(err)


class Throughput:
    """Events per second over the last ``window`` seconds, this one included (a ring of
    one-second counts)."""

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self.counts = [0] * window
        self.seconds = [-1] * window

    def add(self, n: int, now: float | None = None) -> None:
        second = int(time.monotonic() if now is None else now)
        slot = second % self.window
        if self.seconds[slot] != second:
            self.seconds[slot], self.counts[slot] = second, 0
        self.counts[slot] += n

    def per_second(self, now: float | None = None) -> float:
        second = int(time.monotonic() if now is None else now)
        recent = [c for c, s in zip(self.counts, self.seconds, strict=True) if 0 <= second - s < self.window]
        return sum(recent) / self.window if recent else 0.0


def _deliver(job: Work, result: Any) -> None:
    _answer(job, _set_result, result)


def _deliver_all(answers: Sequence[tuple[Job, list[Hypothesis]]]) -> None:
    """Answer a step's sentences with one wake-up per event loop: each ``call_soon_threadsafe``
    writes to the loop's self-pipe, a visible share of the model thread's time under load
    (docs/benchmarks/README.md#numbers-behind-the-code)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, list[Hypothesis]]]] = {}
    for job, result in answers:
        by_loop.setdefault(job.loop, []).append((job, result))
    for loop, results in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_results, results)
        except RuntimeError:  # its event loop is closed: nobody is waiting any more
            log.debug("dropped %d answers to jobs whose event loop is closed", len(results))


def _set_results(results: list[tuple[Job, list[Hypothesis]]]) -> None:
    now = time.perf_counter()
    for job, result in results:
        job.delivered = now
        _set_result(job.future, result)


def _fail(job: Work, err: BaseException) -> None:
    _answer(job, _set_exception, err)


def _answer(job: Work, setter: Callable[[asyncio.Future[Any], Any], None], value: Any) -> None:
    try:
        job.loop.call_soon_threadsafe(setter, job.future, value)
    except RuntimeError:  # its event loop is closed: nobody is waiting any more
        log.debug("dropped the answer to a job whose event loop is closed")


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], err: BaseException) -> None:
    if not future.done():
        future.set_exception(err)


def name_os_thread(name: str) -> None:
    """Name the calling thread in the OS too (``/proc/<pid>/task/<tid>/comm``, at most 15 bytes),
    as ``top -H``, perf, gdb and ``bench.threads`` see it; threads it starts later (libgomp's
    OpenMP workers, which torch starts on the thread's first parallel work) take the name with
    them. Linux only; elsewhere nothing happens, and a refusal is logged at debug level."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0) != 0:
            log.debug("could not name the OS thread %r: %s", name, os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as err:
        log.debug("could not name the OS thread %r: %s", name, err)
