"""HTTP endpoints. Each route parses (what it needs it declares: ``app.http.deps``), calls its use
case (``app.serving.translate``, the direction's ``TranslationService``, ``AppState``) and shapes
the answer.

``include(app, models)`` adds them to an app, their bodies read into and published as ``models``
(``create_app`` builds them from the settings and the checkpoints: ``app.http.openapi.request_models``).

(No ``from __future__ import annotations``: FastAPI reads the routes' annotations at run time.)
"""

import asyncio
import functools
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, make_asgi_app
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from starlette.types import Receive, Scope, Send

from app.formats import documents
from app.http import attention_view, uploads
from app.http.deps import (
    AttentionBody,
    AttentionService,
    DetectBody,
    HeaderKey,
    StateDep,
    SuggestBody,
    get_state,
    keyed,
    translate_body,
)
from app.http.disconnect import until_disconnect
from app.http.openapi import RequestModels, request_body
from app.http.schemas import (
    AttentionResponse,
    Batching,
    DetectionResult,
    DirectionInfo,
    ErrorResponse,
    FrontendLanguages,
    FrontendSettings,
    HealthResponse,
    InfoResponse,
    ItemDetails,
    Language,
    LanguageRef,
    Limits,
    ReadyResponse,
    SuggestResponse,
    TranslateFileResponse,
    TranslateResponse,
)
from app.observability import timing
from app.serving import translate as use_case
from app.serving.errors import ApiError
from app.serving.translate import check_texts, limited_options
from model.engine.allocator import active_malloc
from model.engine.options import Repetition

STATIC = Path(__file__).parents[1] / "static"
LANGUAGE_NAMES = {"de": "German", "en": "English", "fr": "French", "cs": "Czech"}
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 403, 413, 429, 503, 504)}
# 422 only where source "auto" can take a text to be in a language no model serves (app.http.errors)
AUTO_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    422: {"model": ErrorResponse, "description": 'source "auto": the detected language has no model'},
}


def include(app: FastAPI, models: RequestModels) -> None:
    """Every route on ``app``, the bodies read into (and published as) ``models``."""
    app.state.request_models = models  # (``app.http.deps.request_models``)
    app.include_router(build_router(models))


def build_router(models: RequestModels) -> APIRouter:
    """Every route, the bodies of /translate, /attention, /detect, /suggest and /translate_file
    published as ``models`` (an app reads them into the models ``include`` gave it)."""
    router = APIRouter()
    post = functools.partial(router.add_api_route, methods=["POST"])
    translate_extra = keyed(request_body(models.translate))
    post(
        "/translate", translate, response_model=TranslateResponse, responses=AUTO_ERRORS, openapi_extra=translate_extra
    )
    route = router.routes[-1]
    assert isinstance(route, APIRoute)
    route.app = translate_app  # the one way /translate is served, as past the router (``create_app``)
    post("/detect", detect, responses=ERRORS, openapi_extra=keyed(request_body(models.detect)))
    # 403 before the body is read
    enabled = [Depends(suggestions_enabled)]
    post("/suggest", suggest, responses=ERRORS, openapi_extra=keyed(request_body(models.suggest)), dependencies=enabled)
    post("/attention", attention, responses=ERRORS, openapi_extra=keyed(request_body(models.attention)))
    file_errors: dict[int | str, dict[str, Any]] = {**AUTO_ERRORS, 415: {"model": ErrorResponse}}
    file_extra = keyed(uploads.upload_body(models.translate))
    post(
        "/translate_file",
        translate_file,
        response_model_exclude_none=True,
        responses=file_errors,
        openapi_extra=file_extra,
    )
    get = functools.partial(router.add_api_route, methods=["GET"])
    get("/download_file/{name}", download_file, response_class=Response, responses=uploads.DOWNLOAD_RESPONSES)
    get("/frontend/settings", frontend_settings)
    get("/languages", languages)
    get("/info", info)
    get("/health", health, response_model_exclude_none=True, responses={503: {"model": HealthResponse}})
    get("/ready", ready, responses={503: {"model": ErrorResponse}})
    get("/metrics", metrics, response_class=Response, responses={200: {"content": METRICS_TYPES}})
    get("/spec", spec, include_in_schema=False)
    get("/", index, include_in_schema=False)
    get("/viewer", viewer, include_in_schema=False)
    return router


async def translate(request: Request) -> Response:
    """Translate a text or a list of texts (LibreTranslate-compatible). With ``source: "auto"``
    each text's language is detected (``detectedLanguage`` in the answer, one per text)."""
    state = await get_state(request)
    payload = await translate_body(request, state)
    query = use_case.Query(
        texts=(payload.q,) if isinstance(payload.q, str) else tuple(payload.q),
        source=payload.source,
        target=payload.target,
        html=payload.format == "html",
        alternatives=payload.alternatives,
        beam_size=payload.beam_size,
        max_length=payload.max_length,
        details=payload.details,
        repetition=Repetition(payload.repetition_penalty, payload.no_repeat_ngram_size),
    )
    result = await use_case.translate(query, state, functools.partial(until_disconnect, request, state))
    answer = translate_response(isinstance(payload.q, str), result)
    timing.returned()
    return Response(answer.model_dump_json(exclude_none=True), media_type="application/json")


async def translate_app(scope: Scope, receive: Receive, send: Send) -> None:
    """POST /translate as a bare ASGI app, the one way it is served: ``create_app`` hands it the
    requests past FastAPI's router (``app.http.middleware.DirectRoutes``; why:
    docs/benchmarks/README.md#event-loop), and the router's /translate
    route, which the OpenAPI document describes, runs it too. The body is read by calling its
    dependency (``translate_body``) and the answer is its JSON bytes; the document states both."""
    response = await translate(Request(scope, receive, send))
    await response(scope, receive, send)


def translate_response(single: bool, result: use_case.Translation) -> TranslateResponse:
    """The /translate answer in the shape of ``q``: one value per field for one text, else lists."""

    def each(values: Any) -> Any:
        return values if values is None or not single else values[0]

    details = [ItemDetails.model_validate(d, from_attributes=True) for d in result.details] if result.details else None
    detected = [DetectionResult(language=d.language, confidence=d.confidence) for d in result.detected or ()]
    return TranslateResponse(
        translatedText=each(list(result.texts)),
        alternatives=each([list(a) for a in result.alternatives]) if result.alternatives is not None else None,
        details=each(details),
        detectedLanguage=each(detected) if result.detected is not None else None,
    )


async def detect(payload: DetectBody, state: StateDep) -> list[DetectionResult]:
    """The language of a text among those this server translates from, most likely first, with
    confidences 0-100 (LibreTranslate's /detect)."""
    check_texts([payload.q], state.settings)
    found = state.detect_candidates(payload.q)
    timing.returned()
    return [DetectionResult(language=d.language, confidence=d.confidence) for d in found]


async def translate_file(request: Request, state: StateDep, key: HeaderKey) -> TranslateFileResponse:
    """Translate a document (LibreTranslate's /translate_file): multipart/form-data with the
    ``file`` (any of ``app.formats.documents.FORMATS``), ``source`` (or "auto") and ``target``. The answer
    says where to download the translation (``GET /download_file/{name}``, for a while)."""
    upload = await uploads.read_upload(request, state.settings.max_file_bytes)
    client = await uploads.admit(request, state, key, upload)
    given = use_case.Upload(
        filename=upload.filename or "",
        data=upload.data,
        source=upload.field("source"),
        target=upload.field("target"),
        char_limit=state.rate_limiter.limits_for(client).chars,
    )
    done = await use_case.translate_document(given, state, functools.partial(until_disconnect, request, state))
    timing.returned()
    detected = done.detected
    return TranslateFileResponse(
        translatedFileUrl=str(request.url_for("download_file", name=done.name)),
        detectedLanguage=DetectionResult(language=detected.language, confidence=detected.confidence)
        if detected
        else None,
    )


async def download_file(name: str, state: StateDep) -> Response:
    """A translated document as an attachment (LibreTranslate's /download_file); 404 for a name
    that expired, was evicted or never existed."""
    stored = await state.files.get(name)
    if stored is None:
        raise ApiError(404, "not_found", "no such file: it expired, or was never made here")
    return uploads.download(stored)


async def suggestions_enabled(state: StateDep) -> None:
    if state.suggestions is None:
        raise ApiError(403, "suggestions_disabled", "suggestions are disabled on this server")


async def suggest(payload: SuggestBody, state: StateDep) -> SuggestResponse:
    """Keep a user's better translation for fine-tuning (LibreTranslate's /suggest); 403 unless
    the server enables suggestions (``TRANSLATOR_SUGGESTIONS``)."""
    check_texts([payload.q, payload.s], state.settings)
    state.service(payload.source, payload.target)  # a direction this server translates (400 otherwise)
    assert state.suggestions is not None  # (suggestions_enabled)
    await asyncio.to_thread(state.suggestions.add, payload.source, payload.target, payload.q, payload.s)
    return SuggestResponse(success=True)


async def attention(
    payload: AttentionBody, service: AttentionService, state: StateDep, request: Request
) -> AttentionResponse:
    """Translate one text and return per-layer, per-head attention maps of the translation."""
    check_texts([payload.q], state.settings)
    cfg, settings = service.translator.config, state.settings
    layers = min(cfg.encoder_layers, cfg.decoder_layers)
    sel = attention_view.select(payload.layers, payload.heads, payload.kinds, payload.level, layers, cfg.n_heads)
    options = limited_options(service, settings, payload.beam_size, 1, None)
    text, result = await until_disconnect(
        request, state, service.attention(payload.q, options, settings.request_timeout_s)
    )
    attention_view.check_size(result, sel, settings.attention_max_cells)
    build = functools.partial(attention_view.build, result, sel, settings.attention_max_cells)
    maps = await service.on_model_thread(build, settings.request_timeout_s)  # (milliseconds)
    timing.returned()
    return AttentionResponse(
        translatedText=text,
        source=service.source,
        target=service.target,
        level=payload.level,
        n_layers=cfg.decoder_layers,
        n_encoder_layers=cfg.encoder_layers,
        n_decoder_layers=cfg.decoder_layers,
        n_heads=cfg.n_heads,
        **maps,
    )


# --- routes that read no body --------------------------------------------------------------
async def frontend_settings(state: StateDep) -> FrontendSettings:
    """What LibreTranslate clients read before translating: limits, key requirements, files."""
    s = state.settings
    targets = sorted({t for _, t in state.services}) or ["en"]
    return FrontendSettings(
        apiKeys=bool(s.known_keys),
        keyRequired=bool(s.api_keys),
        charLimit=s.char_limit or s.max_text_chars,
        frontendTimeout=500,
        suggestions=s.suggestions,
        filesTranslation=True,
        supportedFilesFormat=list(documents.FORMATS),
        language=FrontendLanguages(
            source=LanguageRef(code="auto", name="Auto Detect"),
            target=LanguageRef(code=targets[0], name=LANGUAGE_NAMES.get(targets[0], targets[0])),
        ),
    )


async def languages(state: StateDep) -> list[Language]:
    """Languages and the targets each can be translated to (LibreTranslate's shape)."""
    state.require_ready()
    targets: dict[str, list[str]] = {}
    for source, target in state.pairs():  # direct models and pairs through the pivot
        targets.setdefault(source, []).append(target)
        targets.setdefault(target, [])
    return [Language(code=c, name=LANGUAGE_NAMES.get(c, c), targets=t) for c, t in sorted(targets.items())]


async def info(state: StateDep, request: Request) -> InfoResponse:
    """Directions, model configs, parameter counts, device, dtype, limits, measured BLEU."""
    s = state.settings
    return InfoResponse(
        version=request.app.version,
        ready=state.ready.is_set(),
        malloc=active_malloc(),
        directions=[DirectionInfo(**svc.info()) for svc in state.services.values()],
        limits=Limits(
            max_text_chars=s.max_text_chars,
            max_items=s.max_items,
            max_beam=s.max_beam,
            max_alternatives=s.max_alternatives,
            max_body_bytes=s.max_body_bytes,
            request_timeout_s=s.request_timeout_s,
            attention_max_tokens=s.attention_max_tokens,
        ),
        batching=Batching(
            max_batch_sentences=s.max_batch_sentences,
            max_batch_tokens=s.max_batch_tokens,
            max_wait_ms=s.max_wait_ms,
            queue_size=s.queue_size,
        ),
    )


async def health(state: StateDep, response: Response) -> HealthResponse:
    """Liveness: 200 while the process can serve (or is still loading); 503 once loading the
    models failed, so an orchestrator restarts it."""
    if state.load_error:
        response.status_code = 503
        return HealthResponse(status="unhealthy", error="models failed to load (see the server log)")
    return HealthResponse(status="ok")


async def ready(state: StateDep) -> ReadyResponse:
    """Readiness: 200 once every model is loaded and warmed up; 503 before and while draining."""
    state.require_ready()
    return ReadyResponse(status="ready", directions=[svc.direction for svc in state.services.values()])


class PrometheusResponse(Response):
    """prometheus-client's own ASGI exposition app as the answer: the text format, or
    OpenMetrics when the scraper asks for it (Accept), gzip when it accepts it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.app = make_asgi_app(registry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


METRICS_TYPES: dict[str, Any] = {CONTENT_TYPE_LATEST.split(";")[0]: {}, OPENMETRICS_CONTENT_TYPE.split(";")[0]: {}}


async def metrics(state: StateDep) -> PrometheusResponse:
    """Prometheus text format (OpenMetrics on request; gzip when accepted)."""
    return PrometheusResponse(state.metrics.registry)


async def spec(request: Request) -> JSONResponse:
    """The OpenAPI document where LibreTranslate serves its own (``/openapi.json`` has it too)."""
    return JSONResponse(request.app.openapi())


async def index() -> Response:
    """The translation page (app/static/index.html, translate.js)."""
    return page("index.html")


async def viewer() -> Response:
    """The attention viewer (app/static/viewer.html, viewer.js); the translation page links to it
    with ``?source=&target=&q=`` (the sentence at hand)."""
    return page("viewer.html")


def page(name: str) -> Response:
    path = STATIC / name
    if not path.is_file():
        return JSONResponse({"error": f"page {name} not installed", "error_type": "not_found"}, status_code=404)
    return FileResponse(path)
