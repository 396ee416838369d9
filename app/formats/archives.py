"""What every document format shares (``app.formats.documents`` and the format modules): the
error a refused file raises, a format's suffix and media type, the limits and checks of a zip
container (.docx, .pptx, .odt, .odp, .epub) made before anything opens it, the XML parser that
reads its parts without fetching or expanding anything, and the zip written back.

A zip is checked from its central directory alone (``check_zip``): entry count, unpacked size,
XML size, compression ratio, encryption, the entries a format needs; ``zipfile`` then stops
inflating an entry at its declared size, so the declared sizes bound what a library can inflate.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lxml import etree


class DocumentError(ValueError):
    """A file this service does not take: ``error_type`` says why (the HTTP edge answers 400)."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


@dataclass(frozen=True)
class Format:
    suffix: str
    media_type: str


@dataclass(frozen=True)
class ZipLimits:
    """What a zip container may unpack to. ``zipfile`` stops reading an entry at its declared
    size, so the declared sizes checked here bound what a library can inflate."""

    entries: int = 2000
    total_bytes: int = 64 * 2**20
    xml_bytes: int = 16 * 2**20  # what is parsed into trees (a tree takes several times its text)
    ratio: float = 100.0  # uncompressed / compressed, for an entry over ``ratio_from`` bytes
    ratio_from: int = 2**20


MAX_PAGES = 500  # a PDF's pages, a presentation's slides, a book's chapters
XML_SUFFIXES = (".xml", ".rels", ".xhtml", ".html", ".htm", ".opf", ".ncx", ".svg")


# What zipfile raises for a damaged archive (its directory, an entry's header, data or CRC, a
# version or method it does not know).
ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, NotImplementedError, EOFError, ValueError, OSError)


def open_zip(data: bytes, suffix: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(io.BytesIO(data))
    except ZIP_ERRORS:
        raise DocumentError("invalid_file_content", f"a {suffix} file must be a zip archive; this one is not") from None


def check_zip(data: bytes, limits: ZipLimits, suffix: str = ".docx", required: Iterable[str] | None = None) -> None:
    """A ``suffix`` file is a zip holding ``required`` (a .docx's parts by default), within
    ``limits`` (a zip bomb is refused here, from the central directory, before anything is
    inflated)."""
    with open_zip(data, suffix) as archive:
        entries = archive.infolist()
    if len(entries) > limits.entries:
        raise DocumentError("unsafe_file", f"{len(entries)} entries in the archive; at most {limits.entries}")
    total = sum(e.file_size for e in entries)
    if total > limits.total_bytes:
        raise DocumentError("unsafe_file", f"the archive unpacks to {total} bytes; at most {limits.total_bytes}")
    xml = sum(e.file_size for e in entries if e.filename.lower().endswith(XML_SUFFIXES))
    if xml > limits.xml_bytes:
        raise DocumentError("unsafe_file", f"the archive holds {xml} bytes of XML; at most {limits.xml_bytes}")
    for e in entries:
        if e.file_size > limits.ratio_from and e.file_size > limits.ratio * max(e.compress_size, 1):
            raise DocumentError(
                "unsafe_file",
                f"an entry is compressed {e.file_size // max(e.compress_size, 1)}:1; at most {limits.ratio:g}:1",
            )
    if any(e.flag_bits & 0x1 for e in entries):
        raise DocumentError("invalid_file_content", "the archive is encrypted")
    names = {e.filename for e in entries}
    missing = [n for n in (required if required is not None else DOCX_PARTS) if n not in names]
    if missing:
        raise DocumentError("invalid_file_content", f"not a {suffix} file: the archive has no {', '.join(missing)}")


DOCX_PARTS = ("[Content_Types].xml", "word/document.xml")


Entries = dict[str, tuple[zipfile.ZipInfo, bytes]]


def unpack(data: bytes, suffix: str) -> Entries:
    """Every entry of a checked archive (``check_zip``: the sizes are bounded), read once: a
    damaged one (its CRC, its compressed data, its header) is refused here, not when the
    translation is written."""
    try:
        with open_zip(data, suffix) as archive:
            return {info.filename: (info, archive.read(info)) for info in archive.infolist()}
    except ZIP_ERRORS as err:
        raise DocumentError("invalid_file_content", f"a damaged {suffix} archive: {err}") from None


def check_mimetype(entries: Entries, expected: str, suffix: str) -> None:
    """An OpenDocument or EPUB package names its type in its ``mimetype`` entry."""
    found = entries["mimetype"][1][:200].decode("ascii", "replace").strip()
    if found != expected:
        raise DocumentError("invalid_file_content", f"not a {suffix} file: its mimetype is {found[:80]!r}")


# Parts are read without a DTD, network or entity expansion (no XXE, no billion laughs); a
# tree as deep or as large as libxml2 refuses by default is refused.
XML_PARSER = etree.XMLParser(
    resolve_entities=False, no_network=True, load_dtd=False, huge_tree=False, remove_blank_text=False
)


def parse_xml(data: bytes, what: str) -> etree._Element:
    try:
        root = etree.fromstring(data, parser=XML_PARSER)
    except (etree.XMLSyntaxError, ValueError) as err:
        raise DocumentError("invalid_file_content", f"{what} is not well-formed XML: {err}") from None
    if root is None:
        raise DocumentError("invalid_file_content", f"{what} is empty")
    dtd = root.getroottree().docinfo.internalDTD
    if dtd is not None and any(True for _ in dtd.iterentities()):
        raise DocumentError("unsafe_file", f"{what} declares entities")  # (no format here needs them)
    return root


# Characters no XML text may hold: C0 controls but tab and line breaks, U+FFFE, U+FFFF.
NOT_XML = dict.fromkeys([*range(0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0xFFFE, 0xFFFF])


def append_text(el: etree._Element, text: str) -> None:
    """``text`` at the end of ``el``'s content (after its last child)."""
    text = text.translate(NOT_XML)
    if len(el):
        el[-1].tail = (el[-1].tail or "") + text
    else:
        el.text = (el.text or "") + text


def xml_bytes(root: etree._Element) -> bytes:
    """A part's tree as UTF-8 XML, its declaration and doctype kept."""
    return etree.tostring(root.getroottree(), xml_declaration=True, encoding="UTF-8", standalone=None)


def rewrite_zip(entries: Entries, replaced: Mapping[str, bytes], first: str | None = None) -> bytes:
    """The archive with the ``replaced`` entries' content, every other entry copied as it was,
    in their order; ``first`` (an OpenDocument or EPUB ``mimetype``) first and stored."""
    out = io.BytesIO()
    names = list(entries)
    if first is not None:
        names.sort(key=lambda name: name != first)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as written:
        for name in names:
            info, data = entries[name]
            data = replaced.get(name, data)
            copied = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            copied.external_attr = info.external_attr
            stored = info.filename == first or info.compress_type == zipfile.ZIP_STORED
            copied.compress_type = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
            written.writestr(copied, data)
    return out.getvalue()
