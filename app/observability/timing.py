"""Where a request's time goes: named phases, sent as a ``Server-Timing`` header and observed
in the ``translator_request_phase_seconds`` histogram.

The middleware opens a ``RequestTiming`` per HTTP request (a context variable, so the route,
the service and the tasks they start all see it); the code that runs a phase records it. For
``/translate`` the phases, in order:

| phase | from | to |
| --- | --- | --- |
| ``parse`` | request start | body read, API key checked, body validated |
| ``prepare`` | | texts split into sentences and tokenized |
| ``queue`` | sentence queued | the model thread takes it (includes waiting for company) |
| ``encode`` | | its batch's joiners encoded (their cross-attention K/V projected) |
| ``decode`` | | its last decoder step done |
| ``handoff`` | | the event loop has the answer |
| ``detokenize`` | | texts rebuilt from the hypotheses |
| ``respond`` | route returned | response serialized, headers sent |

``/attention`` has the same phases and ``maps`` (the teacher-forced pass over the returned
translation that yields the attention weights) instead of ``detokenize``.

The sentence phases (``queue`` to ``handoff``) are those of the request's sentence that
finished last: that one decides when the request could answer, so the phases add up to about
the total. Other sentences decode in the same steps, in parallel.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

PHASES = ("parse", "prepare", "queue", "encode", "decode", "handoff", "maps", "align", "detokenize", "respond")


@dataclass
class RequestTiming:
    """Phase durations (seconds) of one request, filled in as it runs, and when each ran
    (perf_counter() intervals: the trace's spans, app/observability/tracing.py)."""

    start: float = field(default_factory=time.perf_counter)
    phases: dict[str, float] = field(default_factory=dict)
    intervals: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    returned: float | None = None  # when the route returned its result (serialization follows)

    def record(self, phase: str, seconds: float, end: float | None = None) -> None:
        """``phase`` ran for ``seconds`` until ``end`` (default: now)."""
        seconds = max(seconds, 0.0)
        stop = time.perf_counter() if end is None else end
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        self.intervals.setdefault(phase, []).append((stop - seconds, stop))

    def record_interval(self, phase: str, start: float, end: float) -> None:
        self.record(phase, end - start, end)

    def header(self, now: float) -> str:
        """The ``Server-Timing`` value: each phase and the total, in milliseconds."""
        parts = [f"{name};dur={1000 * self.phases[name]:.2f}" for name in PHASES if name in self.phases]
        parts.append(f"total;dur={1000 * (now - self.start):.2f}")
        return ", ".join(parts)


_current: ContextVar[RequestTiming | None] = ContextVar("request_timing", default=None)


def begin() -> tuple[RequestTiming, object]:
    """Open the timing of a request (the middleware); returns it and the token to ``end`` it."""
    timing = RequestTiming()
    return timing, _current.set(timing)


def end(token: object) -> None:
    _current.reset(token)  # type: ignore[arg-type]


def current() -> RequestTiming | None:
    return _current.get()


def record(phase: str, seconds: float) -> None:
    """Add ``seconds``, ending now, to ``phase`` of the current request (nothing outside a request)."""
    timing = _current.get()
    if timing is not None:
        timing.record(phase, seconds)


def record_interval(phase: str, start: float, end: float) -> None:
    """``phase`` of the current request ran from ``start`` to ``end`` (perf_counter() times)."""
    timing = _current.get()
    if timing is not None:
        timing.record_interval(phase, start, end)


def parsed() -> None:
    """The body is read and validated: ``parse`` ran from the request's start until now."""
    timing = _current.get()
    if timing is not None:
        timing.record("parse", time.perf_counter() - timing.start)


def returned() -> None:
    """The route has its result; what follows until the headers go out is ``respond``."""
    timing = _current.get()
    if timing is not None:
        timing.returned = time.perf_counter()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time a block as ``name``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        record_interval(name, start, time.perf_counter())
