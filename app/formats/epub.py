"""E-books (.epub, EPUB 2 and 3), read and written as the zip of XML parts they are (``zipfile``
and lxml): each chapter translated as an XHTML page, the table of contents and the title with
it, every other part copied as it was.

- The package is checked before it is opened (``archives.check_zip``), its ``mimetype`` entry
  must be ``application/epub+zip``, and ``META-INF/container.xml`` must name its package
  document (the OPF), whose manifest lists the parts and whose spine orders the chapters.
- The body of every XHTML part of the manifest (the chapters, and an EPUB 3 book's navigation
  document: its table of contents) goes through ``app.formats.html`` as a tree parsed as XML: paragraphs,
  headings, list items... are blocks whose inline elements stay around the words they mark; the
  ``title``, ``alt`` and ``aria-label`` attributes are translated, scripts, styles, code, SVG and
  MathML are not. An EPUB 2 book's table of contents (the NCX: ``navLabel`` and ``docTitle``)
  and the book's ``dc:title`` are translated as plain texts. Ids, links, the spine and the
  manifest stay as they were, so every entry of the table of contents still opens its chapter.
- XML is parsed without a DTD, network or entity expansion; the named entities of HTML
  (``&nbsp;``, which EPUB 2 books declare through the XHTML DTD) are read as the characters they
  name.
"""

from __future__ import annotations

import asyncio
import html.entities
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from lxml import etree

from app.formats import html as html_format
from app.formats.archives import (
    MAX_PAGES,
    NOT_XML,
    DocumentError,
    Entries,
    Format,
    ZipLimits,
    check_mimetype,
    check_zip,
    parse_xml,
    rewrite_zip,
    unpack,
    xml_bytes,
)
from app.formats.markup import Engine

CONTAINER = "{urn:oasis:names:tc:opendocument:xmlns:container}"
OPF = "{http://www.idpf.org/2007/opf}"
DC = "{http://purl.org/dc/elements/1.1/}"
NCX = "{http://www.daisy.org/z3986/2005/ncx/}"
MIMETYPE = "application/epub+zip"
XHTML = "application/xhtml+xml"
BODY = "{http://www.w3.org/1999/xhtml}body"
NCX_TYPE = "application/x-dtbncx+xml"
XML_ENTITIES = frozenset(["amp", "lt", "gt", "quot", "apos"])
_ENTITY = re.compile(rb"&([A-Za-z][A-Za-z0-9]{1,31});")


def _characters(match: re.Match[bytes]) -> bytes:
    """An HTML named entity as numeric character references (XML's own five kept)."""
    name = match.group(1).decode("ascii")
    chars = html.entities.html5.get(name + ";")
    if name in XML_ENTITIES or chars is None:
        return match.group(0)
    return "".join(f"&#{ord(c)};" for c in chars).encode("ascii")


@dataclass
class Book:
    entries: Entries
    package: tuple[str, etree._Element]  # the OPF: its entry name and tree
    chapters: dict[str, etree._Element]  # the XHTML parts, in the manifest's order
    toc: tuple[str, etree._Element] | None  # an EPUB 2 table of contents (the NCX)
    labels: list[etree._Element]  # elements whose text is translated as a whole: dc:title, the NCX's labels
    format: Format

    @classmethod
    def parse(cls, data: bytes, fmt: Format, limits: ZipLimits, max_pages: int = MAX_PAGES) -> Book:
        check_zip(data, limits, fmt.suffix, ("mimetype", "META-INF/container.xml"))
        entries = unpack(data, fmt.suffix)
        check_mimetype(entries, MIMETYPE, fmt.suffix)
        names = set(entries)
        container = parse_xml(entries["META-INF/container.xml"][1], "META-INF/container.xml")
        rootfile = next(
            (r.get("full-path") for r in container.iter(CONTAINER + "rootfile") if r.get("full-path") in names), None
        )
        if rootfile is None:
            raise DocumentError("invalid_file_content", "not an .epub file: container.xml names no package document")
        package = parse_xml(entries[rootfile][1], rootfile)
        if package.tag != OPF + "package":
            raise DocumentError("invalid_file_content", f"not an .epub file: {rootfile} is not a package document")
        folder = posixpath.dirname(rootfile)
        parts: dict[str, str] = {}  # entry -> media type, of the manifest's items that are in the archive
        for item in package.iter(OPF + "item"):
            href = unquote((item.get("href") or "").split("#", 1)[0])
            name = posixpath.normpath(posixpath.join(folder, href)) if href else ""
            if name in names:
                parts.setdefault(name, item.get("media-type") or "")
        chapters = [name for name, kind in parts.items() if kind == XHTML]
        if len(chapters) > max_pages:
            raise DocumentError("unsafe_file", f"{len(chapters)} chapters; at most {max_pages}")
        trees = {name: parse_xml(_ENTITY.sub(_characters, entries[name][1]), name) for name in chapters}
        ncx = next((name for name, kind in parts.items() if kind == NCX_TYPE), None)
        toc = (ncx, parse_xml(entries[ncx][1], ncx)) if ncx else None
        labels = [el for el in package.iter(DC + "title") if (el.text or "").strip() and not len(el)]
        if toc is not None:
            labels += [
                el
                for el in toc[1].iter(NCX + "text")
                if (el.text or "").strip() and el.getparent() is not None and el.getparent().tag != NCX + "docAuthor"
            ]
        return cls(entries, (rootfile, package), trees, toc, labels, fmt)

    @property
    def texts(self) -> Sequence[str]:
        return [
            *(str(el.text).strip() for el in self.labels),
            *(html_format.tree_text(body) for body in self.bodies),
        ]

    @property
    def bodies(self) -> list[etree._Element]:
        """What a reader sees of each chapter: its body (not its head's title)."""
        return [next(root.iter(BODY), root) for root in self.chapters.values()]

    async def translate(self, engine: Engine) -> bytes:
        texts = [" ".join(str(el.text).split()) for el in self.labels]
        done, _ = await asyncio.gather(engine.texts(texts), html_format.translate_trees(self.bodies, engine))
        for el, text in zip(self.labels, done, strict=True):
            el.text = text.translate(NOT_XML)
        return await asyncio.to_thread(self._rebuilt)

    def _rebuilt(self) -> bytes:
        replaced = {name: xml_bytes(root) for name, root in self.chapters.items()}
        replaced[self.package[0]] = xml_bytes(self.package[1])
        if self.toc is not None:
            replaced[self.toc[0]] = xml_bytes(self.toc[1])
        return rewrite_zip(self.entries, replaced, first="mimetype")
