"""What a route declares in its signature instead of fetching by hand: the app's state and
settings, the API key, and the request body (JSON or form, checked, then validated).

``read_payload`` reads the body of one request model (``translate_body`` and the others, the
dependencies of the routes, take the app's own models: ``request_models``). It is the order of the checks
that matters, so nobody probes validation without a key and no input can reach a 500:

1. the key from ``X-API-Key`` or ``Authorization: Bearer`` (403 before the body is read);
2. the body, JSON or ``application/x-www-form-urlencoded`` as LibreTranslate clients send it,
   with the query string under it (LibreTranslate reads every parameter from either), every
   string valid Unicode and nesting at most ``MAX_JSON_DEPTH`` deep (else 400);
3. the body's ``api_key`` when no header gave one (403 before validation);
4. the client's rate limits (429);
5. validation into the model (400 ``validation_error``), then the client's character limit
   (400 ``too_many_characters``).

(No ``from __future__ import annotations`` here: FastAPI reads the dependencies' annotations at
run time.)
"""

import hmac
import json
from typing import Annotated, Any, TypeVar
from urllib.parse import parse_qs

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPBearer
from pydantic import BaseModel, ValidationError

from app.http.errors import describe_validation
from app.http.openapi import RequestModels
from app.http.schemas import AttentionRequest, DetectRequest, SuggestRequest, TranslateRequest
from app.observability import timing
from app.serving.errors import BAD_REQUEST, ApiError
from app.serving.service import TranslationService
from app.serving.state import AppState
from app.settings import Settings
from app.storage.ratelimit import client_id

M = TypeVar("M", bound=BaseModel)

# JSON nested deeper than this is refused before validation walks it: no request needs more
# than 3 levels, and deep enough nesting reaches Python's recursion limit (a 500).
MAX_JSON_DEPTH = 32
# Form fields that are lists (a repeated key, or one value); q is a list only when repeated.
FORM_LISTS = frozenset({"layers", "heads", "kinds"})
FORM = "application/x-www-form-urlencoded"

KEYS_NOTE = "required only when the server has keys (TRANSLATOR_API_KEYS); also accepted as the body's api_key"
API_KEY_HEADER = APIKeyHeader(name="X-API-Key", auto_error=False, description=f"API key: {KEYS_NOTE}")
BEARER = HTTPBearer(auto_error=False, description=f"API key as a bearer token: {KEYS_NOTE}")
# The key's two headers are read by ``header_key`` (FastAPI's own readers, called directly), not
# declared as ``Security`` dependencies: each dependency FastAPI resolves costs the event loop
# time on every request (docs/benchmarks/README.md#event-loop). So the keyed
# routes state them in the document themselves: ``keyed`` makes their ``openapi_extra``, the
# schemes go in its components (``security_schemes``, added by ``app.main``).
KEY_SCHEMES = (API_KEY_HEADER, BEARER)


def keyed(extra: dict[str, Any]) -> dict[str, Any]:
    """A keyed route's ``openapi_extra``: ``extra`` and the key's schemes as its ``security``."""
    return {**extra, "security": [{scheme.scheme_name: []} for scheme in KEY_SCHEMES]}


def security_schemes() -> dict[str, Any]:
    """The OpenAPI document's ``components.securitySchemes``: the key's headers."""
    return {
        scheme.scheme_name: scheme.model.model_dump(mode="json", by_alias=True, exclude_none=True)
        for scheme in KEY_SCHEMES
    }


# Dependencies are ``async def`` even where they do not await: FastAPI runs a plain ``def``
# dependency in its thread pool, a hand-off on every request
# (docs/benchmarks/README.md#event-loop).
async def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.translator
    return state


StateDep = Annotated[AppState, Depends(get_state)]


def check_api_key(given: str | None, settings: Settings) -> None:
    """403 unless the key (X-API-Key, Bearer token or api_key field) is configured, when keys
    are required (``api_keys`` set). Otherwise any key passes: a known one (with limits of its
    own) is counted as itself, an unknown one as the client's address. Constant-time compare."""
    if not settings.api_keys:
        return
    if not given or not any(hmac.compare_digest(given.encode(), k.encode()) for k in settings.known_keys):
        raise ApiError(403, "forbidden", "missing or invalid API key")


async def header_key(request: Request, settings: Settings) -> str | None:
    """The key of ``X-API-Key`` or ``Authorization: Bearer``, checked (403) before the body is
    read; None when neither header gives one (the body's ``api_key`` is checked then)."""
    bearer = await BEARER(request)
    key = await API_KEY_HEADER(request) or (bearer.credentials if bearer is not None else None)
    if key is not None:
        check_api_key(key, settings)
    return key


async def header_api_key(request: Request, state: StateDep) -> str | None:
    """``header_key`` for a route that reads its body itself (/translate_file: 403 before the upload)."""
    return await header_key(request, state.settings)


HeaderKey = Annotated[str | None, Depends(header_api_key)]


async def read_body(request: Request) -> dict[str, Any]:
    """JSON or form-encoded (as LibreTranslate clients send), and the query string under it
    (LibreTranslate reads every parameter from any of them, also on POST) -> a dict of plain
    values, every string valid Unicode and nesting at most ``MAX_JSON_DEPTH`` deep (else 400)."""
    raw = await request.body()
    # (the raw query string, not ``request.url``: that builds the whole URL on every request,
    # for a part that is almost always empty)
    try:
        query_string = request.scope["query_string"].decode()
    except UnicodeDecodeError:
        raise ApiError(BAD_REQUEST, "bad_request", "query string is not UTF-8") from None
    query = as_fields(parse_qs(query_string, keep_blank_values=True)) if query_string else {}
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    data: Any
    if query and not raw.strip():
        data = {}  # everything in the query string
    elif content_type == FORM:
        try:
            form = parse_qs(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
        except UnicodeDecodeError:
            raise ApiError(BAD_REQUEST, "bad_request", "form body is not UTF-8") from None
        data = as_fields(form)
    elif content_type in ("application/json", "") or content_type.endswith("+json"):
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(BAD_REQUEST, "invalid_json", f"body is not valid JSON: {err}") from None
        except RecursionError:
            raise ApiError(BAD_REQUEST, "invalid_json", f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    else:
        raise ApiError(415, "unsupported_media_type", f"send application/json or {FORM}")
    check_json(data)
    if not isinstance(data, dict):
        raise ApiError(BAD_REQUEST, "validation_error", "the body must be a JSON object")
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
            raise ApiError(BAD_REQUEST, "invalid_json", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
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
                BAD_REQUEST,
                "invalid_unicode",
                f"a string holds {err.object[err.start]!r}, a lone surrogate: not Unicode text",
            ) from None


def validated(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ApiError(BAD_REQUEST, "validation_error", describe_validation(list(err.errors()))) from None


def check_characters(body: BaseModel, limit: int) -> None:
    """400 when the request's texts together exceed the client's ``char_limit`` (0: none)."""
    q = getattr(body, "q", "")
    total = len(q) if isinstance(q, str) else sum(len(text) for text in q)
    if limit and total > limit:
        raise ApiError(BAD_REQUEST, "too_many_characters", f"q: {total} characters in this request; at most {limit}")


async def read_payload(model: type[M], request: Request, state: AppState) -> M:
    """A request body read, checked and validated into ``model`` (the steps in this module's
    docstring)."""
    settings = state.settings
    key = await header_key(request, settings)
    data = await read_body(request)
    if key is None:
        given = data.get("api_key")
        key = given if isinstance(given, str) else None
        check_api_key(key, settings)
    address = request.client.host if request.client else None
    client = client_id(key if key in settings.known_keys else None, address)
    await state.rate_limiter.hit(client)  # RateLimited: 429 (app.http.errors.refusal)
    payload = validated(model, data)
    check_characters(payload, state.rate_limiter.limits_for(client).chars)
    timing.parsed()
    return payload


def request_models(request: Request) -> RequestModels:
    """The request models of the app serving ``request`` (``app.http.routes.include`` keeps them),
    which its routes publish: a body is validated into the model its route states."""
    models: RequestModels = request.app.state.request_models
    return models


# One dependency per body, each a plain function: FastAPI caches a dependency's value per request
# by the callable, so a route and the dependencies built on its body share one read.
async def translate_body(request: Request, state: StateDep) -> TranslateRequest:
    return await read_payload(request_models(request).translate, request, state)


async def attention_body(request: Request, state: StateDep) -> AttentionRequest:
    return await read_payload(request_models(request).attention, request, state)


async def detect_body(request: Request, state: StateDep) -> DetectRequest:
    return await read_payload(request_models(request).detect, request, state)


async def suggest_body(request: Request, state: StateDep) -> SuggestRequest:
    return await read_payload(request_models(request).suggest, request, state)


AttentionBody = Annotated[AttentionRequest, Depends(attention_body)]
DetectBody = Annotated[DetectRequest, Depends(detect_body)]
SuggestBody = Annotated[SuggestRequest, Depends(suggest_body)]


async def attention_service(payload: AttentionBody, state: StateDep) -> TranslationService:
    """The ``TranslationService`` of the direction the /attention body names: 503 while loading,
    400 for a pair no model serves."""
    return state.service(payload.source, payload.target)


AttentionService = Annotated[TranslationService, Depends(attention_service)]
