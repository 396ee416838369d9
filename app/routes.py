"""HTTP endpoints. Parsing and validation live here; the work is in ``TranslationService``."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, make_asgi_app
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from app import attention_view, timing
from app.batching import QueueFull, SchedulerClosed, TooLarge
from app.errors import ApiError, describe_validation
from app.ratelimit import RateLimited, client_id
from app.schemas import (
    AttentionRequest,
    AttentionResponse,
    DetectionResult,
    DetectRequest,
    ErrorResponse,
    FrontendSettings,
    Language,
    SuggestRequest,
    SuggestResponse,
    TranslateRequest,
    TranslateResponse,
)
from app.service import ItemResult, TranslationService
from app.settings import Settings
from app.state import AppState
from model.decoding import DecodingOptions

STATIC = Path(__file__).parent / "static"
LANGUAGE_NAMES = {"de": "German", "en": "English", "fr": "French", "cs": "Czech"}
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 403, 413, 422, 429, 503, 504)
}
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

router = APIRouter()


def state_of(request: Request) -> AppState:
    state: AppState = request.app.state.translator
    return state


# JSON nested deeper than this is refused before validation walks it (no request needs more
# than 3 levels; Python's recursion limit was reached at ~950 and answered 500).
MAX_JSON_DEPTH = 32
# Form fields that are lists (a repeated key, or one value); q is a list only when repeated.
FORM_LISTS = frozenset({"layers", "heads", "kinds"})


async def read_body(request: Request) -> dict[str, Any]:
    """JSON or form-encoded (as LibreTranslate clients send), and the query string under it
    (LibreTranslate reads every parameter from any of them, also on POST) -> a dict of plain
    values, every string valid Unicode and nesting at most ``MAX_JSON_DEPTH`` deep (else 400)."""
    raw = await request.body()
    query = as_fields(parse_qs(request.url.query, keep_blank_values=True))
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    data: Any
    if query and not raw.strip():
        data = {}  # everything in the query string
    elif content_type == "application/x-www-form-urlencoded":
        try:
            form = parse_qs(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
        except UnicodeDecodeError:
            raise ApiError(400, "bad_request", "form body is not UTF-8") from None
        data = as_fields(form)
    elif content_type in ("application/json", "") or content_type.endswith("+json"):
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, "invalid_json", f"body is not valid JSON: {err}") from None
        except RecursionError:
            raise ApiError(400, "invalid_json", f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    else:
        raise ApiError(415, "unsupported_media_type", "send application/json or application/x-www-form-urlencoded")
    check_json(data)
    if not isinstance(data, dict):
        raise ApiError(422, "validation_error", "the body must be a JSON object")
    if query:
        check_json(query)
        data = {**query, **data}  # the body wins where both give a parameter
    return data


def as_fields(form: dict[str, list[str]]) -> dict[str, Any]:
    """Form or query values -> fields: lists where a field is a list (q only when repeated)."""
    return {k: (v if k in FORM_LISTS or (k == "q" and len(v) > 1) else v[-1]) for k, v in form.items()}


def check_json(data: Any) -> None:
    """400 for nesting deeper than ``MAX_JSON_DEPTH`` or a string that is not valid Unicode
    (a lone surrogate such as "\\ud800" is valid JSON, but cannot be encoded, tokenized or
    answered). Iterative, so no input can exhaust the stack."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, "invalid_json", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, str):
            check_unicode(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                check_unicode(key)
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def check_unicode(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ApiError(
                400, "invalid_unicode", f"a string holds {err.object[err.start]!r}, a lone surrogate: not Unicode text"
            ) from None


def validated(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ApiError(422, "validation_error", describe_validation(list(err.errors()))) from None


async def authorized_body(request: Request, model: type[M], state: AppState) -> M:
    """The API key first (a header key before the body is read, a body key before the body is
    validated, so nobody probes validation without a key), then the client's rate limits (429),
    then the validated body and its character limit."""
    settings = state.settings
    key = api_key_header(request)
    if key is not None:
        check_api_key(key, settings)
    data = await read_body(request)
    if key is None:
        given = data.get("api_key")
        key = given if isinstance(given, str) else None
        check_api_key(key, settings)
    client = client_id(key if key in settings.known_keys else None, request.client.host if request.client else None)
    try:
        await state.rate_limiter.hit(client)
    except RateLimited as err:
        raise ApiError(429, "rate_limited", str(err), {"Retry-After": str(err.retry_after)}) from None
    body = validated(model, data)
    check_characters(body, state.rate_limiter.limits_for(client).chars)
    timing.parsed()
    return body


def check_characters(body: BaseModel, limit: int) -> None:
    """422 when the request's texts together exceed the client's ``char_limit`` (0: none)."""
    q = getattr(body, "q", "")
    total = len(q) if isinstance(q, str) else sum(len(text) for text in q)
    if limit and total > limit:
        raise ApiError(422, "too_many_characters", f"q: {total} characters in this request; at most {limit}")


def api_key_header(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return request.headers.get("x-api-key") or (auth[7:] if auth.lower().startswith("bearer ") else None)


def check_api_key(given: str | None, settings: Settings) -> None:
    """403 unless the key (X-API-Key, Bearer token or api_key field) is configured, when keys
    are required (``api_keys`` set). Otherwise any key passes: a known one (with limits of its
    own) is counted as itself, an unknown one as the client's address."""
    if not settings.api_keys:
        return
    if not given or not any(hmac.compare_digest(given.encode(), k.encode()) for k in settings.known_keys):
        raise ApiError(403, "forbidden", "missing or invalid API key")


def check_texts(texts: list[str], settings: Settings) -> None:
    if not texts:
        raise ApiError(422, "validation_error", "q: give at least one text")
    if len(texts) > settings.max_items:
        raise ApiError(422, "too_many_items", f"q: {len(texts)} texts; at most {settings.max_items} per request")
    for i, text in enumerate(texts):
        if not text.strip():
            raise ApiError(422, "empty_text", f"q[{i}]: text is empty")
        if len(text) > settings.max_text_chars:
            raise ApiError(422, "text_too_long", f"q[{i}]: {len(text)} characters; at most {settings.max_text_chars}")


def decoding_options(
    service: TranslationService, settings: Settings, beam_size: int | None, n_best: int, max_length: int | None
) -> DecodingOptions:
    """The request's options on top of the model card's recommendations, within the limits."""
    rec = dict(service.meta.get("decoding", {}))
    if n_best - 1 > settings.max_alternatives:
        raise ApiError(422, "validation_error", f"alternatives: at most {settings.max_alternatives}")
    # n_best hypotheses come from one beam: a narrower beam is widened to alternatives + 1
    beam = max(beam_size if beam_size is not None else int(rec.get("beam_size", 4)), n_best)
    if beam > settings.max_beam:
        raise ApiError(422, "validation_error", f"beam_size: at most {settings.max_beam} (alternatives + 1 included)")
    cap = service.translator.config.max_positions - 1
    if max_length is not None and max_length > cap:
        raise ApiError(422, "validation_error", f"max_length: at most {cap}")
    rec.update(beam_size=beam, n_best=n_best, max_length=max_length)
    return DecodingOptions(**rec)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; if the client goes away first, cancel it (its sentences leave the queue or
    the running batch). Cancelled itself (the drain timeout), it answers 503."""
    task = asyncio.ensure_future(work)
    requests = state_of(request).requests
    current = asyncio.current_task()
    if current is not None:
        requests.add(current)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        # the drain timeout passed (AppState.cut_off, or uvicorn's graceful-shutdown timeout):
        # withdraw the work and answer 503, not uvicorn's 500.
        task.cancel()
        raise ApiError(
            503, "shutting_down", "the service stopped before this request finished", {"Retry-After": "1"}
        ) from None
    finally:
        watcher.cancel()
        if current is not None:
            requests.discard(current)
    if not task.done():
        task.cancel()
        raise ApiError(499, "client_closed_request", "the client disconnected")
    return task.result()


async def run_queued(request: Request, work: Awaitable[T]) -> T:
    with scheduler_errors():
        return await until_disconnect(request, work)


@contextmanager
def scheduler_errors() -> Iterator[None]:
    """The scheduler's refusals as HTTP errors: 429 (retry after the queue's measured drain
    time), 413 (never fits: not retryable), 503 (shutting down)."""
    try:
        yield
    except QueueFull as err:
        raise ApiError(
            429, "queue_full", f"too busy, retry shortly ({err})", {"Retry-After": str(err.retry_after)}
        ) from None
    except TooLarge as err:
        raise ApiError(413, "too_many_sentences", str(err)) from None
    except SchedulerClosed:
        raise ApiError(503, "shutting_down", "the service is shutting down", {"Retry-After": "1"}) from None


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI request body for routes that parse their body themselves (JSON or form)."""
    schema = {"schema": model.model_json_schema()}
    content = {"application/json": schema, "application/x-www-form-urlencoded": schema}
    return {"requestBody": {"required": True, "content": content}}


@router.post(
    "/translate",
    response_model=TranslateResponse,
    response_model_exclude_none=True,
    responses=ERRORS,
    openapi_extra=body_schema(TranslateRequest),
)
async def translate(request: Request) -> dict[str, Any]:
    """Translate a text or a list of texts (LibreTranslate-compatible). With ``source: "auto"``
    each text's language is detected (``detectedLanguage`` in the answer, one per text)."""
    state = state_of(request)
    body = await authorized_body(request, TranslateRequest, state)
    texts = [body.q] if isinstance(body.q, str) else body.q
    check_texts(texts, state.settings)
    detected = [state.detect_source(text) for text in texts] if body.source == "auto" else None
    sources = [d.language for d in detected] if detected is not None else [body.source] * len(texts)
    groups: dict[str, list[int]] = {}  # source language -> its texts' positions
    for i, source in enumerate(sources):
        groups.setdefault(source, []).append(i)
    routes = {source: state.route(source, body.target) for source in groups}  # 1 model, or 2 via English
    with scheduler_errors():  # shed load before tokenizing: every text has at least one sentence
        for source, positions in groups.items():
            for leg in routes[source]:
                leg.scheduler.check_room(len(positions))
    work = [
        translate_through(routes[source], [texts[i] for i in positions], body, state.settings)
        for source, positions in groups.items()
    ]
    done = await run_queued(request, asyncio.gather(*work))
    items: list[ItemResult] = [None] * len(texts)  # type: ignore[list-item]
    for positions, results in zip(groups.values(), done, strict=True):
        for i, item in zip(positions, results, strict=True):
            items[i] = item
    single = isinstance(body.q, str)
    out: dict[str, Any] = {"translatedText": items[0].texts[0] if single else [i.texts[0] for i in items]}
    if body.alternatives:
        alts = [i.texts[1:] for i in items]
        out["alternatives"] = alts[0] if single else alts
    if body.details:
        details = [item_details(routes[s], i) for s, i in zip(sources, items, strict=True)]
        out["details"] = details[0] if single else details
    if detected is not None:
        found = [{"language": d.language, "confidence": d.confidence} for d in detected]
        out["detectedLanguage"] = found[0] if single else found
    timing.returned()
    return out


@router.post(
    "/detect", response_model=list[DetectionResult], responses=ERRORS, openapi_extra=body_schema(DetectRequest)
)
async def detect(request: Request) -> list[dict[str, Any]]:
    """The language of a text among those this server translates from, most likely first, with
    confidences 0-100 (LibreTranslate's /detect)."""
    state = state_of(request)
    body = await authorized_body(request, DetectRequest, state)
    check_texts([body.q], state.settings)
    timing.returned()
    return [{"language": d.language, "confidence": d.confidence} for d in state.detect_candidates(body.q)]


@router.post("/suggest", response_model=SuggestResponse, responses=ERRORS, openapi_extra=body_schema(SuggestRequest))
async def suggest(request: Request) -> dict[str, Any]:
    """Keep a user's better translation for fine-tuning (LibreTranslate's /suggest); 403 unless
    the server enables suggestions (``TRANSLATOR_SUGGESTIONS``)."""
    state = state_of(request)
    if state.suggestions is None:
        raise ApiError(403, "suggestions_disabled", "suggestions are disabled on this server")
    body = await authorized_body(request, SuggestRequest, state)
    check_texts([body.q, body.s], state.settings)
    state.service(body.source, body.target)  # a direction this server translates (422 otherwise)
    await asyncio.to_thread(state.suggestions.add, body.source, body.target, body.q, body.s)
    return {"success": True}


@router.get("/frontend/settings", response_model=FrontendSettings)
async def frontend_settings(request: Request) -> dict[str, Any]:
    """What LibreTranslate clients read before translating: limits, key requirements, files."""
    state = state_of(request)
    s = state.settings
    targets = sorted({t for _, t in state.services}) or ["en"]
    return {
        "apiKeys": bool(s.known_keys),
        "keyRequired": bool(s.api_keys),
        "charLimit": s.char_limit or s.max_text_chars,
        "frontendTimeout": 500,
        "suggestions": s.suggestions,
        "filesTranslation": False,
        "supportedFilesFormat": [],
        "language": {
            "source": {"code": "auto", "name": "Auto Detect"},
            "target": {"code": targets[0], "name": LANGUAGE_NAMES.get(targets[0], targets[0])},
        },
    }


async def translate_through(
    legs: list[TranslationService], texts: list[str], body: TranslateRequest, settings: Settings
) -> list[ItemResult]:
    """Translate with one model, or through two (the pivot): the first leg's best translation is
    the second leg's source; the alternatives come from the last leg. One timeout for both."""
    deadline = time.monotonic() + settings.request_timeout_s
    items: list[ItemResult] = []
    for number, leg in enumerate(legs):
        last = number == len(legs) - 1
        n_best = body.alternatives + 1 if last else 1
        options = decoding_options(leg, settings, body.beam_size, n_best, body.max_length if last else None)
        items = await leg.translate(texts, options, max(deadline - time.monotonic(), 0.001))
        texts = [item.texts[0] for item in items]
    return items


def item_details(legs: list[TranslationService], item: ItemResult) -> dict[str, Any]:
    """Details of the last leg's translation; ``models`` names every model that ran."""
    service = legs[-1]
    pieces = service.translator.tokenizer.pieces
    sentences: list[dict[str, Any]] = []
    for s in item.sentences:
        best = s.hypotheses[0]
        sentences.append(
            {
                "source": s.source,
                "translation": service.translator.tokenizer.decode([best.ids])[0],
                "source_tokens": pieces(s.source_ids),
                "target_tokens": pieces(best.ids),
                "score": round(best.score, 4),
                "truncated": not best.finished,
                "cached": s.cached,
            }
        )
    return {
        "tokens": [t for s in sentences for t in s["target_tokens"]],
        "score": round(sum(s["score"] for s in sentences) / len(sentences), 4),
        "source_token_count": sum(len(s["source_tokens"]) for s in sentences),
        "target_token_count": sum(len(s["target_tokens"]) for s in sentences),
        "truncated": any(s["truncated"] for s in sentences),
        "sentences": sentences,
        "timings": {"queue_ms": round(item.queue_ms, 2), "total_ms": round(item.total_ms, 2)},
        "models": [leg.direction for leg in legs],
    }


@router.post(
    "/attention", response_model=AttentionResponse, responses=ERRORS, openapi_extra=body_schema(AttentionRequest)
)
async def attention(request: Request) -> dict[str, Any]:
    """Translate one text and return per-layer, per-head attention maps of the translation."""
    state = state_of(request)
    body = await authorized_body(request, AttentionRequest, state)
    service = state.service(body.source, body.target)
    check_texts([body.q], state.settings)
    cfg = service.translator.config
    sel = attention_view.select(
        body.layers, body.heads, body.kinds, body.level, min(cfg.encoder_layers, cfg.decoder_layers), cfg.n_heads
    )
    options = decoding_options(service, state.settings, body.beam_size, 1, None)
    text, result = await run_queued(request, service.attention(body.q, options, state.settings.request_timeout_s))
    payload = attention_view.build(result, sel, state.settings.attention_max_cells)
    timing.returned()
    return {
        "translatedText": text,
        "source": service.source,
        "target": service.target,
        "level": body.level,
        "n_layers": cfg.decoder_layers,
        "n_encoder_layers": cfg.encoder_layers,
        "n_decoder_layers": cfg.decoder_layers,
        "n_heads": cfg.n_heads,
        **payload,
    }


@router.get("/languages", response_model=list[Language])
async def languages(request: Request) -> list[dict[str, Any]]:
    """Languages and the targets each can be translated to (LibreTranslate's shape)."""
    state = state_of(request)
    state.require_ready()
    targets: dict[str, list[str]] = {}
    for source, target in state.pairs():  # direct models and pairs through the pivot
        targets.setdefault(source, []).append(target)
        targets.setdefault(target, [])
    return [{"code": c, "name": LANGUAGE_NAMES.get(c, c), "targets": t} for c, t in sorted(targets.items())]


@router.get("/info")
async def info(request: Request) -> dict[str, Any]:
    """Directions, model configs, parameter counts, device, dtype, limits, measured BLEU."""
    state = state_of(request)
    s = state.settings
    return {
        "version": request.app.version,
        "ready": state.ready.is_set(),
        "directions": [svc.info() for svc in state.services.values()],
        "limits": {
            "max_text_chars": s.max_text_chars,
            "max_items": s.max_items,
            "max_beam": s.max_beam,
            "max_alternatives": s.max_alternatives,
            "max_body_bytes": s.max_body_bytes,
            "request_timeout_s": s.request_timeout_s,
            "attention_max_tokens": s.attention_max_tokens,
        },
        "batching": {
            "max_batch_sentences": s.max_batch_sentences,
            "max_batch_tokens": s.max_batch_tokens,
            "max_wait_ms": s.max_wait_ms,
            "queue_size": s.queue_size,
        },
    }


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while the process can serve (or is still loading); 503 once loading the
    models failed, so an orchestrator restarts it."""
    if state_of(request).load_error:
        return JSONResponse({"status": "unhealthy", "error": "models failed to load (see the server log)"}, 503)
    return JSONResponse({"status": "ok"})


@router.get("/ready", responses={503: {"model": ErrorResponse}})
async def ready(request: Request) -> dict[str, Any]:
    """Readiness: 200 once every model is loaded and warmed up; 503 before and while draining."""
    state = state_of(request)
    state.require_ready()
    return {"status": "ready", "directions": [svc.direction for svc in state.services.values()]}


class PrometheusResponse(Response):
    """prometheus-client's own ASGI exposition app as the answer: the text format, or
    OpenMetrics when the scraper asks for it (Accept), gzip when it accepts it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.app = make_asgi_app(registry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


METRICS_TYPES: dict[str, Any] = {CONTENT_TYPE_LATEST.split(";")[0]: {}, OPENMETRICS_CONTENT_TYPE.split(";")[0]: {}}


@router.get("/metrics", response_class=Response, responses={200: {"content": METRICS_TYPES}})
async def metrics(request: Request) -> PrometheusResponse:
    """Prometheus text format (OpenMetrics on request; gzip when accepted)."""
    return PrometheusResponse(state_of(request).metrics.registry)


@router.get("/", include_in_schema=False)
async def index() -> Response:
    page = STATIC / "index.html"
    if not page.is_file():
        return JSONResponse({"error": "viewer page not installed", "error_type": "not_found"}, status_code=404)
    return FileResponse(page)
