"""PowerPoint presentations (.pptx) through python-pptx: each slide's text and its speaker notes
translated, every shape, picture, layout and animation kept.

- The package is checked before it is opened (``archives.check_zip``: it must hold
  ``ppt/presentation.xml``), then python-pptx opens it (which refuses any other package) and the
  slides are counted against the page limit.
- A DrawingML paragraph (``a:p``) is a block of runs (``app.formats.markup``), as a .docx
  paragraph is (``app.formats.wordruns``): each run's formatting (``a:rPr``: font, size, bold,
  colour, its hyperlink) is a mark, except the paragraph's most used one, which text without a
  mark gets; a stretch of runs in one formatting is one mark. Line breaks (``a:br``) and fields
  (``a:fld``: a slide number, a date) are atoms, kept as they are; the paragraph's properties
  (``a:pPr``) and its end-of-paragraph formatting (``a:endParaRPr``) stay where they are.
- Which paragraphs: those of every slide's shapes (text boxes, placeholders, tables, groups)
  and of its notes page; not the layouts' and masters' (their text is prompts a reader of
  the slides never sees), nor charts' and diagrams' own parts.
"""

from __future__ import annotations

import asyncio
import copy
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pptx
from lxml import etree

from app.formats.archives import MAX_PAGES, DocumentError, Format, ZipLimits, check_zip, open_zip
from app.formats.markup import Block, Engine, Run, has_words, plain, translate_blocks

log = logging.getLogger(__name__)

A = "{http://schemas.openxmlformats.org/drawingml/2006/main}"
P = "{http://schemas.openxmlformats.org/presentationml/2006/main}"
KEPT = frozenset([A + "pPr", A + "endParaRPr"])  # a paragraph's properties, not its content
ATOM_TEXT = {A + "br": "\n"}
REQUIRED = ("[Content_Types].xml", "ppt/presentation.xml")


@dataclass(frozen=True)
class _Paragraph:
    element: etree._Element
    base: etree._Element | None  # the formatting of most of its text (None: none given)
    block: Block


@dataclass
class _Table:
    """The run formattings (marks) and atoms the paragraphs of one presentation refer to."""

    marks: list[etree._Element | None] = field(default_factory=list)
    atoms: list[etree._Element] = field(default_factory=list)

    def paragraph(self, p: etree._Element) -> _Paragraph:
        items: list[tuple[str, bytes | None, etree._Element | None, etree._Element | None]] = []
        for child in p:  # (text, formatting key or None for an atom, formatting, atom)
            if child.tag in KEPT or not isinstance(child.tag, str):
                continue
            if child.tag == A + "r":
                rpr = child.find(A + "rPr")
                text = "".join(t.text or "" for t in child.iter(A + "t"))
                items.append((text, etree.tostring(rpr) if rpr is not None else b"", rpr, None))
            else:
                items.append((ATOM_TEXT.get(child.tag, ""), None, None, child))
        weight: dict[bytes, int] = {}
        for text, key, _, _ in items:
            if key is not None:
                weight[key] = weight.get(key, 0) + len(text)
        base = max(weight, key=weight.__getitem__, default=b"")
        runs: list[Run] = []
        last: bytes | None = None  # the formatting of the open mark
        for text, key, rpr, atom in items:
            if atom is not None:
                self.atoms.append(atom)
                runs.append(Run(text, (), atom=len(self.atoms) - 1))
            elif key == base:
                runs.append(Run(text))
                last = None
            else:
                if key != last:
                    self.marks.append(rpr)
                    last = key
                runs.append(Run(text, (len(self.marks) - 1,)))
        base_rpr = next((rpr for _, key, rpr, _ in items if key == base), None)
        return _Paragraph(p, base_rpr, tuple(r for r in runs if r.text or r.atom is not None))

    def rebuild(self, paragraph: _Paragraph, block: Block) -> None:
        """The paragraph's runs, breaks and fields replaced by the translated ones, between its
        ``a:pPr`` and its ``a:endParaRPr``."""
        p = paragraph.element
        for child in list(p):
            if child.tag not in KEPT:
                p.remove(child)
        end = p.find(A + "endParaRPr")
        at = p.index(end) if end is not None else len(p)
        for run in block:
            if run.atom is not None:
                element = self.atoms[run.atom]
                element.tail = None
            elif run.text:
                element = etree.SubElement(p, A + "r")  # (the parent's "a" prefix; moved below)
                rpr = self.marks[run.marks[-1]] if run.marks else paragraph.base
                if rpr is not None:
                    element.append(copy.deepcopy(rpr))
                etree.SubElement(element, A + "t").text = run.text
            else:
                continue
            p.insert(at, element)
            at += 1


@dataclass
class Presentation:
    presentation: Any  # pptx.presentation.Presentation
    paragraphs: list[_Paragraph]
    table: _Table
    format: Format

    @classmethod
    def parse(cls, data: bytes, fmt: Format, limits: ZipLimits, max_pages: int = MAX_PAGES) -> Presentation:
        check_zip(data, limits, fmt.suffix, REQUIRED)
        open_zip(data, fmt.suffix).close()
        try:
            presentation = pptx.Presentation(io.BytesIO(data))
            slides = list(presentation.slides)
        except Exception as err:  # python-pptx raises many kinds for a damaged package
            log.info("python-pptx refused a .pptx: %r", err)
            raise DocumentError("invalid_file_content", "not a valid .pptx file") from None
        if len(slides) > max_pages:
            raise DocumentError("unsafe_file", f"{len(slides)} slides; at most {max_pages}")
        table = _Table()
        found: list[_Paragraph] = []
        for slide in slides:
            trees = [slide.part._element]
            if slide.has_notes_slide:
                trees.append(slide.notes_slide.part._element)
            for tree in trees:
                for p in list(tree.iter(A + "p")):
                    paragraph = table.paragraph(p)
                    if has_words(paragraph.block):
                        found.append(paragraph)
        return cls(presentation, found, table, fmt)

    @property
    def texts(self) -> Sequence[str]:
        return [plain(p.block) for p in self.paragraphs]

    async def translate(self, engine: Engine) -> bytes:
        blocks = await translate_blocks(engine, [p.block for p in self.paragraphs])
        return await asyncio.to_thread(self._rebuilt, blocks)

    def _rebuilt(self, blocks: Sequence[Block]) -> bytes:
        for paragraph, block in zip(self.paragraphs, blocks, strict=True):
            self.table.rebuild(paragraph, block)
        out = io.BytesIO()
        self.presentation.save(out)
        return out.getvalue()
