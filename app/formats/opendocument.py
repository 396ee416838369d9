"""OpenDocument text (.odt) and presentations (.odp), read and written as the zip of XML parts
they are (``zipfile`` and lxml: no ODF library needed to keep every part but the text as it was).

- The package is checked before it is opened (``archives.check_zip``), and its ``mimetype``
  entry must name the format its extension names (an .odp called .odt is refused).
- A paragraph or heading (``text:p``, ``text:h``) is a block of runs (``app.formats.markup``):
  spans (``text:span``: their style, bold, italic, colour...), links (``text:a``) and
  ``text:meta`` are marks, copied around the translated words they mark; line breaks, tabs,
  spaces (``text:s``), notes, frames (images, text boxes), fields, bookmarks and anything else
  inside the text are atoms, kept as they are. ``text:soft-page-break`` goes: it describes the
  old layout.
- Which paragraphs: every one of ``content.xml`` (the body text, tables, lists, frames, a
  note's body, the table of contents; a presentation's slides, their shapes, tables and speaker
  notes), and the headers and footers of ``styles.xml``; not comments (``office:annotation``)
  nor tracked deletions (``text:tracked-changes``), which a reader does not see as text.
  A paragraph inside an atom (a note, a text box) is translated as a paragraph of its own.
- Every other entry (styles, meta data, pictures, the manifest) is copied as it was.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from lxml import etree

from app.formats.archives import (
    MAX_PAGES,
    DocumentError,
    Entries,
    Format,
    ZipLimits,
    append_text,
    check_mimetype,
    check_zip,
    parse_xml,
    rewrite_zip,
    unpack,
    xml_bytes,
)
from app.formats.markup import Block, Engine, Run, has_words, plain, translate_blocks

OFFICE = "{urn:oasis:names:tc:opendocument:xmlns:office:1.0}"
TEXT = "{urn:oasis:names:tc:opendocument:xmlns:text:1.0}"
STYLE = "{urn:oasis:names:tc:opendocument:xmlns:style:1.0}"
DRAW = "{urn:oasis:names:tc:opendocument:xmlns:drawing:1.0}"

MIMETYPES = {
    ".odt": "application/vnd.oasis.opendocument.text",
    ".odp": "application/vnd.oasis.opendocument.presentation",
}
PARAGRAPHS = (TEXT + "p", TEXT + "h")
MARKS = frozenset([TEXT + "span", TEXT + "a", TEXT + "meta"])
DROPPED = frozenset([TEXT + "soft-page-break"])
ATOM_TEXT = {TEXT + "line-break": "\n", TEXT + "tab": " ", TEXT + "s": " "}
HIDDEN = frozenset([OFFICE + "annotation", OFFICE + "annotation-end", TEXT + "tracked-changes"])
HEADERS = frozenset(
    STYLE + tag for tag in ("header", "footer", "header-left", "footer-left", "header-first", "footer-first")
)
_SPACE = re.compile(r"[ \t\n\r]+")  # ODF collapses white space in text as HTML does


@dataclass
class _Table:
    """The marks and atoms the paragraphs of one document refer to."""

    marks: list[etree._Element] = field(default_factory=list)
    atoms: list[etree._Element] = field(default_factory=list)

    def runs(self, el: etree._Element, marks: tuple[int, ...]) -> list[Run]:
        """``el``'s content as runs under ``marks``."""
        out = [Run(_SPACE.sub(" ", el.text or ""), marks)]
        for child in el:
            if child.tag in DROPPED:
                pass
            elif child.tag in MARKS:
                self.marks.append(child)
                out.extend(self.runs(child, (*marks, len(self.marks) - 1)))
            else:
                self.atoms.append(child)
                text = ATOM_TEXT.get(child.tag, "") if isinstance(child.tag, str) else ""
                out.append(Run(text, marks, atom=len(self.atoms) - 1))
            out.append(Run(_SPACE.sub(" ", child.tail or ""), marks))
        return [r for r in out if r.text or r.atom is not None]

    def rebuild(self, p: etree._Element, block: Block) -> None:
        """The paragraph's content replaced by the runs (its own attributes kept)."""
        for child in list(p):
            p.remove(child)
        p.text = None
        stack: list[tuple[int, etree._Element]] = []  # open marks: (mark, its copy)
        for run in block:
            common = 0
            while common < min(len(stack), len(run.marks)) and stack[common][0] == run.marks[common]:
                common += 1
            del stack[common:]
            for mark in run.marks[common:]:
                original = self.marks[mark]
                stack.append(
                    (mark, etree.SubElement(stack[-1][1] if stack else p, original.tag, dict(original.attrib)))
                )
            into = stack[-1][1] if stack else p
            if run.atom is not None:
                atom = self.atoms[run.atom]
                atom.tail = None
                into.append(atom)
            else:
                append_text(into, run.text)


def _visible(p: etree._Element, within: frozenset[str] | None) -> bool:
    """Not in a comment or a tracked deletion; in ``within`` (when given: a header or footer)."""
    ancestors = {a.tag for a in p.iterancestors()}
    return not ancestors & HIDDEN and (within is None or bool(ancestors & within))


@dataclass
class OpenDocument:
    format: Format
    entries: Entries
    parts: dict[str, etree._Element]  # entry name -> its tree (the ones with paragraphs)
    paragraphs: list[tuple[etree._Element, Block]]
    table: _Table

    @classmethod
    def parse(cls, data: bytes, fmt: Format, limits: ZipLimits, max_pages: int = MAX_PAGES) -> OpenDocument:
        check_zip(data, limits, fmt.suffix, ("mimetype", "content.xml"))
        entries = unpack(data, fmt.suffix)
        check_mimetype(entries, MIMETYPES[fmt.suffix], fmt.suffix)
        parts: dict[str, etree._Element] = {
            name: parse_xml(entries[name][1], name) for name in ("content.xml", "styles.xml") if name in entries
        }
        content = parts["content.xml"]
        if content.tag != OFFICE + "document-content":
            raise DocumentError("invalid_file_content", f"not a {fmt.suffix} file: content.xml is not ODF content")
        pages = sum(1 for _ in content.iter(DRAW + "page"))
        if pages > max_pages:
            raise DocumentError("unsafe_file", f"{pages} slides; at most {max_pages}")
        table = _Table()
        found: list[tuple[etree._Element, Block]] = []
        for name, root in parts.items():
            within = HEADERS if name == "styles.xml" else None
            for p in list(root.iter(*PARAGRAPHS)):
                if _visible(p, within):
                    block = tuple(table.runs(p, ()))
                    if has_words(block):
                        found.append((p, block))
        return cls(fmt, entries, parts, found, table)

    @property
    def texts(self) -> Sequence[str]:
        return [plain(block) for _, block in self.paragraphs]

    async def translate(self, engine: Engine) -> bytes:
        blocks = await translate_blocks(engine, [block for _, block in self.paragraphs])
        return await asyncio.to_thread(self._rebuilt, blocks)

    def _rebuilt(self, blocks: Sequence[Block]) -> bytes:
        for (p, _), block in zip(self.paragraphs, blocks, strict=True):
            self.table.rebuild(p, block)
        replaced = {name: xml_bytes(root) for name, root in self.parts.items()}
        return rewrite_zip(self.entries, replaced, first="mimetype")
