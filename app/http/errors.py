"""Every error leaves the service as JSON ``{"error": ..., "error_type": ..., "request_id": ...}``
(the request id is also the ``X-Request-ID`` header and in the logs of that request).

The statuses are LibreTranslate's, on every route (``/attention`` included), since its clients
read them: ``BAD_REQUEST`` (400) for every bad request (a missing or invalid parameter, a
language pair no model serves, a text, character or item limit exceeded, an empty text,
malformed JSON), 403 for a missing or wrong API key, 429 for the queue and rate limits. The
``error_type`` says which bad request it was. The exceptions: a text whose *detected* language
(``source: "auto"``) no model takes is ``UNSUPPORTED_LANGUAGE`` (422, the request was well
formed); 413 for a body too large or more sentences than the queue holds, 415 for an
unsupported media type, 503 while not ready or shutting down, 504 for a timeout.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.observability.logs import request_id_var
from app.serving.errors import BAD_REQUEST, ApiError
from app.serving.scheduler import QueueFull, SchedulerClosed, TooLarge
from app.serving.service import SentenceTooLong, TextTooLong, Timeout, TranslationError
from app.storage.files import FileStoreError
from app.storage.ratelimit import RateLimited

log = logging.getLogger(__name__)


STATUS_TYPES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    429: "queue_full",
    503: "unavailable",
    504: "timeout",
}


def error_response(
    status: int, error_type: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    body = {"error": message, "error_type": error_type, "request_id": request_id_var.get(), **extra}
    return JSONResponse(body, status_code=status, headers=headers)


def describe_validation(errors: list[Any]) -> str:
    """Pydantic errors -> one readable line, e.g. "beam_size: Input should be less than or equal to 8"."""
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body",))
        parts.append(f"{loc}: {e.get('msg', 'invalid')}" if loc else str(e.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request"


# What the service, its scheduler and the rate limiter refuse, raised as their own errors
# (they know nothing of HTTP) and given a status here, in one place.
REFUSALS: tuple[type[Exception], ...] = (
    TranslationError,
    QueueFull,
    TooLarge,
    SchedulerClosed,
    RateLimited,
    FileStoreError,
)


def refusal(err: Exception) -> ApiError:
    """The HTTP answer to one of ``REFUSALS``: 429 (retry after the queue's measured drain
    time, or the client's rate limit), 413 (never fits: not retryable), 503 (shutting down, or
    the file store unreachable), 400 (a sentence or text too long for the model), 504 (the
    request timeout passed)."""
    match err:
        case QueueFull():
            retry = {"Retry-After": str(err.retry_after)}
            return ApiError(429, "queue_full", f"too busy, retry shortly ({err})", retry)
        case TooLarge():
            return ApiError(413, "too_many_sentences", str(err))
        case SchedulerClosed():
            return ApiError(503, "shutting_down", "the service is shutting down", {"Retry-After": "1"})
        case RateLimited():
            return ApiError(429, "rate_limited", str(err), {"Retry-After": str(err.retry_after)})
        case SentenceTooLong() | TextTooLong():
            return ApiError(BAD_REQUEST, "text_too_long", str(err))
        case Timeout():
            return ApiError(504, "timeout", str(err))
        case FileStoreError():
            return ApiError(503, "storage_unavailable", str(err), {"Retry-After": "5"})
    log.error("no HTTP status for %r", err)
    return ApiError(500, "internal_error", "internal server error")


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return error_response(err.status, err.error_type, err.message, err.headers)

    async def _refused(request: Request, err: Exception) -> JSONResponse:
        return await _api_error(request, refusal(err))

    for kind in REFUSALS:
        app.add_exception_handler(kind, _refused)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(BAD_REQUEST, "validation_error", describe_validation(list(err.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(
            err.status_code,
            STATUS_TYPES.get(err.status_code, "http_error"),
            str(err.detail),
            getattr(err, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "internal server error")
