"""Documents through the translator (``POST /translate_file``): a file is checked against its
format (its content, not only its name), its text extracted, translated and put back in the
same structure. No I/O: bytes in, bytes out; the translator is an ``app.formats.markup.Engine``.

- ``.txt``: UTF-8 (a BOM kept); the whole text is one text to the translator, whose
  segmentation keeps every line break and blank line.
- ``.html``/``.htm``: UTF-8; ``app.formats.html`` translates the text and keeps the markup.
- ``.srt``: UTF-8, parsed by ``srt``; indices and timings kept, each subtitle's lines
  translated as one text and wrapped back to as many lines (at word boundaries).
- ``.docx``: a zip checked before anything opens it (``check_zip``: entries, total size,
  compression ratio), then python-docx; every paragraph of the body (tables, text boxes),
  the headers and the footers is a block of runs (``app.formats.wordruns``: the runs' formatting,
  hyperlinks, breaks, images and fields kept), all translated together.
- ``.odt``, ``.odp``: ``app.formats.opendocument`` (paragraphs and their spans, slides, notes).
- ``.pptx``: ``app.formats.slides`` (python-pptx: each slide's shapes and its notes).
- ``.epub``: ``app.formats.epub`` (chapters as XHTML, the table of contents, the title).
- ``.pdf``: ``app.formats.pdf`` (each page's text blocks, translated where they stand).

Every container (.docx, .odt, .odp, .pptx, .epub) is checked before it is opened
(``archives.check_zip``), a PDF's streams before it is parsed (``pdf.check_pdf``); pages,
slides and chapters are counted against ``MAX_PAGES``.
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import docx
import srt
from docx.document import Document as DocxDocument
from docx.opc.constants import CONTENT_TYPE as CT
from docx.opc.part import XmlPart

from app.formats import html
from app.formats.archives import MAX_PAGES, DocumentError, Format, ZipLimits, check_zip
from app.formats.epub import Book
from app.formats.markup import Block, Engine, has_text, translate_blocks
from app.formats.opendocument import OpenDocument
from app.formats.segmentation import segment, sentences
from app.formats.wordruns import Paragraph, RunTable, W

__all__ = [
    "FORMATS",
    "MAX_PAGES",
    "Document",
    "DocumentError",
    "Format",
    "ZipLimits",
    "check_zip",
    "format_of",
    "parse",
]

log = logging.getLogger(__name__)


FORMATS = {
    ".txt": Format(".txt", "text/plain; charset=utf-8"),
    ".html": Format(".html", "text/html; charset=utf-8"),
    ".htm": Format(".htm", "text/html; charset=utf-8"),
    ".srt": Format(".srt", "application/x-subrip; charset=utf-8"),
    ".docx": Format(".docx", "application/vnd.openxmlformats-officedocument.wordprocessingml.document"),
    ".odt": Format(".odt", "application/vnd.oasis.opendocument.text"),
    ".odp": Format(".odp", "application/vnd.oasis.opendocument.presentation"),
    ".pptx": Format(".pptx", "application/vnd.openxmlformats-officedocument.presentationml.presentation"),
    ".epub": Format(".epub", "application/epub+zip"),
    ".pdf": Format(".pdf", "application/pdf"),
}


class Document(Protocol):
    """A parsed, checked file: its text (for limits and language detection), and itself
    translated (once: a .docx is rebuilt in place)."""

    @property
    def format(self) -> Format: ...

    @property
    def texts(self) -> Sequence[str]: ...

    async def translate(self, engine: Engine) -> bytes: ...


def format_of(filename: str) -> Format:
    """The format a file name's extension names (case-insensitive), or ``DocumentError``."""
    base = filename.replace("\\", "/").rsplit("/", 1)[-1]
    suffix = "." + base.rsplit(".", 1)[-1].lower() if "." in base else ""
    found = FORMATS.get(suffix)
    if found is None:
        raise DocumentError(
            "unsupported_file_format", f"{suffix or 'no extension'}: files must be one of {', '.join(FORMATS)}"
        )
    return found


def parse(filename: str, data: bytes, zip_limits: ZipLimits | None = None, max_pages: int = MAX_PAGES) -> Document:
    """The file as a document of the format its name says, its content checked against it
    (containers within ``zip_limits``, at most ``max_pages`` pages, slides or chapters)."""
    fmt = format_of(filename)
    limits = zip_limits or ZipLimits()
    if fmt.suffix == ".docx":
        return WordDocument.parse(data, limits)
    if fmt.suffix in (".odt", ".odp"):
        return OpenDocument.parse(data, fmt, limits, max_pages)
    # the PDF and PowerPoint modules load their libraries at first use: importing them slowed
    # every start and held their memory in a server that may never see such a file
    # (docs/testing.md#suite-time)
    if fmt.suffix == ".pptx":
        from app.formats.slides import Presentation

        return Presentation.parse(data, fmt, limits, max_pages)
    if fmt.suffix == ".epub":
        return Book.parse(data, fmt, limits, max_pages)
    if fmt.suffix == ".pdf":
        from app.formats.pdf import PdfDocument

        return PdfDocument.parse(data, fmt, limits, max_pages)
    text, bom = decode(data, fmt.suffix)
    if fmt.suffix == ".srt":
        return SubtitleDocument.parse(text, bom)
    if fmt.suffix == ".txt":
        return TextDocument(fmt, text, bom)
    return HtmlDocument(fmt, text, bom, html.visible_text(text))


def sentence_count(texts: Sequence[str]) -> int:
    """Sentences the texts hold (what the scheduler's queue is checked against)."""
    return sum(len(sentences(segment(text))) for text in texts)


BOM = "\ufeff"


def decode(data: bytes, suffix: str) -> tuple[str, bool]:
    """UTF-8 text (a BOM allowed) without NUL characters; (text without BOM, had a BOM)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DocumentError(
            "invalid_file_content", f"a {suffix} file must be UTF-8 text; byte {err.start} is not"
        ) from None
    if "\x00" in text:
        raise DocumentError("invalid_file_content", f"a {suffix} file must be text; this one holds NUL bytes")
    return (text[1:], True) if text.startswith(BOM) else (text, False)


def encode(text: str, bom: bool) -> bytes:
    return ((BOM if bom else "") + text).encode("utf-8")


@dataclass(frozen=True)
class TextDocument:
    format: Format
    text: str
    bom: bool

    @property
    def texts(self) -> Sequence[str]:
        return (self.text,)

    async def translate(self, engine: Engine) -> bytes:
        done = (await engine.texts([self.text]))[0] if self.text.strip() else self.text
        return encode(done, self.bom)


@dataclass(frozen=True)
class HtmlDocument:
    format: Format
    text: str
    bom: bool
    visible: str  # what a reader sees (``html.visible_text``)

    @property
    def texts(self) -> Sequence[str]:
        return (self.visible,)

    async def translate(self, engine: Engine) -> bytes:
        return encode((await html.translate_html([self.text], engine))[0], self.bom)


@dataclass(frozen=True)
class SubtitleDocument:
    subtitles: tuple[srt.Subtitle, ...]
    bom: bool
    eol: str
    format: Format = FORMATS[".srt"]

    @classmethod
    def parse(cls, text: str, bom: bool) -> SubtitleDocument:
        try:
            subtitles = tuple(srt.parse(text))
        except srt.SRTParseError as err:
            raise DocumentError("invalid_file_content", f"not a valid .srt file: {err}") from None
        return cls(subtitles, bom, "\r\n" if "\r\n" in text else "\n")

    @property
    def texts(self) -> Sequence[str]:
        return [_one_line(s.content) for s in self.subtitles if _translatable(s.content)]

    async def translate(self, engine: Engine) -> bytes:
        chosen = [s for s in self.subtitles if _translatable(s.content)]
        done = await engine.texts([_one_line(s.content) for s in chosen])
        lines = {
            id(s): "\n".join(wrap(text, len(s.content.splitlines()))) for s, text in zip(chosen, done, strict=True)
        }
        out = [
            srt.Subtitle(s.index, s.start, s.end, lines.get(id(s), s.content), s.proprietary) for s in self.subtitles
        ]
        return encode(srt.compose(out, reindex=False, eol=self.eol), self.bom)


def _one_line(content: str) -> str:
    return " ".join(line.strip() for line in content.splitlines() if line.strip())


def _translatable(content: str) -> bool:
    return any(c.isalnum() for c in content)


def wrap(text: str, lines: int) -> list[str]:
    """``text`` in at most ``lines`` lines of about equal length, broken between words."""
    words = text.split()
    out: list[str] = []
    for left in range(min(lines, len(words)), 1, -1):
        goal = len(" ".join(words)) / left
        take, length = 1, len(words[0])
        while take <= len(words) - left and abs(length + 1 + len(words[take]) - goal) < abs(length - goal):
            length += 1 + len(words[take])
            take += 1
        out.append(" ".join(words[:take]))
        words = words[take:]
    return [*out, " ".join(words)] if words else out or [""]


# --- .docx --------------------------------------------------------------------------------
PARTS = frozenset([CT.WML_DOCUMENT_MAIN, CT.WML_HEADER, CT.WML_FOOTER])  # where paragraphs are translated


@dataclass(frozen=True)
class WordDocument:
    document: DocxDocument
    paragraphs: tuple[Paragraph, ...]
    runs: RunTable
    format: Format = FORMATS[".docx"]

    @classmethod
    def parse(cls, data: bytes, limits: ZipLimits) -> WordDocument:
        check_zip(data, limits)
        try:
            document = docx.Document(io.BytesIO(data))
        except Exception as err:  # python-docx raises many kinds for a damaged package
            log.info("python-docx refused a .docx: %r", err)
            raise DocumentError("invalid_file_content", "not a valid .docx file") from None
        runs = RunTable()
        found: list[Paragraph] = []
        for part in document.part.package.iter_parts():
            if isinstance(part, XmlPart) and part.content_type in PARTS:
                found.extend(runs.paragraph(p) for p in list(part.element.iter(W + "p")))
        return cls(document, tuple(p for p in found if has_text(p.block)), runs)

    @property
    def texts(self) -> Sequence[str]:
        return ["".join(r.text for r in p.block) for p in self.paragraphs]

    async def translate(self, engine: Engine) -> bytes:
        blocks = await translate_blocks(engine, [p.block for p in self.paragraphs])
        return await asyncio.to_thread(self._rebuilt, blocks)

    def _rebuilt(self, blocks: Sequence[Block]) -> bytes:
        for paragraph, block in zip(self.paragraphs, blocks, strict=True):
            self.runs.rebuild(paragraph, block)
        out = io.BytesIO()
        self.document.save(out)
        return out.getvalue()
