"""The OpenAPI document states the limits this server enforces.

The request models (``app.schemas``) hold what is always true (types, ``ge=1``); the limits come
from the settings and the loaded models: text length, texts per request, beam, alternatives,
the languages served, layer and head indices. They are written into the published schema
here, in one place, so a schema-driven client or fuzzer (schemathesis in the tests) generates
requests the server accepts, and anything the schema rejects the server rejects too.
What a JSON schema cannot say (a language *pair* no model serves, a text whose tokens exceed
``attention_max_tokens``, an attention reply above ``attention_max_cells``) stays in the
field descriptions and gets a 422.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.settings import Settings
from model import checkpoint

log = logging.getLogger(__name__)

FORM = "application/x-www-form-urlencoded"
# A text needs one character that is not white space (blank texts get 422 empty_text); Python's
# str.isspace() also counts the separators U+001C-U+001F and U+0085, which ECMA's \s does not.
NON_BLANK = r"[^\s\x1c-\x1f\x85]"


@dataclass(frozen=True)
class ModelFacts:
    """What the schema needs from the checkpoints under the weights folder (config.json only)."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    max_length: int  # longest output any model allows (max_positions - 1), smallest over models
    layers: int  # indices /attention accepts: min(encoder, decoder layers)
    heads: int


def model_facts(weights_dir: Path) -> ModelFacts | None:
    """Read every checkpoint's config.json; None when there is none (the schema then states
    the settings' limits only)."""
    from app.service import discover  # (app.service imports torch: only when a schema is built)

    try:
        metas = [checkpoint.read_meta(p) for p in discover(weights_dir)]
        configs = [checkpoint.model_config(m, weights_dir) for m in metas]
    except (RuntimeError, checkpoint.CheckpointError) as err:
        log.warning("OpenAPI schema without model limits: %s", err)
        return None
    return ModelFacts(
        sources=tuple(sorted({str(m["source_lang"]) for m in metas})),
        targets=tuple(sorted({str(m["target_lang"]) for m in metas})),
        max_length=min(c.max_positions - 1 for c in configs),
        layers=min(min(c.encoder_layers, c.decoder_layers) for c in configs),
        heads=min(c.n_heads for c in configs),
    )


def _text(limit: int) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": limit, "pattern": NON_BLANK}


def _indices(n: int) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": n - 1},
            "minItems": 1, "maxItems": n, "uniqueItems": True}  # fmt: skip


def _limit(properties: dict[str, Any], name: str, **constraints: Any) -> None:
    """Add constraints to an optional property (``anyOf: [{...}, {type: null}]``) or a plain one."""
    prop = properties[name]
    for option in prop.get("anyOf", [prop]):
        if option.get("type") in ("integer", "array", "string"):
            option.update(constraints)


def _form(body: dict[str, Any]) -> dict[str, Any]:
    """The form-encoded variant of a JSON body schema: a form has no null (an unset field is
    left out), so the ``null`` alternatives of optional fields go."""
    body = copy.deepcopy(body)
    for prop in body["properties"].values():
        if "anyOf" in prop:
            prop["anyOf"] = [o for o in prop["anyOf"] if o.get("type") != "null"]
            if len(prop["anyOf"]) == 1:
                prop.update(prop.pop("anyOf")[0])
        if prop.get("default", 0) is None:
            del prop["default"]
    return body


def constrain(schema: dict[str, Any], settings: Settings, facts: ModelFacts | None) -> None:
    """Write the limits into the /translate and /attention request bodies of ``schema``."""
    beam, texts = settings.max_beam, settings.max_text_chars
    for path in ("/translate", "/attention"):
        contents = schema["paths"][path]["post"]["requestBody"]["content"]
        contents[FORM]["schema"] = _form(contents[FORM]["schema"])
        for content in contents.values():
            props = content["schema"]["properties"]
            if path == "/translate":
                texts_list = {"type": "array", "items": _text(texts), "minItems": 1, "maxItems": settings.max_items}
                props["q"]["anyOf"] = [_text(texts), texts_list]
                # alternatives + 1 hypotheses come from one beam: at most max_beam - 1 of them
                _limit(props, "alternatives", maximum=min(settings.max_alternatives, beam - 1))
                if facts is not None:
                    _limit(props, "max_length", maximum=facts.max_length)
            else:
                # a text of n characters has at most n + 1 pieces (a word-start piece, then one per
                # character) unless Unicode normalization expands it (NFKC: U+FDFA is 18 letters)
                tokens = settings.attention_max_tokens
                if facts is not None:
                    tokens = min(tokens, facts.max_length)
                props["q"].update(_text(min(texts, tokens - 1)))
                if facts is not None:
                    _limit(props, "layers", **_indices(facts.layers))
                    _limit(props, "heads", **_indices(facts.heads))
                _limit(props, "kinds", minItems=1)
            _limit(props, "beam_size", maximum=beam)
            if facts is not None:
                auto = ["auto"] if path == "/translate" else []  # detected per text
                props["source"]["enum"] = [*auto, *facts.sources]
                props["target"]["enum"] = list(facts.targets)
    detect = schema["paths"]["/detect"]["post"]["requestBody"]["content"]
    detect[FORM]["schema"] = _form(detect[FORM]["schema"])
    for content in detect.values():
        content["schema"]["properties"]["q"].update(_text(texts))
    suggest = schema["paths"]["/suggest"]["post"]["requestBody"]["content"]
    suggest[FORM]["schema"] = _form(suggest[FORM]["schema"])
    for content in suggest.values():
        props = content["schema"]["properties"]
        props["q"].update(_text(texts))
        props["s"].update(_text(texts))
        if facts is not None:
            props["source"]["enum"] = list(facts.sources)
            props["target"]["enum"] = list(facts.targets)


def install(app: FastAPI, settings: Settings) -> None:
    """Serve the constrained schema at /openapi.json (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            constrain(schema, settings, model_facts(settings.weights_dir))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
