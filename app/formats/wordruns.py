"""A .docx paragraph (``w:p``) as a block of runs for ``app.formats.markup``, and the translated runs
put back into it (``app.formats.documents`` finds the paragraphs and saves the document).

- Each run's formatting (its ``w:rPr``) is a mark, except the paragraph's most used one,
  which is none: text without a mark gets it. A mark stands for one stretch of runs in the
  same formatting (runs split with identical formatting are one mark, so a sentence in one
  formatting is translated plainly), as an HTML element does: ``app.formats.markup`` places it on
  contiguous words.
- Hyperlinks, tracked insertions, smart tags and simple fields are marks around their runs;
  their element (attributes, properties) is copied around the translated runs they mark.
- Breaks, tabs, drawings, footnote references, bookmarks... are atoms, kept as they are
  (a break stands for a line break in the text, a tab for a space); a complex field
  (``w:fldChar`` begin to end: its code and its shown result) is one atom, so nothing
  moves into it or takes it apart.
- Spelling marks and rendering hints (``w:proofErr``, ``w:lastRenderedPageBreak``) go: they
  describe the old text.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from docx.oxml import OxmlElement
from lxml import etree

from app.formats.markup import Block, Run

W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
XML_SPACE = "{http://www.w3.org/XML/1998/namespace}space"
CONTAINERS = frozenset(W + tag for tag in ("hyperlink", "ins", "smartTag", "customXml", "fldSimple", "moveTo"))
DROPPED = frozenset([W + "proofErr", W + "lastRenderedPageBreak"])
ATOM_TEXT = {W + "br": "\n", W + "cr": "\n", W + "tab": " "}  # what an atom stands for in the text


@dataclass(frozen=True)
class _Mark:
    """A container copied around the runs it marks (a hyperlink...), or a run formatting."""

    container: etree._Element | None = None
    rpr: etree._Element | None = None


@dataclass(frozen=True)
class _Piece:
    """An element an atom puts back: a run's child goes back into a run with its formatting."""

    element: etree._Element
    in_run: bool
    rpr: etree._Element | None = None


@dataclass(frozen=True)
class _Item:
    """A piece of a paragraph before its formatting is a mark: ``run.marks`` are its
    containers; ``key`` its run's formatting as XML (None: not in a run)."""

    run: Run
    piece: _Piece
    key: bytes | None = None


@dataclass(frozen=True)
class Paragraph:
    """A paragraph as runs: ``block`` to translate, with the atoms before and after its text
    (``lead``, ``tail``) kept where they are."""

    element: etree._Element
    base: etree._Element | None  # the formatting of most of its text: what text without a mark gets
    lead: Block
    block: Block
    tail: Block


@dataclass
class RunTable:
    """The marks and atoms the paragraphs of one document refer to."""

    marks: list[_Mark] = field(default_factory=list)
    atoms: list[tuple[_Piece, ...]] = field(default_factory=list)

    def paragraph(self, p: etree._Element) -> Paragraph:
        items = self._fields([i for i in self._walk(p, ()) if i.run.text or i.run.atom is not None])
        weight: dict[bytes, int] = {}
        for i in items:
            if i.key is not None and i.run.atom is None:
                weight[i.key] = weight.get(i.key, 0) + len(i.run.text)
        base = max(weight, key=weight.__getitem__, default=b"")
        runs: list[Run] = []
        stretch: tuple[tuple[int, ...], bytes] | None = None  # (containers, formatting) of the last mark
        for i in items:
            marks = i.run.marks
            if i.key is not None and i.key != base:
                if stretch != (marks, i.key):
                    self.marks.append(_Mark(rpr=i.piece.rpr))
                    stretch = (marks, i.key)
                marks = (*marks, len(self.marks) - 1)
            elif i.key is not None:
                stretch = None
            runs.append(replace(i.run, marks=marks))
        first = next((n for n, r in enumerate(runs) if r.atom is None), len(runs))
        last = max((n for n, r in enumerate(runs) if r.atom is None), default=first - 1)
        rpr = next((i.piece.rpr for i in items if i.key == base), None)
        return Paragraph(p, rpr, tuple(runs[:first]), tuple(runs[first : last + 1]), tuple(runs[last + 1 :]))

    def _atom(self, pieces: tuple[_Piece, ...], marks: tuple[int, ...], text: str = "") -> Run:
        self.atoms.append(pieces)
        return Run(text, marks, atom=len(self.atoms) - 1)

    def _walk(self, parent: etree._Element, marks: tuple[int, ...]) -> list[_Item]:
        out: list[_Item] = []
        for child in parent:
            tag = child.tag
            if not isinstance(tag, str) or tag.endswith("Pr") or tag in DROPPED:
                continue  # (properties stay with their element or container)
            if tag == W + "r":
                out.extend(self._run(child, marks))
            elif tag in CONTAINERS:
                self.marks.append(_Mark(container=child))
                out.extend(self._walk(child, (*marks, len(self.marks) - 1)))
            else:
                piece = _Piece(child, False)
                out.append(_Item(self._atom((piece,), marks), piece))
        return out

    def _run(self, r: etree._Element, marks: tuple[int, ...]) -> list[_Item]:
        rpr = r.find(W + "rPr")
        key = etree.tostring(rpr) if rpr is not None else b""
        out: list[_Item] = []
        for child in r:
            if child is rpr or child.tag in DROPPED:
                continue
            piece = _Piece(child, True, rpr)
            if child.tag == W + "t":
                out.append(_Item(Run(child.text or "", marks), piece, key))
            else:
                out.append(_Item(self._atom((piece,), marks, ATOM_TEXT.get(child.tag, "")), piece, key))
        return out

    def _fields(self, items: list[_Item]) -> list[_Item]:
        """Each complex field's items (begin to end, nested fields inside) as one atom; a field
        going on into the next paragraph to the end of this one."""
        out: list[_Item] = []
        inside: list[_Item] = []
        depth = 0
        for item in items:
            kind = item.piece.element.get(W + "fldCharType") if item.piece.element.tag == W + "fldChar" else None
            depth += kind == "begin"
            if not depth:
                out.append(item)
                continue
            inside.append(item)
            if kind == "end":
                depth -= 1
                if not depth:
                    out.append(self._field(inside))
                    inside = []
        return [*out, self._field(inside)] if inside else out

    def _field(self, items: list[_Item]) -> _Item:
        pieces = tuple(i.piece for i in items)
        return _Item(self._atom(pieces, items[0].run.marks), pieces[0])

    def rebuild(self, paragraph: Paragraph, block: Block) -> None:
        """The paragraph's content (all but its ``w:pPr``) replaced by the runs."""
        p = paragraph.element
        for child in list(p):
            if child.tag != W + "pPr":
                p.remove(child)
        stack: list[tuple[int, etree._Element]] = []  # open containers: (mark, its copy)
        for run in (*paragraph.lead, *block, *paragraph.tail):
            containers = [m for m in run.marks if self.marks[m].container is not None]
            formats = [m for m in run.marks if self.marks[m].container is None]
            common = 0
            while common < min(len(stack), len(containers)) and stack[common][0] == containers[common]:
                common += 1
            del stack[common:]
            for m in containers[common:]:
                stack.append((m, _shallow_copy(self.marks[m].container, stack[-1][1] if stack else p)))
            parent = stack[-1][1] if stack else p
            if run.atom is not None:
                for piece in self.atoms[run.atom]:
                    parent.append(_new_run(piece.rpr, piece.element) if piece.in_run else piece.element)
            elif run.text:
                text = OxmlElement("w:t")
                text.text = run.text
                if run.text != run.text.strip():
                    text.set(XML_SPACE, "preserve")
                parent.append(_new_run(self.marks[formats[-1]].rpr if formats else paragraph.base, text))


def _shallow_copy(container: etree._Element | None, parent: etree._Element) -> etree._Element:
    """The container's element (tag, attributes, properties) under ``parent``, without content."""
    assert container is not None
    copied = etree.SubElement(parent, container.tag, dict(container.attrib))
    copied.extend(copy.deepcopy(c) for c in container if isinstance(c.tag, str) and c.tag.endswith("Pr"))
    return copied


def _new_run(rpr: etree._Element | None, content: etree._Element) -> etree._Element:
    r = OxmlElement("w:r")
    if rpr is not None:
        r.append(copy.deepcopy(rpr))
    r.append(content)
    return r
