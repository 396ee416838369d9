"""The batch scheduler on its own, driving real decoding sessions of a tiny random model:
the model thread owns the model from warm-up on, sentences join a running batch between
decoder steps and leave it the step they are done."""

from __future__ import annotations

import _thread
import asyncio
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from app.observability.metrics import Metrics
from app.serving.scheduler import BatchLimits, BatchScheduler, Job, ModelThread, SchedulerClosed
from model.engine.batches import pad
from model.engine.decoding import Finished, Hypothesis, decode
from model.engine.options import DecodingOptions
from model.engine.translator import IdsSession
from model.network.transformer import Transformer
from tests.factories import make_model

pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("fused_kernels")]

LIMITS = BatchLimits(max_sentences=8, max_tokens=1000, max_wait_s=0.0, queue_size=100)
GREEDY = DecodingOptions(beam_size=1)
BEAM2 = DecodingOptions(beam_size=2)
MODEL = make_model(seed=2)


def never_opened(options: DecodingOptions) -> IdsSession:
    raise AssertionError("no batch was started")


def test_warm_up_runs_on_the_model_thread_before_start_returns() -> None:
    seen: list[str] = []

    def warm_up() -> None:
        seen.append(threading.current_thread().name)

    scheduler = BatchScheduler(never_opened, LIMITS, Metrics(), "xx-yy")
    scheduler.start(warm_up=warm_up)
    try:
        assert seen == ["batcher-xx-yy"]  # done, and not on this thread
    finally:
        scheduler.close(timeout=5)


def test_a_failing_warm_up_fails_start() -> None:
    def warm_up() -> None:
        raise RuntimeError("model is broken")

    scheduler = BatchScheduler(never_opened, LIMITS, Metrics(), "xx-yy")
    with pytest.raises(RuntimeError, match="model is broken"):
        scheduler.start(warm_up=warm_up)


class Recorded(IdsSession):
    """A real session that records its admissions (the step they came at) and can pause the
    model thread before a step, while ``pause_before(session)`` holds, until released."""

    def __init__(self, model: Transformer, options: DecodingOptions, log: list, pause_before: Callable) -> None:
        super().__init__(model, options)
        self.log, self.pause_before = log, pause_before
        self.paused, self.release = threading.Event(), threading.Event()

    def admit(self, batch: Sequence[Sequence[int]], tags: Sequence[int]) -> None:
        self.log.append((self.session.options.beam_size, self.session.steps, [tuple(ids) for ids in batch]))
        super().admit(batch, tags)

    def step(self) -> list[Finished]:
        if self.pause_before(self) and not self.release.is_set():
            self.paused.set()
            assert self.release.wait(10), "the test never released the model thread"
        return super().step()


class Harness:
    """A scheduler over Recorded sessions of MODEL; the first can pause (``pause_before``)."""

    def __init__(
        self,
        pause_before: Callable = lambda s: False,
        limits: BatchLimits = LIMITS,
        thread: ModelThread | None = None,
        direction: str = "xx-yy",
        idle_delay_s: float = 0.0,
    ) -> None:
        self.log: list = []
        self.idle: list[float] = []  # decoder steps run so far, each time the model ran out of work
        self.sessions: list[Recorded] = []
        self.metrics = Metrics()

        def open_session(options: DecodingOptions) -> Recorded:  # only the first batch pauses
            gate = pause_before if not self.sessions else lambda s: False
            self.sessions.append(Recorded(MODEL, options, self.log, gate))
            return self.sessions[-1]

        def on_idle() -> None:
            steps = self.metrics.registry.get_sample_value("translator_decode_steps_total", {"direction": direction})
            self.idle.append(steps or 0)

        self.scheduler = BatchScheduler(
            open_session, limits, self.metrics, direction, on_idle=on_idle, thread=thread, idle_delay_s=idle_delay_s
        )

    def __enter__(self) -> Harness:
        self.scheduler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.sessions:
            s.release.set()
        self.scheduler.close(timeout=10)

    async def paused(self) -> Recorded:
        """The session the model thread is paused in, once it is."""
        for _ in range(1000):
            for s in self.sessions:
                if s.paused.is_set():
                    return s
            await asyncio.sleep(0.01)
        raise AssertionError("the model thread never paused")

    def sample(self, name: str) -> float:
        value = self.metrics.registry.get_sample_value(name, {"direction": "xx-yy"} if "steps" in name else None)
        assert value is not None
        return value


def alone(ids: list[int], options: DecodingOptions) -> list[Hypothesis]:
    return decode(MODEL, pad([[*ids, 3]], 0), options).hypotheses[0]


def steps_alone(ids: list[int], options: DecodingOptions) -> int:
    return decode(MODEL, pad([[*ids, 3]], 0), options).steps


LONG = list(range(4, 40))  # 36 pieces
SHORT = [5, 6]
MID = [*SHORT, 7, 8, 9]


@pytest.mark.slow
def test_the_example_sentences_take_the_steps_the_tests_rely_on() -> None:
    assert steps_alone(LONG, GREEDY) > 2 * steps_alone(SHORT, GREEDY) + 5


async def result(job: Job) -> list[Hypothesis]:
    return await asyncio.wait_for(job.future, 10)


def same(got: list[Hypothesis], expected: list[Hypothesis]) -> bool:
    """The same hypotheses, scores equal up to float rounding (batched vs alone)."""
    return [(h.ids, h.finished) for h in got] == [(h.ids, h.finished) for h in expected] and all(
        g.score == pytest.approx(e.score, abs=1e-4) for g, e in zip(got, expected, strict=True)
    )


async def short_passes_long(long_to: Harness, short_to: Harness) -> None:
    """LONG goes to ``long_to``'s scheduler, which pauses in its batch; SHORT goes to
    ``short_to``'s meanwhile and is answered while LONG still decodes; both as alone."""
    long_job = long_to.scheduler.submit([LONG], GREEDY)[0]
    session = await long_to.paused()
    short_job = short_to.scheduler.submit([SHORT], GREEDY)[0]
    session.release.set()
    assert same(await result(short_job), alone(SHORT, GREEDY))
    assert not long_job.future.done()
    assert same(await result(long_job), alone(LONG, GREEDY))


def test_each_sentence_is_delivered_as_soon_as_it_is_done() -> None:
    """A short sentence's request is answered while its batch still decodes a long one."""

    async def scenario(h: Harness) -> None:
        long_job, short_job = h.scheduler.submit([LONG, SHORT], GREEDY)
        assert same(await result(short_job), alone(SHORT, GREEDY))
        session = await h.paused()
        assert not long_job.future.done()  # same batch, still decoding
        session.release.set()
        assert same(await result(long_job), alone(LONG, GREEDY))

    with Harness(pause_before=lambda s: s.active == 1 and s.session.steps > 0) as h:
        asyncio.run(scenario(h))
    assert h.log == [(1, 0, [tuple(LONG), tuple(SHORT)])]  # one batch of both


@pytest.mark.slow
def test_the_idle_hook_runs_when_the_work_runs_out_not_between_steps() -> None:
    """``on_idle`` (the service returns freed memory to the OS there) runs once the running
    batch has ended and nothing waits: not while sentences are decoding."""

    async def idle_count(h: Harness, n: int) -> None:
        for _ in range(500):
            if len(h.idle) >= n:
                return
            await asyncio.sleep(0.01)

    async def scenario(h: Harness) -> None:
        # the first run (after warm-up) comes only once the thread finds nothing queued: wait
        # for it, or a submit that beats the thread's first look makes it skip to the batch
        await idle_count(h, 1)
        jobs = h.scheduler.submit([LONG, SHORT], GREEDY)
        await asyncio.gather(*(result(j) for j in jobs))
        await idle_count(h, 2)

    with Harness() as h:
        asyncio.run(scenario(h))
    steps = steps_alone(LONG, GREEDY)
    assert h.idle == [0, steps], h.idle  # once at start (after warm-up), and after the batch's last step


@pytest.mark.slow
def test_an_idle_model_waits_for_company_only_when_it_is_expected() -> None:
    """With a long ``max_wait``: a lone sentence starts at once; once sentences arrive often
    enough for company within the wait, an idle model waits for it."""
    slow = BatchLimits(max_sentences=8, max_tokens=1000, max_wait_s=2.0, queue_size=100)

    async def lone(h: Harness) -> None:
        job = h.scheduler.submit([SHORT], GREEDY)[0]
        await result(job)
        assert job.started - job.enqueued < 1.0  # not the 2 s wait

    async def busy(h: Harness) -> None:
        await asyncio.gather(*(result(j) for j in h.scheduler.submit([SHORT] * 6, GREEDY)))  # 0.6/s over 10 s
        first = h.scheduler.submit([LONG], GREEDY)[0]
        await asyncio.sleep(0.2)
        second = h.scheduler.submit([SHORT], GREEDY)[0]
        await asyncio.gather(result(first), result(second))
        assert first.started == second.started  # taken together after waiting

    with Harness(limits=slow) as h:
        asyncio.run(lone(h))
    with Harness(limits=slow) as h:
        asyncio.run(busy(h))
    assert h.log[-1][2] == [tuple(LONG), tuple(SHORT)]  # one batch (the oldest first)


@pytest.mark.slow
def test_sentences_join_a_running_batch_between_steps() -> None:
    """A request that arrives while a batch decodes joins it at the next step, instead of
    waiting for it to finish, and gets the same translation as alone."""

    async def scenario(h: Harness) -> None:
        await short_passes_long(h, h)

    with Harness(pause_before=lambda s: s.session.steps == 3) as h:
        asyncio.run(scenario(h))
    assert len(h.sessions) == 1  # one running batch ...
    assert h.log == [(1, 0, [tuple(LONG)]), (1, 4, [tuple(SHORT)])]  # ... joined after its 4th step
    steps = h.sample("translator_decode_steps_total")
    assert steps == steps_alone(LONG, GREEDY)
    # sentences per step: the long one every step, the short one for its own steps
    assert h.sample("translator_batch_sentences_sum") == steps + steps_alone(SHORT, GREEDY)


@pytest.mark.slow
def test_under_load_joiners_wait_for_room_for_a_group() -> None:
    """With ``join_group`` 2: while the batch has fewer than two free places, queued
    sentences join it two at a time (one encoder pass), not one at each step a place frees up;
    with no time to wait (``max_join_wait_s`` 0) each joins as soon as there is room. Both
    decode as alone."""
    assert steps_alone(SHORT, GREEDY) < steps_alone(MID, GREEDY) < steps_alone(LONG, GREEDY)
    first = [LONG, LONG[1:], SHORT, MID]
    later = [[7, 8, 9], [9, 8, 7]]

    async def scenario(h: Harness) -> None:
        jobs = h.scheduler.submit(first, GREEDY)
        session = await h.paused()
        joiners = h.scheduler.submit(later, GREEDY)
        session.release.set()
        for job, ids in zip([*jobs, *joiners], [*first, *later], strict=True):
            assert same(await result(job), alone(ids, GREEDY))

    def run(max_join_wait_s: float) -> list:
        limits = BatchLimits(4, 1000, 0.0, 100, join_group=2, max_join_wait_s=max_join_wait_s)
        with Harness(pause_before=lambda s: s.session.steps == 1, limits=limits) as h:
            asyncio.run(scenario(h))
        return h.log

    short, mid = steps_alone(SHORT, GREEDY), steps_alone(MID, GREEDY)
    batch = [tuple(ids) for ids in [first[0], *sorted(first[1:], key=len)]]  # (a new batch: shortest first)
    assert run(10.0) == [(1, 0, batch), (1, mid, [(7, 8, 9), (9, 8, 7)])]  # together, once MID left too
    assert run(0.0) == [(1, 0, batch), (1, short, [(7, 8, 9)]), (1, mid, [(9, 8, 7)])]  # one place at a time


def test_below_saturation_nobody_waits_for_a_group() -> None:
    """With ``join_group`` places free, a sentence joins the running batch at the next step,
    however long ``max_join_wait_s`` is."""

    async def scenario(h: Harness) -> None:
        await short_passes_long(h, h)

    limits = BatchLimits(8, 1000, 0.0, 100, join_group=4, max_join_wait_s=10.0)
    with Harness(pause_before=lambda s: s.session.steps == 3, limits=limits) as h:
        asyncio.run(scenario(h))
    assert h.log == [(1, 0, [tuple(LONG)]), (1, 4, [tuple(SHORT)])]


def test_other_options_wait_for_the_running_batch_to_drain() -> None:
    """The oldest queued job decides what runs next: a job with other options is not starved
    by a stream of jobs that could join the running batch."""
    beam = DecodingOptions(beam_size=2)

    async def scenario(h: Harness) -> None:
        first = h.scheduler.submit([LONG], GREEDY)[0]
        session = await h.paused()
        other = h.scheduler.submit([SHORT], beam)[0]
        later = h.scheduler.submit([[7, 8, 9]], GREEDY)[0]
        session.release.set()
        assert same(await result(first), alone(LONG, GREEDY))
        assert same(await result(other), alone(SHORT, beam))
        assert same(await result(later), alone([7, 8, 9], GREEDY))

    with Harness(pause_before=lambda s: s.session.steps == 2) as h:
        asyncio.run(scenario(h))
    assert h.log == [(1, 0, [tuple(LONG)]), (2, 0, [tuple(SHORT)]), (1, 0, [(7, 8, 9)])]


def test_a_model_call_runs_between_steps_of_the_running_batch() -> None:
    """A model call (``call``, as /attention's maps) runs at the next step boundary, on the
    model thread, ahead of jobs queued after it; the running batch then carries on."""
    ran: list[tuple[str, int]] = []

    async def scenario(h: Harness) -> None:
        first = h.scheduler.submit([LONG], GREEDY)[0]
        session = await h.paused()

        def note() -> int:
            ran.append((threading.current_thread().name, session.session.steps))
            return 42

        call = h.scheduler.call(note)
        later = h.scheduler.submit([SHORT], GREEDY)[0]
        session.release.set()
        assert await asyncio.wait_for(call.future, 10) == 42
        assert same(await result(first), alone(LONG, GREEDY))
        assert same(await result(later), alone(SHORT, GREEDY))

    with Harness(pause_before=lambda s: s.session.steps == 2) as h:
        asyncio.run(scenario(h))
    assert ran == [("batcher-xx-yy", 3)]  # after the paused step, before the batch drained
    assert h.log == [(1, 0, [tuple(LONG)]), (1, 3, [tuple(SHORT)])]  # SHORT joined after the call


def test_the_batch_limits_bound_who_joins() -> None:
    """No more sentences decode together than max_sentences; the rest join as others leave."""
    rows = [[4 + i, 5 + i] for i in range(5)]

    async def scenario(h: Harness) -> None:
        first = h.scheduler.submit([LONG], GREEDY)[0]
        session = await h.paused()
        jobs = h.scheduler.submit(rows, GREEDY)
        session.release.set()
        for job, ids in zip(jobs, rows, strict=True):
            assert same(await result(job), alone(ids, GREEDY))
        assert same(await result(first), alone(LONG, GREEDY))

    limits = BatchLimits(max_sentences=3, max_tokens=1000, max_wait_s=0.0, queue_size=100)
    with Harness(pause_before=lambda s: s.session.steps == 1, limits=limits) as h:
        asyncio.run(scenario(h))
    assert [len(batch) for _, _, batch in h.log][:2] == [1, 2]
    assert sum(len(batch) for _, _, batch in h.log) == 6
    assert h.sample("translator_batch_sentences_count") > 0
    assert h.metrics.registry.get_sample_value("translator_batch_sentences_bucket", {"le": "2.0"}) is not None
    assert h.metrics.registry.get_sample_value("translator_batch_sentences_bucket", {"le": "4.0"}) == h.sample(
        "translator_batch_sentences_count"
    )  # never more than 3 at a step


def test_a_failing_step_fails_its_batch_and_the_next_batch_runs() -> None:
    broken = {"once": True}

    def pause_before(s: Recorded) -> bool:
        if s.session.steps == 2 and broken.pop("once", False):
            raise RuntimeError("device lost")
        return False

    async def scenario(h: Harness) -> None:
        jobs = h.scheduler.submit([LONG, SHORT], GREEDY)
        for job in jobs:
            with pytest.raises(RuntimeError, match="device lost"):
                await result(job)
        assert same(await result(h.scheduler.submit([SHORT], GREEDY)[0]), alone(SHORT, GREEDY))

    with Harness(pause_before=pause_before) as h:
        asyncio.run(scenario(h))
    assert len(h.sessions) == 2


def test_decode_steps_count_model_steps_not_sentences() -> None:
    async def scenario(h: Harness) -> None:
        for job in h.scheduler.submit([SHORT, [9, 10, 11]], GREEDY):
            await result(job)

    with Harness() as h:
        asyncio.run(scenario(h))
    expected = max(steps_alone(SHORT, GREEDY), steps_alone([9, 10, 11], GREEDY))
    assert h.sample("translator_decode_steps_total") == expected
    assert torch.is_grad_enabled()  # the model thread's inference mode did not leak


def test_cancelled_sentences_leave_the_running_batch_at_the_next_step() -> None:
    """A request that gives up (timeout, disconnect) while its sentence decodes: the sentence
    is cut at the next step, its answer dropped, and the batch goes on with the others."""

    async def scenario(h: Harness) -> None:
        gone, kept = h.scheduler.submit([LONG, MID], GREEDY)
        session = await h.paused()
        steps_before = session.session.steps
        h.scheduler.cancel([gone])
        session.release.set()
        assert same(await result(kept), alone(MID, GREEDY))
        for _ in range(500):
            if session.active == 0:
                break
            await asyncio.sleep(0.01)
        assert session.active == 0 and gone.future.cancelled()
        # the long sentence took one more step, not the ~50 it needs alone
        assert h.sample("translator_decode_steps_total") <= max(steps_before + 1, steps_alone(MID, GREEDY))

    with Harness(pause_before=lambda s: s.session.steps == 2) as h:
        asyncio.run(scenario(h))
    assert h.metrics.registry.get_sample_value("translator_cancelled_sentences_total", {"stage": "running"}) == 1
    assert h.metrics.registry.get_sample_value("translator_cancelled_sentences_total", {"stage": "queued"}) == 0


@pytest.mark.slow
def test_cancel_in_the_session_frees_rows_and_keeps_the_others_exact() -> None:
    src = pad([[*LONG, 3], [*SHORT, 3], [9, 10, 11, 3]], 0)
    beam = DecodingOptions(beam_size=3)
    session = IdsSession(MODEL, beam)
    session.admit([LONG, SHORT, [9, 10, 11]], [0, 1, 2])
    for _ in range(2):
        session.step()
    assert session.cancel({0, 42}) == 1  # an unknown tag is ignored
    done = {f.tag: f for f in session.step()}
    assert 0 in done and not done[0].hypotheses[0].finished and session.active <= 2
    rest = {**done}
    while session.active:
        rest.update({f.tag: f for f in session.step()})
    full = decode(MODEL, src, beam).hypotheses
    for tag in (1, 2):
        assert same(rest[tag].hypotheses, full[tag][:1])


def test_throughput_counts_the_last_seconds() -> None:
    from app.serving.scheduler import Throughput

    rate = Throughput(window=10)
    assert rate.per_second(now=100.5) == 0.0
    for second in range(91, 101):
        rate.add(30, now=second + 0.1)
    assert rate.per_second(now=100.2) == 30.0
    assert rate.per_second(now=105.2) == 15.0  # half the window has no answers
    assert rate.per_second(now=200.0) == 0.0


def test_requests_that_can_never_fit_are_too_large_and_the_rest_retry_after_the_drain_time() -> None:
    from app.serving.scheduler import QueueFull, TooLarge

    limits = BatchLimits(max_sentences=8, max_tokens=1000, max_wait_s=0.0, queue_size=4)
    scheduler = BatchScheduler(never_opened, limits, Metrics(), "xx-yy")  # not started: nothing leaves the queue

    async def scenario() -> None:
        with pytest.raises(TooLarge):
            scheduler.submit([SHORT] * 5, GREEDY)
        scheduler.submit([SHORT] * 3, GREEDY)
        with pytest.raises(QueueFull) as full:
            scheduler.submit([SHORT] * 2, GREEDY)
        assert full.value.retry_after == 5  # no measured throughput yet: 1 sentence/s assumed
        for _ in range(10):
            scheduler._rate.add(10)
        with pytest.raises(QueueFull) as full:
            scheduler.check_room(2)
        assert full.value.retry_after == 1

    asyncio.run(scenario())


@pytest.mark.slow
def test_models_on_one_model_thread_take_turns_step_by_step() -> None:
    """Two models' schedulers on one ``ModelThread`` (the service's: one OpenMP pool for all
    models): loading, warm-up and every step run on that thread; a short sentence of one model
    is answered while the other model's long batch still decodes (they alternate steps); closing
    the thread finishes what both had queued."""
    thread = ModelThread("model")
    seen: set[str] = set()

    def pause_a(s: Recorded) -> bool:
        seen.add(threading.current_thread().name)
        return s.session.steps == 1

    a_steps: list[int] = []  # model a's steps so far, at each step of model b

    def note_b(s: Recorded) -> bool:
        seen.add(threading.current_thread().name)
        a_steps.append(a.sessions[0].session.steps)
        return False

    assert thread.run(lambda: threading.current_thread().name) == "model"
    a = Harness(pause_before=pause_a, thread=thread, direction="aa-bb")
    b = Harness(pause_before=note_b, thread=thread, direction="cc-dd")

    async def scenario() -> tuple[list[Job], list[Job]]:
        await short_passes_long(a, b)
        last = a.scheduler.submit([SHORT], GREEDY), b.scheduler.submit([LONG, SHORT], GREEDY)
        await asyncio.to_thread(thread.close, 10)  # drains both before it stops
        return last

    a.scheduler.start(warm_up=lambda: seen.add(threading.current_thread().name))
    b.scheduler.start()
    try:
        last_a, last_b = asyncio.run(scenario())
    finally:
        thread.close(timeout=10)
    assert [
        same(j.future.result(), alone(ids, GREEDY))
        for j, ids in zip([*last_a, *last_b], [SHORT, LONG, SHORT], strict=True)
    ] == [True] * 3
    assert seen == {"model"}
    short_steps = steps_alone(SHORT, GREEDY)
    # b's first step came right after the step a was paused in, then they alternated
    assert a_steps[:short_steps] == list(range(2, short_steps + 2))
    with pytest.raises(SchedulerClosed):
        thread.run(lambda: None)


def test_a_task_on_the_model_thread_hands_back_its_error() -> None:
    thread = ModelThread("model")

    def broken() -> None:
        raise ValueError("no such checkpoint")

    try:
        with pytest.raises(ValueError, match="no such checkpoint"):
            thread.run(broken)
        assert thread.run(lambda: 7) == 7  # the thread carries on
    finally:
        thread.close(timeout=5)


def test_the_idle_hook_waits_for_a_pause_in_the_traffic() -> None:
    """With ``idle_delay_s`` the hook runs once the model has had no work for that long: not
    between one client's back-to-back requests (each would fault the trimmed heap back in), and
    still soon after the traffic stops."""

    async def scenario(h: Harness) -> None:
        for _ in range(500):  # the first run after warm-up (no work before it: not delayed)
            if h.idle:
                break
            await asyncio.sleep(0.01)
        for _ in range(5):
            assert same(await result(h.scheduler.submit([SHORT], GREEDY)[0]), alone(SHORT, GREEDY))
        assert h.idle == [0]  # back to back: no hook in between
        await asyncio.sleep(0.5)
        assert h.idle == [0]
        for _ in range(1000):
            if len(h.idle) == 2:
                break
            await asyncio.sleep(0.01)
        assert h.idle == [0, 5 * steps_alone(SHORT, GREEDY)]  # once the pause is long enough

    with Harness(idle_delay_s=2.0) as h:
        asyncio.run(scenario(h))


def test_back_to_back_requests_reuse_the_emptied_session_of_the_same_options() -> None:
    """A client's next request, before the model goes idle, joins the session its last batch
    emptied (no new one to set up) when the options are the same; other options open another."""

    async def scenario(h: Harness) -> None:
        for _ in range(3):
            assert same(await result(h.scheduler.submit([SHORT], GREEDY)[0]), alone(SHORT, GREEDY))
        assert len(h.sessions) == 1
        assert same(await result(h.scheduler.submit([LONG], BEAM2)[0]), alone(LONG, BEAM2))
        assert same(await result(h.scheduler.submit([SHORT], BEAM2)[0]), alone(SHORT, BEAM2))
        assert len(h.sessions) == 2

    with Harness(idle_delay_s=10.0) as h:
        asyncio.run(scenario(h))


def test_an_unexpected_error_on_the_model_thread_does_not_stop_the_other_models() -> None:
    """An idle hook that raises (a bug, not a model failure) is logged; the thread, and every
    model on it, carries on."""
    thread = ModelThread("model")

    def broken_hook() -> None:
        raise RuntimeError("bug in the idle hook")

    a = BatchScheduler(Harness().scheduler.open_session, LIMITS, Metrics(), "aa-bb", on_idle=broken_hook, thread=thread)
    b = Harness(thread=thread, direction="cc-dd")

    async def scenario() -> None:
        assert same(await result(a.submit([SHORT], GREEDY)[0]), alone(SHORT, GREEDY))  # then the hook raises
        assert same(await result(b.scheduler.submit([LONG], GREEDY)[0]), alone(LONG, GREEDY))
        assert same(await result(a.submit([LONG], GREEDY)[0]), alone(LONG, GREEDY))

    a.start()
    b.scheduler.start()
    try:
        asyncio.run(scenario())
        assert thread.run(lambda: thread.run(lambda: 5)) == 5  # (on the model thread itself, run just runs)
    finally:
        thread.close(timeout=10)
    with pytest.raises(SchedulerClosed):
        thread.add(BatchScheduler(never_opened, LIMITS, Metrics(), "ee-ff", thread=thread))


def test_closing_one_model_returns_when_its_own_work_is_done() -> None:
    """``BatchScheduler.close`` on a shared thread waits for its model's queue, not for the
    other models' batches."""
    thread = ModelThread("model")
    one_at_a_time = BatchLimits(max_sentences=1, max_tokens=1000, max_wait_s=0.0, queue_size=100)
    a = Harness(thread=thread, direction="aa-bb")
    b = Harness(thread=thread, direction="cc-dd", limits=one_at_a_time)

    async def scenario() -> None:
        b_jobs = b.scheduler.submit([LONG] * 4, GREEDY)  # ~4 x 63 steps, one sentence after another
        job = a.scheduler.submit([SHORT], GREEDY)[0]
        await asyncio.to_thread(a.scheduler.close, 10)
        assert same(await result(job), alone(SHORT, GREEDY))
        assert not b_jobs[-1].future.done()  # b has most of its work ahead of it
        for b_job in b_jobs:
            assert same(await result(b_job), alone(LONG, GREEDY))

    a.scheduler.start()
    b.scheduler.start()
    try:
        asyncio.run(scenario())
    finally:
        thread.close(timeout=10)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names are read from Linux's /proc")
def test_the_model_thread_and_the_threads_it_starts_carry_its_name_in_the_os() -> None:
    """``top -H``, perf and ``bench.threads`` tell the model thread by its OS name; an OpenMP
    worker it starts (here any thread it starts) inherits the name."""
    thread = ModelThread("model")

    def names() -> tuple[str, str]:
        started: list[int] = []
        ready, done = threading.Event(), threading.Event()

        def child_body() -> None:
            started.append(threading.get_native_id())
            ready.set()
            done.wait(10)

        # a bare OS thread, as libgomp starts its workers (``threading`` names its threads itself
        # from Python 3.14 on)
        _thread.start_new_thread(child_body, ())
        ready.wait(10)
        try:
            return comm(threading.get_native_id()), comm(started[0])
        finally:
            done.set()

    def comm(tid: int) -> str:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()

    try:
        own, child = thread.run(names)
    finally:
        thread.close(timeout=10)
    assert (own, child) == ("model", "model")
    assert comm(threading.get_native_id()) != "model"  # the calling thread keeps its own
