"""The OpenAPI document states the limits this server enforces.

The request models (``app.http.schemas``) hold what is always true (types, ``ge=1``); the limits come
from the settings and the loaded models: text length, texts per request, beam, alternatives,
the languages served, layer and head indices. ``request_models`` builds, when the app is
created, subclasses of the request models whose fields state those limits, and the routes are
registered with them, so the published schema comes from the models and a schema-driven client
or fuzzer (schemathesis in the tests) generates requests the server accepts, and anything the
schema rejects the server rejects too.
The limits are stated in the schema, not validated by pydantic: the routes check them with
their own error types and messages (``too_many_items``, ``text_too_long``,
``unsupported_language_pair``, "beam_size: at most 4 (alternatives + 1 included)", ...).
What a JSON schema cannot say (a language *pair* no model serves, a text whose tokens exceed
``attention_max_tokens``, an attention reply above ``attention_max_cells``) stays in the
field descriptions and gets a 400, as every invalid request does (``app.http.errors``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast

from pydantic import BaseModel, GetJsonSchemaHandler, StrictStr, create_model
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from app.http.schemas import AttentionRequest, DetectRequest, Kind, SuggestRequest, TranslateRequest
from app.settings import Settings
from model import checkpoint

log = logging.getLogger(__name__)

FORM = "application/x-www-form-urlencoded"
# A text needs one character that is not white space (blank texts get 400 empty_text); Python's
# str.isspace() also counts the separators U+001C-U+001F and U+0085, which ECMA's \s does not.
NON_BLANK = r"[^\s\x1c-\x1f\x85]"
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ModelFacts:
    """What the schema needs from the checkpoints under the weights folder (config.json only)."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    max_length: int  # longest output any model allows (ModelConfig.max_tokens), smallest over models
    layers: int  # indices /attention accepts: min(encoder, decoder layers)
    heads: int


def model_facts(weights_dir: Path, languages: Sequence[str] = ()) -> ModelFacts | None:
    """Read the config.json of every checkpoint served (``languages``: the load_only setting);
    None when there is none (the schema then states the settings' limits only)."""
    from app.serving.service import (  # (app.serving.service imports torch: only for a schema)
        assign_directions,
        discover,
    )

    try:
        plan = assign_directions(discover(weights_dir, languages), languages)  # the checkpoints served
        configs = [checkpoint.model_config(checkpoint.read_meta(p), weights_dir) for p in plan]
    except (RuntimeError, checkpoint.CheckpointError) as err:
        log.warning("OpenAPI schema without model limits: %s", err)
        return None
    pairs = [pair for served in plan.values() for pair in served or []]
    return ModelFacts(
        sources=tuple(sorted({s for s, _ in pairs})),
        targets=tuple(sorted({t for _, t in pairs})),
        max_length=min(c.max_tokens for c in configs),
        layers=min(min(c.encoder_layers, c.decoder_layers) for c in configs),
        heads=min(c.n_heads for c in configs),
    )


class Stated:
    """JSON schema keywords a type states without pydantic validating them: a limit the route
    checks itself, with its own error type and message. ``Annotated[int, Stated(maximum=4)]``
    puts the keyword on the integer itself, inside an optional field's ``anyOf``."""

    def __init__(self, **keywords: Any) -> None:
        self.keywords = keywords

    def __repr__(self) -> str:
        return f"Stated({self.keywords})"

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {**handler(schema), **self.keywords}


def _text(limit: int) -> Stated:
    return Stated(minLength=1, maxLength=limit, pattern=NON_BLANK)


def _indices(n: int) -> Any:
    index = Annotated[int, Stated(minimum=0, maximum=n - 1)]
    return Annotated[list[index], Stated(minItems=1, maxItems=n, uniqueItems=True)]


def _languages(codes: Any) -> Any:
    return Annotated[StrictStr, Stated(enum=list(codes))]


@dataclass(frozen=True)
class RequestModels:
    """The request body models the routes validate into and publish (their limits stated)."""

    translate: type[TranslateRequest] = TranslateRequest
    attention: type[AttentionRequest] = AttentionRequest
    detect: type[DetectRequest] = DetectRequest
    suggest: type[SuggestRequest] = SuggestRequest


def request_models(settings: Settings, facts: ModelFacts | None) -> RequestModels:
    """Subclasses of the request models whose schemas state this server's limits (the settings'
    and, when the checkpoints could be read, the models')."""
    beam, chars = settings.max_beam, settings.max_text_chars
    text = Annotated[StrictStr, _text(chars)]
    texts = Annotated[list[text], Stated(minItems=1, maxItems=settings.max_items)]
    beam_size = Annotated[int, Stated(maximum=beam)] | None
    # alternatives + 1 hypotheses come from one beam: at most max_beam - 1 of them
    alternatives = Annotated[int, Stated(maximum=min(settings.max_alternatives, beam - 1))]
    # a text of n characters has at most n + 1 pieces (a word-start piece, then one per
    # character) unless Unicode normalization expands it (NFKC: U+FDFA is 18 letters)
    tokens = min(settings.attention_max_tokens, facts.max_length) if facts else settings.attention_max_tokens
    translate: dict[str, Any] = {"q": text | texts, "beam_size": beam_size, "alternatives": alternatives}
    attention: dict[str, Any] = {
        "q": Annotated[StrictStr, _text(min(chars, tokens - 1))],
        "beam_size": beam_size,
        "kinds": Annotated[list[Kind], Stated(minItems=1)] | None,
    }
    suggest: dict[str, Any] = {"q": text, "s": text}
    if facts is not None:
        translate |= {
            "source": _languages(["auto", *facts.sources]),  # "auto": detected per text
            "target": _languages(facts.targets),
            "max_length": Annotated[int, Stated(maximum=facts.max_length)] | None,
        }
        directions = {"source": _languages(facts.sources), "target": _languages(facts.targets)}
        attention |= {"layers": _indices(facts.layers) | None, "heads": _indices(facts.heads) | None, **directions}
        suggest |= directions
    return RequestModels(
        translate=_restated(TranslateRequest, translate),
        attention=_restated(AttentionRequest, attention),
        detect=_restated(DetectRequest, {"q": text}),
        suggest=_restated(SuggestRequest, suggest),
    )


def _restated(base: type[M], annotations: dict[str, Any]) -> type[M]:
    """``base`` with the types of some fields replaced by ones stating limits; their defaults,
    descriptions and validation stay ``base``'s."""
    fields: dict[str, Any] = {name: (kind, base.model_fields[name]) for name, kind in annotations.items()}
    model = create_model(base.__name__, __base__=base, __module__=base.__module__, __doc__=base.__doc__, **fields)
    return cast(type[M], model)


class FormJsonSchema(GenerateJsonSchema):
    """A request model's schema as a form-encoded body: a form has no null (an unset field is
    left out), so optional fields lose their ``null`` alternative and their null default."""

    def nullable_schema(self, schema: core_schema.NullableSchema) -> JsonSchemaValue:
        return self.generate_inner(schema["schema"])

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        json_schema = super().default_schema(schema)
        if "default" in json_schema and json_schema["default"] is None:
            del json_schema["default"]
        return json_schema


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The ``openapi_extra`` of a route whose body a dependency reads (``app.http.deps.body``), the
    one place the document is given anything by hand: FastAPI describes a body only when it
    parses it itself, and then in one media type. Both media types are ``model``'s schema."""
    content = {
        "application/json": {"schema": model.model_json_schema()},
        FORM: {"schema": model.model_json_schema(schema_generator=FormJsonSchema)},
    }
    return {"requestBody": {"required": True, "content": content}}
