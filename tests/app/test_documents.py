"""The document formats beyond text, HTML, subtitles and .docx (.odt, .odp, .pptx, .epub, .pdf):
each file is built with its format's own library or tool (odfpy, python-pptx, pandoc,
ReportLab), translated by a real server (``translator serve`` on the shipped de->en model), and
the result opened by an independent reader: LibreOffice (headless, Debian's packages) for the
OpenDocument and Office files, pandoc for the book, PDFium (pypdfium2) for the PDF. The text
must be translated and the structure kept: paragraphs, spans and their styles, tables, notes,
headers; slides and speaker notes; chapters and the table of contents; pages and where each
text block stands. Malformed files, archive bombs and PDF stream bombs are 400 JSON errors.

LibreOffice starts once per kind of conversion (all files in one call); one server serves the
module. Under CI=true a missing program fails (``tests.helpers.require``)."""

from __future__ import annotations

import asyncio
import functools
import io
import os
import random
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import lxml.html
import pptx
import pypdf
import pytest
from lxml import etree
from odf import draw, presentation, style, table, text
from odf.opendocument import OpenDocumentPresentation, OpenDocumentText
from pptx.util import Inches
from reportlab.lib.pagesizes import A4
from reportlab.pdfgen import canvas

from app.formats import documents
from app.formats.archives import DocumentError, ZipLimits
from app.formats.markup import Aligned
from app.formats.pdf import check_pdf
from tests.helpers import require, running_server

TEXT = "{urn:oasis:names:tc:opendocument:xmlns:text:1.0}"
DRAW = "{urn:oasis:names:tc:opendocument:xmlns:drawing:1.0}"
PRESENTATION = "{urn:oasis:names:tc:opendocument:xmlns:presentation:1.0}"
STYLE = "{urn:oasis:names:tc:opendocument:xmlns:style:1.0}"
FO = "{urn:oasis:names:tc:opendocument:xmlns:xsl-fo-compatible:1.0}"
XHTML = "{http://www.w3.org/1999/xhtml}"
NCX = "{http://www.daisy.org/z3986/2005/ncx/}"
GERMAN = {"ein", "eine", "der", "die", "das", "im", "und", "mann", "hund", "hunde", "katze", "katzen", "schläft"}
GERMAN |= {"spielen", "über", "kinder", "kapitel"}


def german(words: str) -> list[str]:
    """The German words ``words`` still holds (a translation has none of them)."""
    return sorted({w.strip(".,:;!?()").lower() for w in words.split()} & GERMAN)


# --- the files, each built by its format's own library or tool ---------------------------


def odt_file() -> bytes:
    doc = OpenDocumentText()
    bold = style.Style(name="Fett", family="text")
    bold.addElement(style.TextProperties(fontweight="bold"))
    doc.automaticstyles.addElement(bold)
    heading = style.Style(name="Heading_20_1", displayname="Heading 1", family="paragraph", defaultoutlinelevel="1")
    heading.addElement(style.TextProperties(fontsize="20pt", fontweight="bold"))
    doc.styles.addElement(heading)
    layout = style.PageLayout(name="Seite")
    layout.addElement(style.PageLayoutProperties(pagewidth="21cm", pageheight="29.7cm"))
    doc.automaticstyles.addElement(layout)
    master = style.MasterPage(name="Standard", pagelayoutname=layout)
    for part, words in ((style.Header(), "Der Bericht über Hunde."), (style.Footer(), "Zwei Katzen schlafen.")):
        part.addElement(text.P(text=words))
        master.addElement(part)
    doc.masterstyles.addElement(master)
    doc.text.addElement(text.H(outlinelevel=1, stylename=heading, text="Hunde im Park"))
    mixed = text.P(text="Ein Mann sieht ")
    mixed.addElement(text.Span(stylename=bold, text="zwei große Hunde"))
    mixed.addText(" im Park.")
    doc.text.addElement(mixed)
    breaks = text.P(text="Ein Kind spielt.")
    breaks.addElement(text.LineBreak())
    breaks.addText("Zwei Frauen lachen.")
    doc.text.addElement(breaks)
    linked = text.P(text="Die Hunde laufen in ")
    linked.addElement(text.A(href="https://example.org/park", type="simple", text="den Park"))
    linked.addText(".")
    note = text.Note(id="ftn1", noteclass="footnote")
    note.addElement(text.NoteCitation(text="1"))
    body = text.NoteBody()
    body.addElement(text.P(text="Eine Katze schläft auf dem Sofa."))
    note.addElement(body)
    linked.addElement(note)
    doc.text.addElement(linked)
    grid = table.Table(name="Tabelle1")
    grid.addElement(table.TableColumn(numbercolumnsrepeated=2))
    for row in (("Ein Hund.", "Eine Katze."), ("Zwei Kinder spielen.", "")):
        line = table.TableRow()
        for words in row:
            cell = table.TableCell()
            cell.addElement(text.P(text=words))
            line.addElement(cell)
        grid.addElement(line)
    doc.text.addElement(grid)
    items = text.List()
    for words in ("Ein Apfel liegt auf dem Tisch.", "Die Kinder essen Eis."):
        item = text.ListItem()
        item.addElement(text.P(text=words))
        items.addElement(item)
    doc.text.addElement(items)
    out = io.BytesIO()
    doc.save(out)
    return out.getvalue()


SLIDES: list[tuple[str, list[str | tuple[str]], str]] = [  # (title, body: plain and bold parts, speaker notes)
    ("Hunde im Park", ["Ein Mann sieht ", ("zwei große Hunde",), " im Park."], "Sprich langsam über die Hunde."),
    ("Katzen im Haus", ["Eine Katze schläft auf dem Sofa."], "Zeige das Bild der Katze."),
]


def odp_file() -> bytes:
    doc = OpenDocumentPresentation()
    layout = style.PageLayout(name="Folie")
    layout.addElement(style.PageLayoutProperties(pagewidth="28cm", pageheight="21cm", printorientation="landscape"))
    doc.automaticstyles.addElement(layout)
    master = style.MasterPage(name="Standard", pagelayoutname=layout)
    doc.masterstyles.addElement(master)
    bold = style.Style(name="Fett", family="text")
    bold.addElement(style.TextProperties(fontweight="bold"))
    doc.automaticstyles.addElement(bold)

    def box(paragraph: Any, y: str, height: str) -> Any:
        frame = draw.Frame(width="24cm", height=height, x="2cm", y=y)
        content = draw.TextBox()
        content.addElement(paragraph)
        frame.addElement(content)
        return frame

    for number, (title, body, notes) in enumerate(SLIDES, 1):
        page = draw.Page(name=f"Folie{number}", masterpagename=master)
        page.addElement(box(text.P(text=title), "1cm", "3cm"))
        paragraph = text.P()
        for part in body:
            if isinstance(part, tuple):
                paragraph.addElement(text.Span(stylename=bold, text=part[0]))
            else:
                paragraph.addText(part)
        page.addElement(box(paragraph, "5cm", "12cm"))
        speaker = presentation.Notes()
        speaker.addElement(box(text.P(text=notes), "14cm", "10cm"))
        page.addElement(speaker)
        doc.presentation.addElement(page)
    out = io.BytesIO()
    doc.save(out)
    return out.getvalue()


def pptx_file() -> bytes:
    deck = pptx.Presentation()
    for title, body, notes in SLIDES:
        slide = deck.slides.add_slide(deck.slide_layouts[1])
        slide.shapes.title.text = title
        paragraph = slide.placeholders[1].text_frame.paragraphs[0]
        for part in body:
            run = paragraph.add_run()
            run.text = part[0] if isinstance(part, tuple) else part
            run.font.bold = isinstance(part, tuple) or None
        slide.notes_slide.notes_text_frame.text = notes
    slide = deck.slides.add_slide(deck.slide_layouts[5])
    slide.shapes.title.text = "Eine Tabelle über Tiere"
    grid = slide.shapes.add_table(2, 2, Inches(1), Inches(2), Inches(6), Inches(2)).table
    for i, words in enumerate(["Ein Hund.", "Eine Katze.", "Zwei Kinder spielen.", "42"]):
        grid.cell(i // 2, i % 2).text = words
    out = io.BytesIO()
    deck.save(out)
    return out.getvalue()


BOOK = """---
title: Hunde und Katzen
lang: de
---

# Kapitel eins: Der Hund

Ein Mann sieht **zwei große Hunde** im Park. Die Hunde spielen.

# Kapitel zwei: Die Katze

Eine Katze schläft auf dem Sofa.

## Ein Garten

Die Kinder essen Eis.
"""


def epub_file(pandoc: str, folder: Path) -> bytes:
    """An EPUB 3 book by pandoc: a chapter per level-1 heading, a navigation document and an NCX."""
    out = folder / "buch.epub"
    subprocess.run([pandoc, "-f", "markdown", "-t", "epub3", "--toc", "-o", str(out)], input=BOOK.encode(), check=True)
    return out.read_bytes()


PDF_LINES = [  # (page, x, baseline, font, size, text)
    (0, 72, 760, "Helvetica-Bold", 20, "Hunde im Park"),
    (0, 72, 700, "Helvetica", 12, "Ein Mann fährt mit dem Fahrrad über die Brücke."),
    (0, 72, 685, "Helvetica", 12, "Zwei Hunde spielen im Park."),
    (0, 300, 400, "Helvetica", 12, "Eine Katze schläft."),
    (0, 290, 40, "Helvetica", 10, "1"),
    (1, 100, 600, "Helvetica", 14, "Die Kinder essen Eis."),
    (1, 290, 40, "Helvetica", 10, "2"),
]


def pdf_file(pages: int = 2, **options: Any) -> bytes:
    out = io.BytesIO()
    drawing = canvas.Canvas(out, pagesize=A4, **options)
    for page in range(pages):
        if page == 0:
            drawing.rect(60, 380, 400, 50)  # a drawing that stays
        for _, x, y, font, size, words in [line for line in PDF_LINES if line[0] == page % 2]:
            drawing.setFont(font, size)
            drawing.drawString(x, y, words)
        drawing.showPage()
    drawing.save()
    return out.getvalue()


# --- one server, every file translated once ------------------------------------------------


def upload(url: str, filename: str, data: bytes) -> httpx.Response:
    form = {"source": "de", "target": "en"}
    return httpx.post(f"{url}/translate_file", files={"file": (filename, data)}, data=form, timeout=120)


@pytest.fixture(scope="module")
def served(shipped: Path, fused_kernels: None) -> Iterator[str]:
    with running_server({"TRANSLATOR_WEIGHTS_DIR": str(shipped.parent), "TRANSLATOR_THREADS": "2"}) as url:
        yield url


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="documents-") as name:
        yield Path(name)


@pytest.fixture(scope="module")
def originals(folder: Path) -> dict[str, bytes]:
    pandoc = None
    try:
        import pypandoc

        pandoc = pypandoc.get_pandoc_path()
    except (ImportError, OSError):
        pass
    require(pandoc is not None, "pandoc not found (pip install pypandoc-binary: the dev extra)")
    assert pandoc is not None
    return {
        "brief.odt": odt_file(),
        "folien.odp": odp_file(),
        "deck.pptx": pptx_file(),
        "buch.epub": epub_file(pandoc, folder),
        "seiten.pdf": pdf_file(),
    }


@pytest.fixture(scope="module")
def translated(served: str, originals: dict[str, bytes]) -> dict[str, bytes]:
    def one(name: str) -> bytes:
        answer = upload(served, name, originals[name])
        assert answer.status_code == 200, answer.text
        download = httpx.get(answer.json()["translatedFileUrl"], timeout=30)
        assert download.status_code == 200
        assert download.headers["content-type"] == documents.FORMATS[Path(name).suffix].media_type
        return download.content

    with ThreadPoolExecutor(len(originals)) as pool:  # all at once: the server batches their sentences
        return dict(zip(originals, pool.map(one, originals), strict=True))


def libreoffice(files: dict[str, bytes], target: str, folder: Path) -> dict[str, bytes]:
    """``files`` converted to ``target`` by LibreOffice in one headless run: what it read."""
    binary = shutil.which("soffice")
    require(
        binary is not None,
        "LibreOffice not installed (apt-get install libreoffice-writer-nogui libreoffice-impress-nogui)",
    )
    assert binary is not None
    inputs, outputs = folder / f"to-{target}", folder / f"from-{target}"
    inputs.mkdir()
    for name, data in files.items():
        (inputs / name).write_bytes(data)
    profile = (folder / "lo-profile").as_uri()  # its own profile: no lock shared with a running LibreOffice
    command = [binary, f"-env:UserInstallation={profile}", "--headless", "--norestore", "--convert-to", target]
    paths = [str(inputs / name) for name in files]
    subprocess.run([*command, "--outdir", str(outputs), *paths], check=True, timeout=300, capture_output=True)
    found = {}
    for name in files:
        converted = outputs / f"{Path(name).stem}.{target}"
        assert converted.is_file(), f"LibreOffice could not open {name}"
        found[name] = converted.read_bytes()
    return found


@pytest.fixture(scope="module")
def writer_html(originals: dict[str, bytes], translated: dict[str, bytes], folder: Path) -> dict[str, Any]:
    """The .odt before and after, as LibreOffice Writer reads them (its HTML export)."""
    read = libreoffice({"vorher.odt": originals["brief.odt"], "nachher.odt": translated["brief.odt"]}, "html", folder)
    return {name: lxml.html.document_fromstring(data) for name, data in read.items()}


@pytest.fixture(scope="module")
def impress(originals: dict[str, bytes], translated: dict[str, bytes], folder: Path) -> dict[str, Any]:
    """The presentations before and after, as LibreOffice Impress reads them (saved as .odp)."""
    files = {
        "vorher-odp.odp": originals["folien.odp"],
        "nachher-odp.odp": translated["folien.odp"],
        "vorher-pptx.pptx": originals["deck.pptx"],
        "nachher-pptx.pptx": translated["deck.pptx"],
    }
    read = libreoffice(files, "odp", folder)
    return {
        name: etree.fromstring(zipfile.ZipFile(io.BytesIO(data)).read("content.xml")) for name, data in read.items()
    }


# --- what the readers see ------------------------------------------------------------------


def words(el: Any) -> str:
    return " ".join(" ".join(el.itertext()).split())


@pytest.mark.server
@pytest.mark.external
def test_odt_paragraphs_spans_tables_notes_and_headers_in_libreoffice(writer_html: dict[str, Any]) -> None:
    before, after = writer_html["vorher.odt"], writer_html["nachher.odt"]

    def outline(page: Any) -> list[str]:
        return [el.tag for el in page.body.iter() if el.tag in ("h1", "p", "table", "tr", "td", "ul", "li", "br", "a")]

    assert outline(after) == outline(before), "the same headings, paragraphs, table, list, breaks and links"
    assert german(words(after.body)) == [] and words(after.body), words(after.body)
    heading, mixed = after.body.find(".//h1"), after.body.findall(".//p")[1]
    assert words(heading) and words(heading) != "Hunde im Park"
    assert mixed.findall(".//b") and words(mixed.find(".//b")) != words(mixed), "the bold words stay bold, not all"
    assert after.body.find(".//a[@href='https://example.org/park']") is not None, "the link is kept"
    footnote = [div for div in after.body.iter("div") if (div.get("id") or "").startswith("sdfootnote")]
    assert len(footnote) == 1 and words(footnote[0]).strip("1 "), "the footnote is kept, translated"
    header, footer = (next(d for d in after.body.iter("div") if d.get("title") == t) for t in ("header", "footer"))
    assert words(header) and words(footer) and german(words(header) + words(footer)) == []
    cells = [words(td) for td in after.body.iter("td")]
    assert len(cells) == 4 and all(cells[:3]) and cells[3] == ""


def slides(content: Any) -> list[tuple[list[str], list[str], bool]]:
    """Each slide as Impress read it: its paragraphs, its notes' paragraphs, whether any of its
    spans is bold."""
    bold = {
        s.get(STYLE + "name")
        for s in content.iter(STYLE + "style")
        if any(p.get(FO + "font-weight") == "bold" for p in s.iter(STYLE + "text-properties"))
    }
    out = []
    for page in content.iter(DRAW + "page"):
        notes = page.find(PRESENTATION + "notes")
        inside = set(notes.iter()) if notes is not None else set()
        shown = [words(p) for p in page.iter(TEXT + "p") if p not in inside and words(p) != "<number>"]
        spoken = [words(p) for p in notes.iter(TEXT + "p") if words(p) != "<number>"] if notes is not None else []
        spans = [s for s in page.iter(TEXT + "span") if s not in inside and words(s)]
        out.append((shown, spoken, any(s.get(TEXT + "style-name") in bold for s in spans)))
    return out


@pytest.mark.server
@pytest.mark.external
@pytest.mark.parametrize("kind", ["odp", "pptx"])
def test_slides_notes_and_bold_runs_in_libreoffice(impress: dict[str, Any], kind: str) -> None:
    before, after = slides(impress[f"vorher-{kind}.{kind}"]), slides(impress[f"nachher-{kind}.{kind}"])
    assert len(after) == len(before) == (2 if kind == "odp" else 3), "every slide kept"
    for (old, old_notes, old_bold), (new, new_notes, new_bold) in zip(before, after, strict=True):
        assert len(new) == len(old) and len(new_notes) == len(old_notes), (old, new)
        assert all(new) and new != old and (new_notes != old_notes or not old_notes)
        assert german(" ".join(new + new_notes)) == [], new + new_notes
        assert new_bold == old_bold, "a bold run stays bold"
    assert after[0][2] and after[0][1], "the first slide has its bold words and its notes"
    if kind == "pptx":
        assert "42" in after[2][0], "a cell without words stays as it was"


@pytest.mark.server
@pytest.mark.external
def test_epub_chapters_and_table_of_contents(originals: dict[str, bytes], translated: dict[str, bytes]) -> None:
    import pypandoc

    def read(data: bytes) -> Any:
        return lxml.html.fragment_fromstring(pypandoc.convert_text(data, "html", format="epub"), create_parent="div")

    before, after = read(originals["buch.epub"]), read(translated["buch.epub"])
    chapters = [el for el in after.iter("section") if "level1" in el.get("class", "")]
    headings = [(el.tag, words(el)) for chapter in chapters for el in chapter.iter("h1", "h2")]
    assert [tag for tag, _ in headings] == ["h1", "h1", "h2"], "two chapters, the second with a section"
    assert [el.tag for el in after.iter("h1", "h2")] == [el.tag for el in before.iter("h1", "h2")]
    assert all(w for _, w in headings) and german(words(after)) == [], words(after)
    assert after.findall(".//strong") and words(after.find(".//strong")), "the bold words stay bold"
    book = zipfile.ZipFile(io.BytesIO(translated["buch.epub"]))
    assert book.infolist()[0].filename == "mimetype" and book.infolist()[0].compress_type == zipfile.ZIP_STORED
    original = zipfile.ZipFile(io.BytesIO(originals["buch.epub"]))
    assert book.namelist() == original.namelist()
    nav = etree.fromstring(book.read("EPUB/nav.xhtml"))
    toc = next(n for n in nav.iter(XHTML + "nav") if "toc" in n.get("{http://www.idpf.org/2007/ops}type", ""))
    links = [(a.get("href"), words(a)) for a in toc.iter(XHTML + "a")]
    old_nav = etree.fromstring(original.read("EPUB/nav.xhtml"))
    assert [h for h, _ in links] == [a.get("href") for a in old_nav.iter(XHTML + "a")][: len(links)], "links kept"
    chapter_links = [w for href, w in links if "/ch0" in href]  # (not the title page's)
    assert chapter_links == [w for _, w in headings], "each entry reads as the heading it opens"
    ncx = etree.fromstring(book.read("EPUB/toc.ncx"))
    labels = [
        words(p.find(f"{NCX}navLabel"))
        for p in ncx.iter(NCX + "navPoint")
        if "/ch0" in p.find(f"{NCX}content").get("src")
    ]
    assert labels == [w for _, w in headings]
    assert german(words(ncx.find(f"{NCX}docTitle"))) == []


def pdf_lines(data: bytes) -> list[list[tuple[float, float, float, str]]]:
    """Each page's text rectangles by PDFium: (left, bottom, char weight, text)."""
    import pypdfium2 as pdfium
    import pypdfium2.raw as raw

    out = []
    for page in pdfium.PdfDocument(data):
        textpage = page.get_textpage()
        rects = []
        for i in range(textpage.count_rects()):
            left, bottom, right, top = textpage.get_rect(i)
            index = textpage.get_index(left + 0.5, (bottom + top) / 2, 1, 1)
            weight = raw.FPDFText_GetFontWeight(textpage.raw, index) if index >= 0 else 0
            rects.append((left, bottom, weight, textpage.get_text_bounded(left, bottom, right, top)))
        out.append(rects)
    return out


@pytest.mark.server
@pytest.mark.external
def test_pdf_pages_blocks_and_drawings_in_pdfium(originals: dict[str, bytes], translated: dict[str, bytes]) -> None:
    import pypdfium2 as pdfium

    before, after = pdfium.PdfDocument(originals["seiten.pdf"]), pdfium.PdfDocument(translated["seiten.pdf"])
    assert len(after) == len(before) == 2
    assert [p.get_size() for p in after] == [p.get_size() for p in before]
    assert [o.type for o in after[0].get_objects()].count(2) == 1, "the rectangle (a path) is kept"
    lines = pdf_lines(translated["seiten.pdf"])
    everything = " ".join(t for page in lines for *_, t in page)
    assert german(everything) == [] and "Dog" in everything.title(), everything
    for page, x, y, _, size, words_ in PDF_LINES:
        if words_ in ("Zwei Hunde spielen im Park.",):
            continue  # (the second line of a block: the translation flows on from the first)
        near = [r for r in lines[page] if abs(r[0] - x) < 3 and -0.45 * size < r[1] - y < 0.1 * size]
        assert near, f"nothing translated where {words_!r} stood: {lines[page]}"
        if words_.isdigit():
            assert near[0][3].strip() == words_, "a page number stays as it was"
    title = next(r for r in lines[0] if abs(r[1] - 760) < 10)
    body = next(r for r in lines[0] if abs(r[1] - 700) < 8)
    assert title[2] >= 600 > body[2], "the bold title stays bold, the body not"


@pytest.mark.server
@pytest.mark.external
def test_nothing_of_an_upload_is_written_under_its_name(served: str, originals: dict[str, bytes]) -> None:
    name = "Zz-Eindeutiger-Name-73"
    assert upload(served, name + ".pdf", originals["seiten.pdf"]).status_code == 200
    for root in {Path(tempfile.gettempdir()), Path.cwd(), Path.home()}:
        if root == Path.home():
            found = list(root.glob(f"{name}*"))
        else:  # os.walk, not glob: other processes' folders may vanish while it looks (glob raises then)
            found = [Path(d, f) for d, dirs, files in os.walk(root) for f in [*dirs, *files] if f.startswith(name)]
        assert found == [], found


# --- malformed files and bombs -------------------------------------------------------------


def entries(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def zipped(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data, zipfile.ZIP_STORED if name == "mimetype" else zipfile.ZIP_DEFLATED)
    return out.getvalue()


def changed(data: bytes, parts: dict[str, bytes]) -> bytes:
    return zipped({**entries(data), **parts})


ZEROS = {"x/zeros.bin": bytes(20 * 2**20)}  # 20 MiB in ~20 kB
ENTITY = b'<?xml version="1.0"?><!DOCTYPE x [<!ENTITY e SYSTEM "file:///etc/passwd">]><x>&e;</x>'


@functools.cache
def pdf_bomb() -> bytes:
    """A one-page PDF whose content stream inflates to 24 MiB (~1000:1)."""
    from pypdf.generic import DecodedStreamObject

    writer = pypdf.PdfWriter()
    page = writer.add_blank_page(200, 200)
    stream = DecodedStreamObject()
    stream.set_data(b"0 0 m 1 1 l S\n" + b" " * (24 * 2**20))
    page.replace_contents(writer._add_object(stream.flate_encode()))
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


BAD: dict[str, Callable[[dict[str, bytes]], tuple[bytes, str]]] = {
    "a.odt:text": lambda o: (b"Ein Hund.", "invalid_file_content"),
    "a.odt:an odp": lambda o: (o["folien.odp"], "invalid_file_content"),
    "a.odt:no mimetype": lambda o: (
        zipped({k: v for k, v in entries(o["brief.odt"]).items() if k != "mimetype"}),
        "invalid_file_content",
    ),
    "a.odt:broken xml": lambda o: (
        changed(o["brief.odt"], {"content.xml": b"<office:document-content>"}),
        "invalid_file_content",
    ),
    "a.odt:entities": lambda o: (changed(o["brief.odt"], {"content.xml": ENTITY}), "unsafe_file"),
    "a.odt:bomb": lambda o: (zipped({**entries(o["brief.odt"]), **ZEROS}), "unsafe_file"),
    "a.odp:an odt": lambda o: (o["brief.odt"], "invalid_file_content"),
    "a.odp:bomb": lambda o: (zipped({**entries(o["folien.odp"]), **ZEROS}), "unsafe_file"),
    "a.pptx:text": lambda o: (b"%PDF-1.4 nothing", "invalid_file_content"),
    "a.pptx:an odt": lambda o: (o["brief.odt"], "invalid_file_content"),
    "a.pptx:broken slide": lambda o: (
        changed(o["deck.pptx"], {"ppt/slides/slide1.xml": b"<p:sld>"}),
        "invalid_file_content",
    ),
    "a.pptx:bomb": lambda o: (zipped({**entries(o["deck.pptx"]), **ZEROS}), "unsafe_file"),
    "a.epub:an odt": lambda o: (o["brief.odt"], "invalid_file_content"),
    "a.epub:no package": lambda o: (
        changed(o["buch.epub"], {"META-INF/container.xml": b"<container/>"}),
        "invalid_file_content",
    ),
    "a.epub:broken chapter": lambda o: (
        changed(o["buch.epub"], {"EPUB/text/ch001.xhtml": b"<html><p>kaputt"}),
        "invalid_file_content",
    ),
    "a.epub:bomb": lambda o: (zipped({**entries(o["buch.epub"]), **ZEROS}), "unsafe_file"),
    "a.pdf:text": lambda o: (b"Ein Hund.", "invalid_file_content"),
    "a.pdf:truncated": lambda o: (o["seiten.pdf"][: len(o["seiten.pdf"]) // 3], "invalid_file_content"),
    "a.pdf:encrypted": lambda o: (pdf_file(encrypt="geheim"), "invalid_file_content"),
    "a.pdf:stream bomb": lambda o: (pdf_bomb(), "unsafe_file"),
    "a.pdf:lzw": lambda o: (o["seiten.pdf"].replace(b"/FlateDecode", b"/LZWDecode"), "unsafe_file"),
}


@pytest.mark.server
@pytest.mark.external
@pytest.mark.parametrize("case", list(BAD))
def test_malformed_files_and_bombs_are_400(served: str, originals: dict[str, bytes], case: str) -> None:
    data, error_type = BAD[case](originals)
    assert len(data) < 5_000_000
    answer = upload(served, case.split(":")[0], data)
    assert answer.status_code == 400, (answer.status_code, answer.text)
    body = answer.json()
    assert body["error_type"] == error_type and body["error"], body


# --- limits, without a server --------------------------------------------------------------


def test_pages_slides_and_chapters_are_limited(originals: dict[str, bytes]) -> None:
    for name in ("seiten.pdf", "deck.pptx", "folien.odp", "buch.epub"):
        documents.parse(name, originals[name], max_pages=5)
        with pytest.raises(DocumentError, match=r"at most 1\b") as refused:
            documents.parse(name, originals[name], max_pages=1)
        assert refused.value.error_type == "unsafe_file"


def test_pdf_streams_are_limited_like_zip_entries() -> None:
    check_pdf(pdf_file(), ZipLimits())
    bomb = pdf_bomb()
    with pytest.raises(DocumentError, match="compressed") as refused:
        check_pdf(bomb, ZipLimits())
    assert refused.value.error_type == "unsafe_file"
    with pytest.raises(DocumentError, match="inflate to over"):
        check_pdf(bomb, ZipLimits(total_bytes=16 * 2**20))
    check_pdf(bomb, ZipLimits(ratio=10**6))


class Upper:
    """A stand-in translator (``app.formats.markup.Engine``): each text in capitals."""

    async def texts(self, texts: Sequence[str]) -> list[str]:
        return [t.upper() for t in texts]

    async def aligned(self, sentences: Sequence[str]) -> list[Aligned | None]:
        return [None for _ in sentences]


def mutated(data: bytes, rng: random.Random) -> bytes:
    """``data`` cut short, with bytes overwritten, or (a zip) with one XML part garbled."""
    kind = rng.randrange(3)
    if kind == 0:
        return data[: rng.randrange(len(data))]
    if kind == 1 or not data.startswith(b"PK"):
        flipped = bytearray(data)
        for _ in range(rng.randrange(1, 20)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        return bytes(flipped)
    parts = entries(data)
    name = rng.choice([n for n in parts if n.endswith((".xml", ".xhtml", ".opf", ".ncx"))])
    xml = bytearray(parts[name])
    for _ in range(rng.randrange(1, 10)):
        at = rng.randrange(len(xml))
        xml[at : at + rng.randrange(1, 30)] = bytes(rng.choice(b'<>/&"= abc:') for _ in range(rng.randrange(5)))
    return changed(data, {name: bytes(xml)})


def test_damaged_files_are_refused_as_documents_never_crash(originals: dict[str, bytes]) -> None:
    """60 damaged copies of the files (seeded): each is refused with a ``DocumentError`` (the
    route's 400), or read and written back; never another exception (a 500)."""
    rng = random.Random(73)
    refused = 0
    for _ in range(60):
        name = rng.choice(list(originals))
        data = mutated(originals[name], rng)
        try:
            asyncio.run(documents.parse(name, data).translate(Upper()))
        except DocumentError:
            refused += 1
    assert refused >= 30
