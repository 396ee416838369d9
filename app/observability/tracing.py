"""Optional OpenTelemetry tracing: one span per request, with a child span per phase.

Off unless OpenTelemetry is configured: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set at start-up exports over OTLP/HTTP (the ``tracing``
extra: ``pip install 'transformer-translator[tracing]'``), and the standard ``OTEL_*``
variables (service name, headers, sampler) apply. Unset, nothing is imported or recorded.

The phases are the ones ``app/observability/timing.py`` measures (the ``Server-Timing`` header): ``parse``,
``prepare``, ``queue``, ``encode``, ``decode``, ``handoff``, ``detokenize`` (or ``maps``) and
``respond``. Each knows when it started and ended, so the spans are written after the request
finished, with their real times, and a request pays nothing for tracing until then. The
sentence phases (``queue`` to ``handoff``) are those of the request's sentence that finished
last, as in the header.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from app.observability.timing import PHASES, RequestTiming

log = logging.getLogger(__name__)

_tracer: Any = None  # an opentelemetry Tracer once tracing is on


def configure(service_name: str = "translator") -> bool:
    """Turn tracing on when an OTLP endpoint is configured; True if it is on."""
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ModuleNotFoundError as err:
        log.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but %s is not installed: tracing is off "
            "(pip install 'transformer-translator[tracing]')",
            err.name,
        )
        return False
    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    install(provider)
    log.info("tracing on: OTLP/HTTP to %s", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "(traces endpoint)"))
    return True


def install(provider: Any) -> None:
    """Record spans with this ``TracerProvider`` (``configure``, or a test's in-memory one)."""
    global _tracer
    _tracer = provider.get_tracer("app.observability.tracing")


def record_request(timing: RequestTiming, end: float, method: str, route: str, status: int, request_id: str) -> None:
    """Write the spans of a finished request (``end``: its perf_counter() at the last byte)."""
    if _tracer is None:
        return
    from opentelemetry.trace import Status, StatusCode, set_span_in_context

    to_ns = _clock()
    root = _tracer.start_span(
        f"{method} {route}",
        start_time=to_ns(timing.start),
        attributes={
            "http.request.method": method,
            "http.route": route,
            "http.response.status_code": status,
            "translator.request_id": request_id,
        },
    )
    if status >= 500:
        root.set_status(Status(StatusCode.ERROR))
    context = set_span_in_context(root)
    for name in PHASES:
        for start, stop in timing.intervals.get(name, []):
            _tracer.start_span(name, context=context, start_time=to_ns(start)).end(end_time=to_ns(stop))
    root.end(end_time=to_ns(end))


def _clock() -> Any:
    """perf_counter() seconds -> epoch nanoseconds, through one reading of both clocks now."""
    offset = time.time_ns() - int(time.perf_counter() * 1e9)
    return lambda seconds: int(seconds * 1e9) + offset
