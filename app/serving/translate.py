"""The translate use case, without HTTP: what POST /translate and POST /translate_file do once
the request is parsed and the client admitted.

It owns the checks of the texts and the request's limits (400 ``ApiError``), the decoding
options within them, the source language (given, or detected per text for ``source: "auto"``),
texts grouped by source language, each group's route (one model, or two through the pivot:
``Legs``), room in the queues before any tokenizing, running the legs, and the result as plain
frozen values (``Translation``, ``ItemDetail``) that the route turns into its response model.

The route hands in a ``Watch``: how the request's model work runs (the HTTP edge withdraws it
when the client goes away); nothing here knows about requests or responses.
"""

from __future__ import annotations

import asyncio
import re
import time
import unicodedata
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from app.formats import documents, html
from app.observability import timing
from app.serving.detection import Detection
from app.serving.errors import BAD_REQUEST, ApiError
from app.serving.pivots import Legs
from app.serving.service import ItemResult, TranslationService
from app.serving.state import AppState
from app.settings import Settings
from model.engine.options import DecodingOptions, Repetition

T = TypeVar("T")
DETECT_CHARS = 10_000  # of a document's text, for source "auto" (enough to tell; bounded work)


class Watch(Protocol):
    """Runs a request's model work to its end, or withdraws it when the request ends first."""

    def __call__(self, work: Awaitable[T]) -> Awaitable[T]: ...


@dataclass(frozen=True)
class Query:
    """What a /translate request asks for (``app.http.schemas.TranslateRequest``, parsed)."""

    texts: tuple[str, ...]
    source: str  # a language code, or "auto": detected per text
    target: str
    html: bool = False  # markup kept, its text translated (``app.formats.html``)
    alternatives: int = 0
    beam_size: int | None = None
    max_length: int | None = None
    details: bool = False
    repetition: Repetition | None = None  # the request's repetition options (None: the model card's)


@dataclass(frozen=True)
class SentenceDetail:
    source: str
    translation: str
    source_tokens: tuple[str, ...]
    target_tokens: tuple[str, ...]
    score: float
    confidence: int
    truncated: bool
    cached: bool


@dataclass(frozen=True)
class Timings:
    queue_ms: float
    total_ms: float


@dataclass(frozen=True)
class ItemDetail:
    """One text's details (the fields of ``app.http.schemas.ItemDetails``)."""

    tokens: tuple[str, ...]
    score: float
    confidence: int
    source_token_count: int
    target_token_count: int
    truncated: bool
    sentences: tuple[SentenceDetail, ...]
    timings: Timings
    models: tuple[str, ...]


@dataclass(frozen=True)
class Translation:
    """A /translate result, one entry per text in the order given."""

    texts: tuple[str, ...]  # the best translation of each
    alternatives: tuple[tuple[str, ...], ...] | None  # when asked (none for HTML: empty each)
    details: tuple[ItemDetail, ...] | None  # when asked (never for HTML)
    detected: tuple[Detection, ...] | None  # with source "auto"


@dataclass(frozen=True)
class TranslatedDocument:
    """A translated document, kept in ``AppState.files`` under ``name``."""

    name: str
    detected: Detection | None  # with source "auto"


def check_texts(texts: Sequence[str], settings: Settings) -> None:
    """400 for no text, too many, a blank one or one longer than this server takes."""
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
    service: TranslationService,
    settings: Settings,
    beam_size: int | None,
    n_best: int,
    max_length: int | None,
    repetition: Repetition | None = None,
) -> DecodingOptions:
    """The request's options on top of the model card's (``TranslationService.decoding_options``),
    within this server's limits (400)."""
    if n_best - 1 > settings.max_alternatives:
        raise ApiError(BAD_REQUEST, "validation_error", f"alternatives: at most {settings.max_alternatives}")
    options = service.decoding_options(beam_size, n_best, max_length, repetition)  # a narrower beam widened to n_best
    if options.beam_size > settings.max_beam:
        raise ApiError(
            BAD_REQUEST, "validation_error", f"beam_size: at most {settings.max_beam} (alternatives + 1 included)"
        )
    cap = service.translator.config.max_tokens
    if max_length is not None and max_length > cap:
        raise ApiError(BAD_REQUEST, "validation_error", f"max_length: at most {cap}")
    return options


async def all_of(work: Sequence[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` of ``work``, without a task for a lone awaitable (one source language)."""
    return [await work[0]] if len(work) == 1 else list(await asyncio.gather(*work))


async def translate(query: Query, state: AppState, watch: Watch) -> Translation:
    """Texts grouped by source language (given, or detected per text), each group through its
    model (or two, through the pivot). HTML goes through ``app.formats.html``: its text
    translated, its markup kept."""
    texts = list(query.texts)
    check_texts(texts, state.settings)
    detected = (
        [state.detect_source(html.visible_text(text) if query.html else text) for text in texts]
        if query.source == "auto"
        else None
    )
    sources = [d.language for d in detected] if detected is not None else [query.source] * len(texts)
    groups: dict[str, list[int]] = {}  # source language -> its texts' positions
    for i, source in enumerate(sources):
        groups.setdefault(source, []).append(i)
    deadline = time.monotonic() + state.settings.request_timeout_s
    legs = {source: query_legs(state.route(source, query.target), query, state, deadline) for source in groups}
    for source, positions in groups.items():  # shed load before tokenizing: each text has a sentence
        for service in legs[source].services:
            service.scheduler.check_room(len(positions))
    found = tuple(detected) if detected is not None else None
    if query.html:
        pages = await watch(translate_pages(texts, groups, legs))
        alternatives = tuple(() for _ in pages) if query.alternatives else None
        return Translation(tuple(pages), alternatives, None, found)
    work = [legs[source].items([texts[i] for i in positions]) for source, positions in groups.items()]
    done = await watch(all_of(work))
    items: list[ItemResult] = [None] * len(texts)  # type: ignore[list-item]
    for positions, results in zip(groups.values(), done, strict=True):
        for i, item in zip(positions, results, strict=True):
            items[i] = item
    details = (
        tuple(item_detail(legs[s].services, i) for s, i in zip(sources, items, strict=True)) if query.details else None
    )
    return Translation(
        texts=tuple(i.texts[0] for i in items),
        alternatives=tuple(tuple(i.texts[1:]) for i in items) if query.alternatives else None,
        details=details,
        detected=found,
    )


def query_legs(route: Sequence[TranslationService], query: Query, state: AppState, deadline: float) -> Legs:
    """The models of a route (one, or two via English) with the request's options for each (the
    alternatives come from the last; none for HTML), within this server's limits (400)."""
    settings = state.settings
    n_best = 1 if query.html else query.alternatives + 1
    last = len(route) - 1
    options = tuple(
        limited_options(
            leg,
            settings,
            query.beam_size,
            n_best if number == last else 1,
            query.max_length if number == last else None,
            query.repetition,
        )
        for number, leg in enumerate(route)
    )
    return Legs(tuple(route), options, deadline)


async def translate_pages(texts: list[str], groups: dict[str, list[int]], legs: dict[str, Legs]) -> list[str]:
    """HTML texts through ``app.formats.html``, each source language's through its legs, in order."""
    work = [html.translate_html([texts[i] for i in positions], legs[source]) for source, positions in groups.items()]
    translated: list[str] = [""] * len(texts)
    for positions, results in zip(groups.values(), await all_of(work), strict=True):
        for i, text in zip(positions, results, strict=True):
            translated[i] = text
    return translated


def item_detail(legs: Sequence[TranslationService], item: ItemResult) -> ItemDetail:
    """Details of the last leg's translation; ``models`` names every model that ran."""
    tokenizer = legs[-1].translator.tokenizer
    sentences: list[SentenceDetail] = []
    for s in item.sentences:
        best = s.hypotheses[0]
        sentences.append(
            SentenceDetail(
                source=s.source,
                translation=tokenizer.decode([best.ids])[0],
                source_tokens=tuple(tokenizer.source_pieces(s.source_ids)),
                target_tokens=tuple(tokenizer.pieces(best.ids)),
                score=round(best.score, 4),
                confidence=best.confidence,
                truncated=not best.finished,
                cached=s.cached,
            )
        )
    return ItemDetail(
        tokens=tuple(t for s in sentences for t in s.target_tokens),
        score=round(sum(s.score for s in sentences) / len(sentences), 4),
        confidence=min(s.confidence for s in sentences),
        source_token_count=sum(len(s.source_tokens) for s in sentences),
        target_token_count=sum(len(s.target_tokens) for s in sentences),
        truncated=any(s.truncated for s in sentences),
        sentences=tuple(sentences),
        timings=Timings(queue_ms=round(item.queue_ms, 2), total_ms=round(item.total_ms, 2)),
        models=tuple(leg.direction for leg in legs),
    )


@dataclass(frozen=True)
class Upload:
    """A document to translate, as the client sent it (the HTTP edge reads the upload)."""

    filename: str
    data: bytes
    source: str  # a language code, or "auto": detected from the document's text
    target: str
    char_limit: int  # the client's (0: none)


async def translate_document(upload: Upload, state: AppState, watch: Watch) -> TranslatedDocument:
    """The document checked and parsed (``app.formats.documents``; 400 with its error type), its
    text counted against the client's limits and the queue, translated through the legs of its
    route, and kept in memory (``state.files``) under a random name."""
    settings = state.settings
    route = state.route(upload.source, upload.target) if upload.source != "auto" else None  # (503 while loading, 400)
    state.require_ready()
    timing.parsed()
    try:
        document = await asyncio.to_thread(documents.parse, upload.filename, upload.data)
    except documents.DocumentError as err:
        raise ApiError(400, err.error_type, str(err)) from None
    check_characters(document.texts, upload.char_limit)
    count = await asyncio.to_thread(documents.sentence_count, document.texts)  # (megabytes of text)
    if not count:
        raise ApiError(400, "empty_document", "file: no text to translate")
    detected = state.detect_source(" ".join(document.texts)[:DETECT_CHARS]) if route is None else None
    route = route or state.route(detected.language if detected else upload.source, upload.target)
    options = tuple(limited_options(leg, settings, None, 1, None) for leg in route)
    legs = Legs(tuple(route), options, time.monotonic() + settings.request_timeout_s)
    for service in legs.services:  # more sentences than the queue holds: 413 (or 429 while busy)
        service.scheduler.check_room(count)
    try:
        data = await watch(document.translate(legs))
    except documents.DocumentError as err:  # (a part that cannot be written back)
        raise ApiError(400, err.error_type, str(err)) from None
    fmt = document.format
    try:
        name = await state.files.put(safe_filename(upload.filename, fmt.suffix), fmt.media_type, data, fmt.suffix)
    except ValueError as err:
        raise ApiError(413, "file_too_large", f"the translation is too large to keep: {err}") from None
    return TranslatedDocument(name, detected)


def check_characters(texts: Sequence[str], limit: int) -> None:
    """A document's text counts against the client's character limit as /translate's texts do."""
    total = sum(len(text) for text in texts)
    if limit and total > limit:
        raise ApiError(BAD_REQUEST, "too_many_characters", f"file: {total} characters of text; at most {limit}")


_UNSAFE = re.compile(r"[^\w .()+-]+")


def safe_filename(given: str, suffix: str) -> str:
    """The client's file name as a download's name: no folders, no characters a header or a
    file system could misread, at most 100 characters, the format's suffix."""
    base = unicodedata.normalize("NFC", given.replace("\\", "/").rsplit("/", 1)[-1])
    stem = base[: -len(suffix)] if base.lower().endswith(suffix) else base
    stem = _UNSAFE.sub("_", stem).strip(" ._")[:100].rstrip(" ._")
    return f"{stem or 'document'}{suffix}"
