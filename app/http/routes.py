"""HTTP endpoints. What a route needs it declares (``app.http.deps``: the state, the checked and
validated body, the direction's service); the work is in ``TranslationService``.

``build_router(models)`` registers the routes with the request models ``create_app`` built from
the settings and the checkpoints (``app.openapi.request_models``), which the published schema
states; ``router`` is the same routes with the models as written (no limits).

(No ``from __future__ import annotations``: the routes ``build_router`` makes annotate with its
locals, which FastAPI reads from the signatures at run time.)
"""

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, make_asgi_app
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from starlette.types import ASGIApp, Receive, Scope, Send

from app.formats import documents, html
from app.http import attention_view, uploads
from app.http.deps import HeaderKey, StateDep, body, direction_service, get_state, keyed
from app.http.openapi import RequestModels, request_body
from app.http.schemas import (
    AttentionRequest,
    AttentionResponse,
    Batching,
    DetectionResult,
    DetectRequest,
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
    SentenceDetails,
    SuggestRequest,
    SuggestResponse,
    Timings,
    TranslateFileResponse,
    TranslateRequest,
    TranslateResponse,
)
from app.observability import timing
from app.serving.errors import BAD_REQUEST, ApiError
from app.serving.pivots import Legs
from app.serving.service import ItemResult, TranslationService
from app.serving.state import AppState
from app.settings import Settings
from model.engine.allocator import active_malloc
from model.engine.options import DecodingOptions

STATIC = Path(__file__).parents[1] / "static"
LANGUAGE_NAMES = {"de": "German", "en": "English", "fr": "French", "cs": "Czech"}
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 403, 413, 429, 503, 504)}
# 422 only where source "auto" can take a text to be in a language no model serves (app.http.errors)
AUTO_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    422: {"model": ErrorResponse, "description": 'source "auto": the detected language has no model'},
}
T = TypeVar("T")
DETECT_CHARS = 10_000  # of a document's text, for source "auto" (enough to tell; bounded work)


def build_router(models: RequestModels) -> APIRouter:
    """Every route, the bodies of /translate, /attention, /detect and /suggest read into (and
    published as) ``models``."""
    router = APIRouter()
    translate_body, attention_body = body(models.translate), body(models.attention)
    AttentionBody = Annotated[AttentionRequest, Depends(attention_body)]
    AttentionService = Annotated[TranslationService, Depends(direction_service(attention_body))]
    DetectBody = Annotated[DetectRequest, Depends(body(models.detect))]
    SuggestBody = Annotated[SuggestRequest, Depends(body(models.suggest))]

    # The busiest route reads its body by calling the dependency itself and answers the JSON
    # bytes: FastAPI's resolution of its four dependencies was about a sixth of the event loop's
    # CPU a request at 64 clients, CPU the model's two threads wait for on a small machine
    # (docs/benchmarks.md "Serving: the collector and the framework's share"). The document is
    # the same: the body was always given by hand, the answer's schema is ``response_model``.
    # ``create_app`` serves it past the router (``direct_translate``, the same ``translate_answer``).
    @router.post(
        "/translate",
        response_model=TranslateResponse,
        response_model_exclude_none=True,
        responses=AUTO_ERRORS,
        openapi_extra=keyed(request_body(models.translate)),
    )
    async def translate(request: Request) -> Response:
        """Translate a text or a list of texts (LibreTranslate-compatible). With ``source: "auto"``
        each text's language is detected (``detectedLanguage`` in the answer, one per text)."""
        return await translate_answer(request, translate_body)

    @router.post("/detect", responses=ERRORS, openapi_extra=keyed(request_body(models.detect)))
    async def detect(payload: DetectBody, state: StateDep) -> list[DetectionResult]:
        """The language of a text among those this server translates from, most likely first, with
        confidences 0-100 (LibreTranslate's /detect)."""
        check_texts([payload.q], state.settings)
        found = state.detect_candidates(payload.q)
        timing.returned()
        return [DetectionResult(language=d.language, confidence=d.confidence) for d in found]

    @router.post(
        "/suggest",
        responses=ERRORS,
        openapi_extra=keyed(request_body(models.suggest)),
        dependencies=[Depends(suggestions_enabled)],  # 403 before the body is read
    )
    async def suggest(payload: SuggestBody, state: StateDep) -> SuggestResponse:
        """Keep a user's better translation for fine-tuning (LibreTranslate's /suggest); 403 unless
        the server enables suggestions (``TRANSLATOR_SUGGESTIONS``)."""
        return await keep_suggestion(payload, state)

    @router.post("/attention", responses=ERRORS, openapi_extra=keyed(request_body(models.attention)))
    async def attention(
        payload: AttentionBody, service: AttentionService, state: StateDep, request: Request
    ) -> AttentionResponse:
        """Translate one text and return per-layer, per-head attention maps of the translation."""
        return await attention_maps(payload, service, state, request)

    @router.post(
        "/translate_file",
        response_model_exclude_none=True,
        responses={**AUTO_ERRORS, 415: {"model": ErrorResponse}},
        openapi_extra=keyed(uploads.upload_body(models.translate)),
    )
    async def translate_file(request: Request, state: StateDep, key: HeaderKey) -> TranslateFileResponse:
        """Translate a document (LibreTranslate's /translate_file): multipart/form-data with the
        ``file`` (.txt, .html, .srt, .docx), ``source`` (or "auto") and ``target``. The answer
        says where to download the translation (``GET /download_file/{name}``, for a while)."""
        return await translate_document(request, state, key)

    router.add_api_route(
        "/download_file/{name}",
        download_file,
        methods=["GET"],
        response_class=Response,
        responses=uploads.DOWNLOAD_RESPONSES,
    )
    add_service_routes(router)
    return router


async def translate_answer(
    request: Request, read: Callable[[Request, AppState], Awaitable[TranslateRequest]]
) -> Response:
    """POST /translate: the body read by ``read`` (a ``body`` dependency), its texts translated,
    the answer's JSON bytes."""
    state = await get_state(request)
    payload = await read(request, state)
    answer = await translate_texts(payload, state, request)
    return Response(answer.model_dump_json(exclude_none=True), media_type="application/json")


def direct_translate(models: RequestModels) -> ASGIApp:
    """POST /translate as a bare ASGI app, for ``app.middleware.DirectRoutes``: the route's own
    ``translate_answer`` without FastAPI's router and request handler around it (route matching,
    its exit stacks, dependency resolution: about a fifth of the event loop's CPU a request,
    docs/benchmarks.md "The event loop's share past the router"). The route ``build_router``
    registers stays: the OpenAPI document is its, and an app without ``DirectRoutes`` serves it."""
    read = body(models.translate)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = await translate_answer(Request(scope, receive, send), read)
        await response(scope, receive, send)

    return app


def add_service_routes(router: APIRouter) -> None:
    """The routes that read no body: the same in every app."""
    router.add_api_route("/frontend/settings", frontend_settings, methods=["GET"])
    router.add_api_route("/languages", languages, methods=["GET"])
    router.add_api_route("/info", info, methods=["GET"])
    health_errors: dict[int | str, dict[str, Any]] = {503: {"model": HealthResponse}}
    router.add_api_route("/health", health, methods=["GET"], response_model_exclude_none=True, responses=health_errors)
    router.add_api_route("/ready", ready, methods=["GET"], responses={503: {"model": ErrorResponse}})
    metrics_types: dict[int | str, dict[str, Any]] = {200: {"content": METRICS_TYPES}}
    router.add_api_route("/metrics", metrics, methods=["GET"], response_class=Response, responses=metrics_types)
    router.add_api_route("/spec", spec, methods=["GET"], include_in_schema=False)
    router.add_api_route("/", index, methods=["GET"], include_in_schema=False)


def check_texts(texts: list[str], settings: Settings) -> None:
    if not texts:
        raise ApiError(BAD_REQUEST, "validation_error", "q: give at least one text")
    if len(texts) > settings.max_items:
        raise ApiError(
            BAD_REQUEST, "too_many_items", f"q: {len(texts)} texts; at most {settings.max_items} per request"
        )
    for i, text in enumerate(texts):
        if not text.strip():
            raise ApiError(BAD_REQUEST, "empty_text", f"q[{i}]: text is empty")
        if len(text) > settings.max_text_chars:
            raise ApiError(
                BAD_REQUEST, "text_too_long", f"q[{i}]: {len(text)} characters; at most {settings.max_text_chars}"
            )


def limited_options(
    service: TranslationService, settings: Settings, beam_size: int | None, n_best: int, max_length: int | None
) -> DecodingOptions:
    """The request's options on top of the model card's (``TranslationService.decoding_options``),
    within this server's limits (400)."""
    if n_best - 1 > settings.max_alternatives:
        raise ApiError(BAD_REQUEST, "validation_error", f"alternatives: at most {settings.max_alternatives}")
    options = service.decoding_options(beam_size, n_best, max_length)  # a narrower beam widened to n_best
    if options.beam_size > settings.max_beam:
        raise ApiError(
            BAD_REQUEST, "validation_error", f"beam_size: at most {settings.max_beam} (alternatives + 1 included)"
        )
    cap = service.translator.config.max_tokens
    if max_length is not None and max_length > cap:
        raise ApiError(BAD_REQUEST, "validation_error", f"max_length: at most {cap}")
    return options


async def until_disconnect(request: Request, state: AppState, work: Awaitable[T]) -> T:
    """Run ``work``; if the client goes away first, cancel it (its sentences leave the queue or
    the running batch). Cancelled itself (the drain timeout), it answers 503. What the service
    and its scheduler refuse leaves as their own errors (``app.http.errors.refusal`` answers them).
    ``work`` runs in this request's task, which a watcher of the connection cancels: no task of
    its own (each task is event-loop time on every request)."""
    current = asyncio.current_task()
    assert current is not None
    state.requests.add(current)
    gone = False

    async def disconnected() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        current.cancel()

    watcher = asyncio.ensure_future(disconnected())
    try:
        return await work
    except asyncio.CancelledError:
        current.uncancel()  # (answered here: the task carries on to send the answer)
        if gone:
            raise ApiError(499, "client_closed_request", "the client disconnected") from None
        # the drain timeout passed (AppState.cut_off, or uvicorn's graceful-shutdown timeout):
        # the work is withdrawn (its awaits were cancelled) and the answer is 503, not uvicorn's 500.
        raise ApiError(
            503, "shutting_down", "the service stopped before this request finished", {"Retry-After": "1"}
        ) from None
    finally:
        watcher.cancel()
        state.requests.discard(current)


async def all_of(work: Sequence[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` of ``work``, without a task for a lone awaitable (one source language)."""
    return [await work[0]] if len(work) == 1 else list(await asyncio.gather(*work))


async def translate_texts(payload: TranslateRequest, state: AppState, request: Request) -> TranslateResponse:
    """/translate: texts grouped by source language (given, or detected per text), each group
    through its model (or two, through the pivot), the answer in the shape of ``q``. HTML
    (``format: "html"``) goes through ``app.formats.html``: its text translated, its markup kept."""
    texts = [payload.q] if isinstance(payload.q, str) else payload.q
    check_texts(texts, state.settings)
    is_html = payload.format == "html"
    detected = (
        [state.detect_source(html.visible_text(text) if is_html else text) for text in texts]
        if payload.source == "auto"
        else None
    )
    sources = [d.language for d in detected] if detected is not None else [payload.source] * len(texts)
    groups: dict[str, list[int]] = {}  # source language -> its texts' positions
    for i, source in enumerate(sources):
        groups.setdefault(source, []).append(i)
    deadline = time.monotonic() + state.settings.request_timeout_s
    legs = {source: request_legs(state.route(source, payload.target), payload, state, deadline) for source in groups}
    for source, positions in groups.items():  # shed load before tokenizing: each text has a sentence
        for service in legs[source].services:
            service.scheduler.check_room(len(positions))
    found = (
        [DetectionResult(language=d.language, confidence=d.confidence) for d in detected]
        if detected is not None
        else None
    )
    if is_html:
        pages = await until_disconnect(request, state, translate_pages(texts, groups, legs))
        timing.returned()
        return shaped_pages(isinstance(payload.q, str), pages, bool(payload.alternatives), found)
    work = [legs[source].items([texts[i] for i in positions]) for source, positions in groups.items()]
    done = await until_disconnect(request, state, all_of(work))
    items: list[ItemResult] = [None] * len(texts)  # type: ignore[list-item]
    for positions, results in zip(groups.values(), done, strict=True):
        for i, item in zip(positions, results, strict=True):
            items[i] = item
    services = {source: list(leg.services) for source, leg in legs.items()}
    details = [item_details(services[s], i) for s, i in zip(sources, items, strict=True)] if payload.details else None
    answer = shaped(isinstance(payload.q, str), items, bool(payload.alternatives), details, found)
    timing.returned()
    return answer


def request_legs(route: list[TranslationService], payload: TranslateRequest, state: AppState, deadline: float) -> Legs:
    """The models of a route (one, or two via English) with the request's options for each (the
    alternatives come from the last; none for HTML), within this server's limits (400)."""
    settings = state.settings
    n_best = 1 if payload.format == "html" else payload.alternatives + 1
    options = [
        limited_options(
            leg,
            settings,
            payload.beam_size,
            n_best if last else 1,
            payload.max_length if last else None,
        )
        for leg, last in ((leg, number == len(route) - 1) for number, leg in enumerate(route))
    ]
    return Legs(tuple(route), tuple(options), deadline)


async def translate_pages(texts: list[str], groups: dict[str, list[int]], legs: dict[str, Legs]) -> list[str]:
    """HTML texts through ``app.formats.html``, each source language's through its legs, in order."""
    work = [html.translate_html([texts[i] for i in positions], legs[source]) for source, positions in groups.items()]
    translated: list[str] = [""] * len(texts)
    for positions, results in zip(groups.values(), await all_of(work), strict=True):
        for i, text in zip(positions, results, strict=True):
            translated[i] = text
    return translated


def shaped_pages(
    single: bool, pages: list[str], alternatives: bool, detected: list[DetectionResult] | None
) -> TranslateResponse:
    """The /translate answer for HTML: no alternatives (an empty list each when asked, as
    LibreTranslate answers) and no details."""
    return TranslateResponse(
        translatedText=pages[0] if single else pages,
        alternatives=([] if single else [[] for _ in pages]) if alternatives else None,
        detectedLanguage=(detected[0] if single else detected) if detected is not None else None,
    )


def shaped(
    single: bool,
    items: list[ItemResult],
    alternatives: bool,
    details: list[ItemDetails] | None,
    detected: list[DetectionResult] | None,
) -> TranslateResponse:
    """The /translate answer in the shape of ``q``: one value per field for one text, else lists."""

    def each(values: list[T] | None) -> T | list[T] | None:
        return values if values is None or not single else values[0]

    return TranslateResponse(
        translatedText=each([i.texts[0] for i in items]),
        alternatives=each([i.texts[1:] for i in items]) if alternatives else None,
        details=each(details),
        detectedLanguage=each(detected),
    )


def item_details(legs: list[TranslationService], item: ItemResult) -> ItemDetails:
    """Details of the last leg's translation; ``models`` names every model that ran."""
    tokenizer = legs[-1].translator.tokenizer
    sentences: list[SentenceDetails] = []
    for s in item.sentences:
        best = s.hypotheses[0]
        sentences.append(
            SentenceDetails(
                source=s.source,
                translation=tokenizer.decode([best.ids])[0],
                source_tokens=tokenizer.pieces(s.source_ids),
                target_tokens=tokenizer.pieces(best.ids),
                score=round(best.score, 4),
                truncated=not best.finished,
                cached=s.cached,
            )
        )
    return ItemDetails(
        tokens=[t for s in sentences for t in s.target_tokens],
        score=round(sum(s.score for s in sentences) / len(sentences), 4),
        source_token_count=sum(len(s.source_tokens) for s in sentences),
        target_token_count=sum(len(s.target_tokens) for s in sentences),
        truncated=any(s.truncated for s in sentences),
        sentences=sentences,
        timings=Timings(queue_ms=round(item.queue_ms, 2), total_ms=round(item.total_ms, 2)),
        models=[leg.direction for leg in legs],
    )


async def translate_document(request: Request, state: AppState, key: str | None) -> TranslateFileResponse:
    """/translate_file: the upload read (at most ``max_file_bytes``), the client admitted as by
    every route, the document checked and parsed (``app.formats.documents``; 400 with its error type),
    its text counted against the client's limits and the queue, translated through the legs of
    its route, and kept in memory (``state.files``) under a random name."""
    settings = state.settings
    upload = await uploads.read_upload(request, settings.max_file_bytes)
    client = await uploads.admit(request, state, key, upload)
    source, target = upload.field("source"), upload.field("target")
    route = state.route(source, target) if source != "auto" else None  # (503 while loading, 400)
    state.require_ready()
    timing.parsed()
    try:
        document = await asyncio.to_thread(documents.parse, upload.filename or "", upload.data)
    except documents.DocumentError as err:
        raise ApiError(400, err.error_type, str(err)) from None
    uploads.check_characters(document.texts, state.rate_limiter.limits_for(client).chars)
    count = await asyncio.to_thread(documents.sentence_count, document.texts)  # (megabytes of text)
    if not count:
        raise ApiError(400, "empty_document", "file: no text to translate")
    detected = state.detect_source(" ".join(document.texts)[:DETECT_CHARS]) if route is None else None
    route = route or state.route(detected.language if detected else source, target)
    options = tuple(limited_options(leg, settings, None, 1, None) for leg in route)
    legs = Legs(tuple(route), options, time.monotonic() + settings.request_timeout_s)
    for service in legs.services:  # more sentences than the queue holds: 413 (or 429 while busy)
        service.scheduler.check_room(count)
    data = await until_disconnect(request, state, document.translate(legs))
    fmt = document.format
    try:
        name = await state.files.put(
            uploads.safe_filename(upload.filename or "", fmt.suffix), fmt.media_type, data, fmt.suffix
        )
    except ValueError as err:
        raise ApiError(413, "file_too_large", f"the translation is too large to keep: {err}") from None
    timing.returned()
    return TranslateFileResponse(
        translatedFileUrl=str(request.url_for("download_file", name=name)),
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


async def keep_suggestion(payload: SuggestRequest, state: AppState) -> SuggestResponse:
    check_texts([payload.q, payload.s], state.settings)
    state.service(payload.source, payload.target)  # a direction this server translates (400 otherwise)
    assert state.suggestions is not None  # (suggestions_enabled)
    await asyncio.to_thread(state.suggestions.add, payload.source, payload.target, payload.q, payload.s)
    return SuggestResponse(success=True)


async def attention_maps(
    payload: AttentionRequest, service: TranslationService, state: AppState, request: Request
) -> AttentionResponse:
    """/attention: decode as usual, then the maps of the returned translation (``service.attention``)."""
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


# --- routes that read no body (``add_service_routes``) ----------------------------------------
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
    page = STATIC / "index.html"
    if not page.is_file():
        return JSONResponse({"error": "viewer page not installed", "error_type": "not_found"}, status_code=404)
    return FileResponse(page)


router = build_router(RequestModels())
