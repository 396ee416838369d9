"""``format: "html"``: translate the text of an HTML fragment or document, keep its markup.

Parsed with lxml's HTML parser (libxml2: it recovers from malformed markup as browsers do,
so any input gets best-effort output). The tree is walked once:

- the content of ``script``, ``style``, ``code``, ``pre``, ``textarea`` and ``template``,
  and of elements with ``translate="no"`` or class ``notranslate`` (until a descendant says
  ``translate="yes"``), is not translated;
- ``title``, ``alt``, ``placeholder`` and ``aria-label`` attributes are translated;
- the content of a block element between its block children is one block of runs
  (``app.formats.markup``): text with the inline elements around it (``<b>``, ``<a>``, ``<span>``...)
  as marks, and as atoms what stays as it is inside the text (images, line breaks,
  comments, inline ``<code>``, inline elements without text). ``app.formats.markup`` translates the
  blocks and places the marks on the translated words; the runs are put back as elements:
  a mark opened twice is the same element twice (tag and attributes copied).

Whitespace inside text is collapsed as browsers render it (a line break in the source is
a space); entities come out as characters, except a no-break space (``&nbsp;``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from copy import deepcopy
from dataclasses import dataclass, field

import lxml.html
from lxml import etree

from app.formats.markup import Block, Engine, Run, has_text, translate_blocks

SKIPPED = frozenset(["script", "style", "code", "pre", "textarea", "template", "kbd", "samp", "var", "math", "svg"])
SKIPPED_BLOCKS = frozenset(["pre", "template"])  # (the others sit inside running text)
INLINE = frozenset(
    ["a", "abbr", "b", "bdi", "bdo", "cite", "data", "del", "dfn", "em", "font", "i", "ins", "label", "mark", "q"]
) | frozenset(["s", "small", "span", "strong", "sub", "sup", "time", "u"])
VOID = frozenset(["br", "img", "wbr", "input", "hr", "area", "embed", "source", "track", "col", "meta", "link"])
ATTRIBUTES = ("title", "alt", "placeholder", "aria-label")
_SPACE = re.compile(r"[ \t\n\r\f]+")  # HTML's whitespace (no-break space is text)
# Characters no HTML (or XML) text may hold: C0 controls but tab and line breaks, U+FFFE, U+FFFF
# (libxml2 refuses them; HTML parsers drop them as parse errors).
_NOT_TEXT = dict.fromkeys([*range(0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0xFFFE, 0xFFFF])


@dataclass
class _Slot:
    """One block: the inline content of ``parent`` after ``after`` (its text if None, else that
    child's tail) up to the next block child: ``children`` are its inline children."""

    parent: etree._Element
    after: etree._Element | None
    children: list[etree._Element] = field(default_factory=list)


@dataclass
class _Page:
    """What the walk found: blocks with their runs, attributes to translate, marks and atoms."""

    slots: list[_Slot] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    attributes: list[tuple[etree._Element, str]] = field(default_factory=list)
    marks: list[etree._Element] = field(default_factory=list)
    atoms: list[etree._Element] = field(default_factory=list)


def _tag(el: etree._Element) -> str:
    """An element's name in lower case; an XHTML element's (an EPUB's) without its namespace."""
    if not isinstance(el.tag, str):
        return ""
    return (el.tag.rsplit("}", 1)[-1] if el.tag.startswith("{") else el.tag).lower()


def _translatable(el: etree._Element, inherited: bool) -> bool:
    if el.get("translate", "").lower() == "no" or "notranslate" in el.get("class", "").split():
        return False
    return True if el.get("translate", "").lower() == "yes" else inherited


def _is_inline(el: etree._Element) -> bool:
    """Part of the running text: an inline element with only inline content, or a comment."""
    if not isinstance(el.tag, str):
        return True  # comments, processing instructions
    tag = _tag(el)
    if tag in VOID:
        return tag not in ("hr", "meta", "link", "source", "track", "col", "area")
    if tag not in INLINE and (tag not in SKIPPED or tag in SKIPPED_BLOCKS):
        return False
    return all(_is_inline(child) for child in el)


def _text_of(el: etree._Element) -> str:
    return "".join(el.itertext()) if isinstance(el.tag, str) else ""


def _collect(el: etree._Element, translatable: bool, page: _Page) -> None:
    """Walk ``el``'s subtree: attributes to translate, and its blocks (module docstring)."""
    if not isinstance(el.tag, str):
        return
    translatable = _translatable(el, translatable)
    if _tag(el) in SKIPPED:
        return
    if translatable:
        page.attributes.extend((el, name) for name in ATTRIBUTES if (el.get(name) or "").strip())
    slot = _Slot(el, None)
    for child in el:
        if _is_inline(child):
            slot.children.append(child)
            _attributes(child, translatable, page)
        else:
            _add(slot, translatable, page)
            _collect(child, translatable, page)
            slot = _Slot(el, child)
    _add(slot, translatable, page)


def _attributes(el: etree._Element, translatable: bool, page: _Page) -> None:
    """Attributes inside inline content (an image's alt, a link's title)."""
    if not isinstance(el.tag, str) or _tag(el) in SKIPPED:
        return
    translatable = _translatable(el, translatable)
    if translatable:
        page.attributes.extend((el, name) for name in ATTRIBUTES if (el.get(name) or "").strip())
    for child in el:
        _attributes(child, translatable, page)


def _add(slot: _Slot, translatable: bool, page: _Page) -> None:
    if not translatable:
        return
    lead = slot.parent.text if slot.after is None else slot.after.tail
    runs: list[Run] = [Run(_collapse(lead or ""))]
    for child in slot.children:
        runs.extend(_runs(child, (), translatable, page))
        runs.append(Run(_collapse(child.tail or "")))
    block = tuple(r for r in runs if r.text or r.atom is not None)
    if has_text(block):
        page.slots.append(slot)
        page.blocks.append(block)


def _runs(el: etree._Element, marks: tuple[int, ...], translatable: bool, page: _Page) -> list[Run]:
    """An inline element as runs: its text under one more mark, or one atom."""
    tag = _tag(el)
    inner = translatable and isinstance(el.tag, str) and _translatable(el, translatable)
    if tag in VOID or tag in SKIPPED or not inner or not _text_of(el).strip():
        page.atoms.append(el)
        return [Run("\n" if tag == "br" else "", marks, atom=len(page.atoms) - 1)]
    page.marks.append(el)
    marks = (*marks, len(page.marks) - 1)
    runs = [Run(_collapse(el.text or ""), marks)]
    for child in el:
        runs.extend(_runs(child, marks, inner, page))
        runs.append(Run(_collapse(child.tail or ""), marks))
    return runs


def _collapse(text: str) -> str:
    return _SPACE.sub(" ", text)


def _rebuild(slot: _Slot, block: Block, page: _Page) -> None:
    """Replace the slot's content with the translated runs."""
    holder = etree.Element("holder")
    stack: list[tuple[int, etree._Element]] = []  # open marks: (mark, its new element)
    for run in block:
        common = 0
        while common < min(len(stack), len(run.marks)) and stack[common][0] == run.marks[common]:
            common += 1
        del stack[common:]
        for mark in run.marks[common:]:
            original = page.marks[mark]
            copy = etree.SubElement(stack[-1][1] if stack else holder, original.tag, attrib=dict(original.attrib))
            stack.append((mark, copy))
        into = stack[-1][1] if stack else holder
        if run.atom is not None:
            atom = page.atoms[run.atom]
            atom.tail = None
            into.append(atom)
        else:
            _append_text(into, run.text)
    position = 0 if slot.after is None else slot.parent.index(slot.after) + 1
    for child in slot.children:
        if child.getparent() is slot.parent:
            slot.parent.remove(child)
    if slot.after is None:
        slot.parent.text = holder.text
    else:
        slot.after.tail = holder.text
    for offset, child in enumerate(list(holder)):
        slot.parent.insert(position + offset, child)


def _append_text(el: etree._Element, text: str) -> None:
    text = text.translate(_NOT_TEXT)
    if len(el):
        el[-1].tail = (el[-1].tail or "") + text
    else:
        el.text = (el.text or "") + text


def _is_document(text: str) -> bool:
    head = text.lstrip()[:15].lower()
    return head.startswith("<!doctype") or head.startswith("<html") or head.startswith("<?xml")


async def translate_html(texts: Sequence[str], engine: Engine) -> list[str]:
    """Each HTML text translated with its markup kept (module docstring); all texts' sentences
    and attributes go to the engine together."""
    parsed = [_parse(text) for text in texts]
    await translate_trees([root for root, _ in parsed], engine)
    return [_serialize(root, document) for root, document in parsed]


async def translate_trees(roots: Sequence[etree._Element], engine: Engine) -> None:
    """Each tree (an HTML page, or an XHTML one parsed as XML) translated in place, its markup
    kept (module docstring); all trees' sentences and attributes go to the engine together."""
    page = _Page()
    for root in roots:
        _collect(root, True, page)
    values = [str(el.get(name)) for el, name in page.attributes]
    translated_values = await engine.texts(values) if values else []
    blocks = await translate_blocks(engine, page.blocks)
    for (el, name), value in zip(page.attributes, translated_values, strict=True):
        el.set(name, value.translate(_NOT_TEXT))
    for slot, block in zip(page.slots, blocks, strict=True):
        _rebuild(slot, block, page)


_PARSER = lxml.html.HTMLParser(encoding="utf-8")  # the text is Unicode, whatever it declares


def visible_text(text: str) -> str:
    """The text a reader sees (what language detection reads): no markup, scripts or styles."""
    return tree_text(_parse(text)[0], copy=False)


def tree_text(root: etree._Element, copy: bool = True) -> str:
    """The text a reader sees of a parsed page (HTML or XHTML); ``root`` left as it was unless
    ``copy`` is false."""
    if copy:
        root = deepcopy(root)
    for el in [el for el in root.iter() if _tag(el) in ("script", "style", "template")]:
        el.text = None
        for child in el:
            el.remove(child)
    return " ".join(" ".join(root.itertext()).split())


def _parse(text: str) -> tuple[etree._Element, bool]:
    """(root, whether it is a whole document). A fragment is parsed inside a ``div`` holder."""
    text = text.translate(_NOT_TEXT)
    data = text.encode("utf-8")
    if _is_document(text):
        try:
            return lxml.html.document_fromstring(data, parser=_PARSER), True
        except (etree.ParserError, ValueError):
            pass  # (e.g. a doctype and nothing else): as a fragment
    holder = lxml.html.fragment_fromstring("<div></div>")
    try:
        parts = lxml.html.fragments_fromstring(data, parser=_PARSER)
    except (etree.ParserError, ValueError):
        parts = [text]  # nothing lxml can read as markup: the text as text
    for part in parts:
        if isinstance(part, str):
            _append_text(holder, part)
        else:
            holder.append(part)
    return holder, False


def _serialize(root: etree._Element, document: bool) -> str:
    if document:
        tree = root.getroottree()
        doctype = tree.docinfo.doctype or None
        out = lxml.html.tostring(tree, encoding="unicode", method="html", doctype=doctype)
    else:
        out = (root.text or "").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        out += "".join(lxml.html.tostring(child, encoding="unicode", method="html") for child in root)
    return out.replace("\xa0", "&nbsp;")
