"""Pure ASGI middleware: request ids and access logs, metrics and traces; CORS rejections in
the service's JSON error shape; the request body limit (see ``BodyLimitMiddleware``)."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.observability import timing, tracing
from app.observability.logs import request_id_var
from app.observability.metrics import Metrics

log = logging.getLogger("app.access")

ENDPOINTS = frozenset(
    ["/translate", "/attention", "/detect", "/suggest", "/languages", "/frontend/settings", "/info", "/health",
     "/ready", "/metrics", "/", "/viewer", "/docs", "/openapi.json", "/translate_file", "/spec"]
)  # fmt: skip
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def endpoint_label(path: str) -> str:
    """A bounded label value: known endpoints by name, static files together, all else "other"."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/download_file/"):
        return "/download_file"
    return "/static" if path.startswith("/static/") else "other"


class RequestContextMiddleware:
    """Assigns a request id (kept from X-Request-ID when sane), logs and measures each request."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _SAFE_ID.match(given) else uuid.uuid4().hex
        token = request_id_var.set(rid)
        endpoint = endpoint_label(scope["path"])
        status = 500
        start = time.perf_counter()
        request_timing, timing_token = timing.begin()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                extra = [(b"x-request-id", rid.encode())]
                now = time.perf_counter()
                if request_timing.returned is not None:
                    request_timing.record("respond", now - request_timing.returned)
                if request_timing.phases:
                    extra.append((b"server-timing", request_timing.header(now).encode()))
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        self.metrics.inflight.inc()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - start
            m = self.metrics
            m.inflight.dec()
            m.series(m.requests, endpoint, str(status)).inc()
            m.series(m.request_duration, endpoint).observe(elapsed)
            for name, seconds in request_timing.phases.items():
                m.series(m.request_phase, endpoint, name).observe(seconds)
            timing.end(timing_token)
            tracing.record_request(request_timing, time.perf_counter(), scope["method"], endpoint, status, rid)
            log.info(
                "%s %s %d %.1fms",
                scope["method"],
                scope["path"],
                status,
                elapsed * 1000,
                extra={"status": status, "duration_ms": round(elapsed * 1000, 2)},
            )
            request_id_var.reset(token)


class DirectRoutes:
    """Requests for a few busy routes, by exact method and path, go straight to their ASGI apps
    past the router; everything else goes on to the app. FastAPI's path to a route's handler
    (route matching, the request's exit stacks, the handler's dependency resolution) is event
    loop CPU that, on a small machine, the model's threads wait for
    (docs/benchmarks/README.md#event-loop).

    What a direct app raises is answered by the app's own exception handlers (``handlers``,
    as the router's routes are: Starlette's ExceptionMiddleware around each); anything no
    handler takes goes on up to the catch-all ``Exception`` handler, as from any route. Add it
    innermost (first), so the other middleware (request ids, metrics, body limit, CORS) see
    these requests as any other."""

    def __init__(self, app: ASGIApp, routes: Mapping[tuple[str, str], ASGIApp], handlers: Mapping[Any, Any]) -> None:
        self.app = app
        caught = {kind: handler for kind, handler in handlers.items() if kind not in (500, Exception)}
        self.routes = {key: ExceptionMiddleware(route, handlers=caught) for key, route in routes.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        direct = self.routes.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        await (self.app if direct is None else direct)(scope, receive, send)


class JsonCorsMiddleware(CORSMiddleware):
    """Starlette's CORS middleware, with a rejected preflight answered in the service's JSON
    error shape instead of plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        keep = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        message = bytes(response.body).decode()
        body = {"error": message, "error_type": "cors_rejected", "request_id": request_id_var.get()}
        return JSONResponse(body, response.status_code, keep)


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes`` (or the limit ``paths`` gives a path: an upload's):
    by Content-Length at once, or while streaming.

    Not FastAPI's ``max_body_size`` (Starlette's ``RequestBodyLimitMiddleware``): for a body
    whose Content-Length is over the limit, that one replaces whatever the app answers with a
    plain-text "Content Too Large", so clients would lose the service's JSON error shape
    (tried; tests/app/test_api.py::test_malformed_bodies failed on it)."""

    def __init__(self, app: ASGIApp, max_bytes: int, paths: Mapping[str, int] | None = None) -> None:
        self.app, self.max_bytes, self.paths = app, max_bytes, dict(paths or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.paths.get(scope["path"], self.max_bytes)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > max_bytes):
            await _reject(send, max_bytes)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    raise BodyTooLarge(max_bytes)
            return message

        await self.app(scope, limited_receive, send)


class BodyTooLarge(HTTPException):
    """Raised while reading a streamed body; the HTTP error handler turns it into a 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body larger than {max_bytes} bytes")


async def _reject(send: Send, max_bytes: int) -> None:
    body = json.dumps(
        {
            "error": f"request body larger than {max_bytes} bytes",
            "error_type": "payload_too_large",
            "request_id": request_id_var.get(),
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
