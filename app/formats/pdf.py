"""PDF documents: every page kept (its size, images, drawings, links, bookmarks), its text found
in blocks where it stands, each block translated and written back at its place.

- Before a library parses anything (``check_pdf``): the file must start as a PDF does; every
  compressed stream but an image's (images are never decoded here) is inflated once, capped,
  and refused past the zip containers' limits (``ZipLimits``: its ratio, all streams' total),
  wherever its dictionary says nothing of its filter; LZW and run-length streams, which the
  readers below would inflate unbounded, are refused. An encrypted PDF is refused.
- pypdf (BSD-3-Clause) reads the document and counts its pages against the page limit;
  pdfminer.six (MIT) lays out each page's characters into text blocks (``LTTextBox``: its lines,
  their baselines, each character's font, size and colour), the page's rotation aside so the
  blocks are in the page's own coordinates.
- A block is a paragraph (``_paragraphs``: pdfminer's boxes split where a line's size or weight
  changes, where the gap above it is wider than the box's line pitch, at an indented or
  bulleted line, after a line that ends a sentence short of the right edge), one text to the
  translator (its lines joined, a word hyphenated across a line break joined again); a block
  without letters (a page number) is written back as it was.
- Writing: the text-showing operators (``Tj``, ``TJ``, ``'``, ``"``) are taken out of every
  page's content and the forms it draws (everything else, the text state and colours
  included, stays), and each block's translation is drawn by ReportLab (BSD) on a layer merged
  onto its page by pypdf: from the block's first baseline and left edge, wrapped at the block
  beside it or the page's right margin, at its font size and line pitch (smaller, down to a
  floor, where the translation would not fit the block's height), in its colour, bold and
  italic as most of its characters were.
  The font is DejaVu Sans where the system has it (Debian's fonts-dejavu-core), else
  ReportLab's bundled Bitstream Vera Sans; both are embedded (subset) in the result.

What is not kept: the original fonts (a serif text comes back sans), text alignment other
than left, rotated or vertical text (drawn upright), a block's mixed formatting (it takes
its most used), form fields' and annotations' text, and the outline's titles (untranslated).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
import re
import statistics
import unicodedata
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import reportlab
from pdfminer.converter import PDFPageAggregator
from pdfminer.layout import LAParams, LTChar, LTTextBox
from pdfminer.pdfdocument import PDFDocument
from pdfminer.pdfinterp import PDFPageInterpreter, PDFResourceManager
from pdfminer.pdfpage import PDFPage
from pdfminer.pdfparser import PDFParser
from pypdf import PdfReader, PdfWriter, Transformation
from pypdf.generic import ContentStream, NameObject
from reportlab.pdfbase import pdfmetrics
from reportlab.pdfbase.ttfonts import TTFont
from reportlab.pdfgen import canvas

from app.formats.archives import MAX_PAGES, DocumentError, Format, ZipLimits
from app.formats.markup import Engine

log = logging.getLogger(__name__)

SHOWING = frozenset([b"Tj", b"TJ", b"'", b'"'])  # the operators that draw text
UNBOUNDED_FILTERS = re.compile(rb"/(LZWDecode|LZW|RunLengthDecode|RL)\b")
_STREAM = re.compile(rb"stream(?:\r\n|\n|\r)")
_IMAGE = re.compile(rb"/Subtype\s*/Image\b")
_LIGATURES = str.maketrans({chr(c): unicodedata.normalize("NFKC", chr(c)) for c in range(0xFB00, 0xFB07)})
MIN_SIZE = 4.0  # points: the smallest font a translation is shrunk to
CHUNK = 64 * 1024


def check_pdf(data: bytes, limits: ZipLimits) -> None:
    """A PDF, not encrypted, whose streams inflate within ``limits`` (module docstring)."""
    if not data[:1024].lstrip(b"\x00\t\n\f\r ").startswith(b"%PDF-"):
        raise DocumentError("invalid_file_content", "not a .pdf file: it does not start with %PDF-")
    if UNBOUNDED_FILTERS.search(data):
        raise DocumentError("unsafe_file", "the PDF holds LZW or run-length compressed streams; only Flate is taken")
    total = 0
    for match in _STREAM.finditer(data):
        head = data[max(0, match.start() - 2048) : match.start()]
        head = head[head.rfind(b"obj") + 1 :]  # the stream's own dictionary (as far as it goes back)
        if _IMAGE.search(head):
            continue
        inflated, used = _inflated_size(data, match.end(), limits.total_bytes - total)
        total += inflated
        if total > limits.total_bytes:
            raise DocumentError("unsafe_file", f"the PDF's streams inflate to over {limits.total_bytes} bytes")
        if inflated > limits.ratio_from and inflated > limits.ratio * max(used, 1):
            raise DocumentError(
                "unsafe_file", f"a stream is compressed {inflated // max(used, 1)}:1; at most {limits.ratio:g}:1"
            )


def _inflated_size(data: bytes, start: int, budget: int) -> tuple[int, int]:
    """(bytes the zlib stream at ``start`` inflates to, at most ``budget`` + 1; bytes it used),
    (0, 0) where no zlib stream starts there."""
    inflate = zlib.decompressobj()
    view = memoryview(data)
    out = used = 0
    position = start
    try:
        while position < len(data) and not inflate.eof and out <= budget:
            chunk = view[position : position + CHUNK]
            position += len(chunk)
            out += len(inflate.decompress(chunk, budget + 1 - out))
            while inflate.unconsumed_tail and out <= budget:
                out += len(inflate.decompress(inflate.unconsumed_tail, budget + 1 - out))
    except zlib.error:
        if not out:
            return 0, 0
    used = position - start - len(inflate.unused_data) - len(inflate.unconsumed_tail)
    return out, used


@dataclass(frozen=True)
class Block:
    """A text block of a page, in the page's coordinates (from its media box's corner)."""

    page: int
    x0: float
    y0: float
    x1: float
    y1: float
    baseline: float  # the first line's
    text: str
    size: float
    leading: float  # from one baseline to the next
    lines: int
    bold: bool
    italic: bool
    color: tuple[float, float, float]

    @property
    def translatable(self) -> bool:
        return any(c.isalpha() for c in self.text)


@dataclass
class PdfDocument:
    reader: Any  # pypdf.PdfReader
    blocks: list[Block]
    format: Format

    @classmethod
    def parse(cls, data: bytes, fmt: Format, limits: ZipLimits, max_pages: int = MAX_PAGES) -> PdfDocument:
        check_pdf(data, limits)
        try:
            reader = PdfReader(io.BytesIO(data))
            encrypted = reader.is_encrypted
            pages = len(reader.pages) if not encrypted else 0
        except Exception as err:  # pypdf raises many kinds for a damaged file
            log.info("pypdf refused a .pdf: %r", err)
            raise DocumentError("invalid_file_content", "not a valid .pdf file") from None
        if encrypted:
            raise DocumentError("invalid_file_content", "the PDF is encrypted")
        if pages > max_pages:
            raise DocumentError("unsafe_file", f"{pages} pages; at most {max_pages}")
        if not pages:
            raise DocumentError("invalid_file_content", "the PDF has no pages")
        try:
            blocks = _blocks(data)
        except DocumentError:
            raise
        except Exception as err:  # pdfminer.six, likewise
            log.info("pdfminer.six refused a .pdf: %r", err)
            raise DocumentError("invalid_file_content", "not a valid .pdf file") from None
        return cls(reader, blocks, fmt)

    @property
    def texts(self) -> Sequence[str]:
        return [b.text for b in self.blocks if b.translatable]

    async def translate(self, engine: Engine) -> bytes:
        chosen = [b for b in self.blocks if b.translatable]
        done = dict(zip(map(id, chosen), await engine.texts([b.text for b in chosen]), strict=True))
        texts = [done.get(id(b), b.text) for b in self.blocks]
        return await asyncio.to_thread(self._rebuilt, texts)

    def _rebuilt(self, texts: Sequence[str]) -> bytes:
        try:
            return _write(self.reader, self.blocks, texts)
        except DocumentError:
            raise
        except Exception as err:
            log.info("a .pdf could not be written back: %r", err)
            raise DocumentError("invalid_file_content", "the PDF could not be written back") from None


# --- reading ------------------------------------------------------------------------------


def _blocks(data: bytes) -> list[Block]:
    document = PDFDocument(PDFParser(io.BytesIO(data)))
    resources = PDFResourceManager(caching=True)
    device = PDFPageAggregator(resources, laparams=LAParams(all_texts=True))
    interpreter = PDFPageInterpreter(resources, device)
    found: list[Block] = []
    for number, page in enumerate(PDFPage.create_pages(document)):
        page.rotate = 0  # the page's own coordinates: its /Rotate stays, and turns the new text with it
        interpreter.process_page(page)
        boxes: list[Any] = []
        stack = list(device.get_result())
        while stack:
            item = stack.pop()
            if isinstance(item, LTTextBox):
                boxes.append(item)
            elif hasattr(item, "__iter__"):
                stack.extend(item)
        boxes.sort(key=lambda box: (-box.y1, box.x0))
        for box in boxes:
            lines = [_Line.of(line) for line in box]
            for paragraph in _paragraphs([line for line in lines if line is not None], box.x1):
                found.append(_block(number, paragraph, box.x1))
    return found


@dataclass(frozen=True)
class _Line:
    """A line of a pdfminer text box: its text, characters, left and right edges, baseline."""

    text: str
    chars: tuple[Any, ...]
    x0: float
    x1: float
    y0: float
    y1: float
    baseline: float
    size: float
    bold: bool

    @classmethod
    def of(cls, line: Any) -> _Line | None:
        chars = tuple(c for c in line if isinstance(c, LTChar) and c.get_text().strip())
        if not chars or not hasattr(line, "get_text"):
            return None
        return cls(
            text=line.get_text(),
            chars=chars,
            x0=line.x0,
            x1=line.x1,
            y0=line.y0,
            y1=line.y1,
            baseline=chars[0].matrix[5],
            size=statistics.median(c.size for c in chars),
            bold=_most(chars, lambda c: _style(c.fontname, BOLD)),
        )


BOLD = ("bold", "black", "heavy", "semibold")
ITALIC = ("italic", "oblique")
ENDS = tuple(".!?:;\"'»«”“)")
BULLETS = tuple("•‣◦▪–-*·")


def _paragraphs(lines: Sequence[_Line], right: float) -> list[list[_Line]]:
    """A pdfminer box's lines as paragraphs: pdfminer groups lines that are close, which in a
    page without paragraph spacing is every line of a column. A line starts a paragraph where
    its size or weight changes, where the gap above it is wider than the box's line pitch,
    where it is indented past the line above or starts with a bullet, or where the line above
    ended a sentence well short of the column's right edge."""
    if not lines:
        return []
    steps = [a.baseline - b.baseline for a, b in itertools.pairwise(lines) if a.baseline - b.baseline > 0.5 * b.size]
    pitch = min(steps) if steps else None
    left = min(line.x0 for line in lines)
    out = [[lines[0]]]
    for above, line in itertools.pairwise(lines):
        first = line.text.lstrip()[:1]
        starts = (
            abs(line.size - above.size) > 0.15 * above.size
            or line.bold != above.bold
            or (pitch is not None and above.baseline - line.baseline > 1.3 * pitch)
            or line.x0 > above.x0 + 0.8 * line.size
            or first in BULLETS
            or unicodedata.category(first or " ") == "Co"
            or (above.text.rstrip().endswith(ENDS) and above.x1 < right - 0.15 * (right - left))
        )
        if starts:
            out.append([line])
        else:
            out[-1].append(line)
    return out


def _block(page: int, lines: Sequence[_Line], right: float) -> Block:
    chars = [c for line in lines for c in line.chars]
    steps = [a.baseline - b.baseline for a, b in itertools.pairwise(lines) if a.baseline > b.baseline]
    size = statistics.median(c.size for c in chars)
    return Block(
        page=page,
        x0=min(line.x0 for line in lines),
        y0=min(line.y0 for line in lines),
        x1=max(right, *(line.x1 for line in lines)),
        y1=max(line.y1 for line in lines),
        baseline=lines[0].baseline,
        text=_joined([line.text for line in lines]),
        size=size,
        leading=statistics.median(steps) if steps else size * 1.2,
        lines=len(lines),
        bold=_most(chars, lambda c: _style(c.fontname, BOLD)),
        italic=_most(chars, lambda c: _style(c.fontname, ITALIC)),
        color=_color(chars[0]),
    )


def _joined(lines: Sequence[str]) -> str:
    """A block's lines as one text: a word hyphenated at a line's end joined again."""
    out = ""
    for line in (" ".join(_readable(line).split()) for line in lines):
        if not line:
            continue
        if out.endswith("-") and len(out) > 1 and out[-2].isalpha() and line[:1].islower():
            out = out[:-1] + line
        else:
            out = f"{out} {line}" if out else line
    return out


def _readable(text: str) -> str:
    """Ligatures as their letters; a private-use character (a symbol font's bullet) as a bullet."""
    text = text.translate(_LIGATURES)
    return "".join("•" if unicodedata.category(c) == "Co" else c for c in text)


def _style(fontname: str, words: Sequence[str]) -> bool:
    name = fontname.split("+", 1)[-1].lower()  # (a subset's prefix "ABCDEF+")
    return any(word in name for word in words)


def _most(chars: Sequence[Any], test: Any) -> bool:
    return sum(1 for c in chars if test(c)) * 2 > len(chars)


def _color(char: Any) -> tuple[float, float, float]:
    """The character's fill colour as RGB (gray, RGB and CMYK; black for any other)."""
    color = getattr(char.graphicstate, "ncolor", None)
    values = color if isinstance(color, (tuple, list)) else (color,)
    if not all(isinstance(v, (int, float)) for v in values):
        return (0.0, 0.0, 0.0)
    v = [min(max(float(x), 0.0), 1.0) for x in values]
    if len(v) == 1:
        return (v[0], v[0], v[0])
    if len(v) == 3:
        return (v[0], v[1], v[2])
    if len(v) == 4:
        c, m, y, k = v
        return ((1 - c) * (1 - k), (1 - m) * (1 - k), (1 - y) * (1 - k))
    return (0.0, 0.0, 0.0)


# --- writing ------------------------------------------------------------------------------

SYSTEM_FONTS = Path("/usr/share/fonts/truetype/dejavu")
FONT_FILES = {  # (bold, italic) -> (DejaVu's file, ReportLab's Vera)
    (False, False): ("DejaVuSans.ttf", "Vera.ttf"),
    (True, False): ("DejaVuSans-Bold.ttf", "VeraBd.ttf"),
    (False, True): ("DejaVuSans-Oblique.ttf", "VeraIt.ttf"),
    (True, True): ("DejaVuSans-BoldOblique.ttf", "VeraBI.ttf"),
}
_fonts: dict[tuple[bool, bool], str] = {}


def _font(bold: bool, italic: bool) -> str:
    """The registered name of the font for this style (registered once)."""
    name = _fonts.get((bold, italic))
    if name is None:
        system, bundled = FONT_FILES[(bold, italic)]
        path = SYSTEM_FONTS / system
        if not path.is_file():
            path = Path(reportlab.__file__).parent / "fonts" / bundled
        name = f"translator-{path.stem}"
        pdfmetrics.registerFont(TTFont(name, str(path)))
        _fonts[(bold, italic)] = name
    return name


def _wrapped(text: str, font: str, size: float, width: float) -> list[str]:
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split():
            candidate = f"{line} {word}" if line else word
            if line and pdfmetrics.stringWidth(candidate, font, size) > width:
                lines.append(line)
                line = word
            else:
                line = candidate
        lines.append(line)
    return lines


def _right_edge(block: Block, others: Sequence[Block], page_width: float) -> float:
    """How far right a block's translation may run: to the nearest block beside it on its
    lines, else to the page's right margin (as wide as its left one, the leftmost block's)."""
    margin = min((o.x0 for o in others), default=block.x0)
    edge = max(page_width - margin, block.x1)
    for other in others:
        beside = other.y0 < block.y1 and other.y1 > block.y0 and other.x0 >= block.x1 - 1
        if beside:
            edge = min(edge, max(other.x0 - 0.5 * block.size, block.x1))
    return edge


def _fitted(block: Block, text: str, font: str, right: float) -> tuple[float, float, list[str]]:
    """(size, leading, lines): the block's, shrunk until the text fits between its left edge and
    ``right`` and within its height."""
    size, leading = block.size, block.leading
    width = max(right - block.x0, size) * 1.02
    room = max(block.y1 - block.y0, size) + 0.3 * size  # (a descender's worth of slack)
    while True:
        lines = _wrapped(text, font, size, width)
        if (len(lines) - 1) * leading + size <= room or size <= MIN_SIZE:
            return size, leading, lines
        scale = max(0.9, MIN_SIZE / size)
        size, leading = size * scale, leading * scale


def _write(reader: Any, blocks: Sequence[Block], texts: Sequence[str]) -> bytes:
    writer = PdfWriter(clone_from=reader)
    layer = io.BytesIO()
    drawing = canvas.Canvas(layer)
    on_page: dict[int, list[tuple[Block, str]]] = {}
    for block, text in zip(blocks, texts, strict=True):
        on_page.setdefault(block.page, []).append((block, text))
    for number, page in enumerate(writer.pages):
        _strip_text(page, writer)
        box = page.mediabox
        drawing.setPageSize((float(box.width), float(box.height)))
        here = [block for block, _ in on_page.get(number, [])]
        for block, text in on_page.get(number, []):
            font = _font(block.bold, block.italic)
            right = _right_edge(block, here, float(box.width))
            size, leading, lines = _fitted(block, text, font, right)
            drawing.setFillColorRGB(*block.color)
            drawing.setFont(font, size)
            for n, line in enumerate(lines):
                drawing.drawString(block.x0, block.baseline - n * leading, line)
        drawing.showPage()
    drawing.save()
    layers = PdfReader(io.BytesIO(layer.getvalue()))
    for number, page in enumerate(writer.pages):
        if on_page.get(number):
            box = page.mediabox
            page.merge_transformed_page(layers.pages[number], Transformation().translate(box.left, box.bottom))
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def _strip_text(page: Any, writer: Any) -> None:
    """The text-showing operators out of the page's content and the forms it draws."""
    contents = page.get_contents()
    if contents is not None:
        stream = ContentStream(contents, writer)
        stream.operations = [(operands, op) for operands, op in stream.operations if op not in SHOWING]
        page.replace_contents(stream)
    _strip_forms(page.get("/Resources"), writer, set())


def _strip_forms(resources: Any, writer: Any, seen: set[int]) -> None:
    resources = resources.get_object() if resources is not None else None
    xobjects = resources.get("/XObject") if hasattr(resources, "get") else None
    xobjects = xobjects.get_object() if xobjects is not None else None
    if xobjects is None or not hasattr(xobjects, "values"):
        return
    for ref in xobjects.values():
        form = ref.get_object()
        if id(form) in seen or form.get("/Subtype") != "/Form":
            continue
        seen.add(id(form))
        stream = ContentStream(form, writer)
        stream.operations = [(operands, op) for operands, op in stream.operations if op not in SHOWING]
        data = stream.get_data()
        form.get_data()  # (decoded before its filter changes)
        if "/Filter" in form:
            form[NameObject("/Filter")] = NameObject("/FlateDecode")
            form.pop("/DecodeParms", None)
        form.set_data(data)
        _strip_forms(form.get("/Resources"), writer, seen)
