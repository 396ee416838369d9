"""LibreTranslate's document routes, POST /translate_file and GET /download_file/{name}, through
the real app with the tiny de->en checkpoint (it translates badly: structure is checked, with
each format's own parser, never wording), and what a hostile upload or download gets."""

from __future__ import annotations

import io
import time
import zipfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import docx
import lxml.html
import pytest
import srt
from fastapi.testclient import TestClient

from app.formats.documents import DocumentError, ZipLimits, check_zip
from app.http.uploads import FORM_OVERHEAD
from app.serving.translate import safe_filename
from app.settings import Settings
from tests.factories import assert_error, start

MAX_FILE = 100_000
KEPT = 4
CHAR_LIMIT = 3000
QUEUE = 40
GERMAN = "Ein Mann fährt mit dem Fahrrad über die Brücke. Zwei Hunde spielen im Park."


@pytest.fixture(scope="module")
def client(tiny_weights_dir: Path) -> Iterator[TestClient]:
    settings = Settings(
        weights_dir=tiny_weights_dir,
        max_file_bytes=MAX_FILE,
        file_results_max=KEPT,
        char_limit=CHAR_LIMIT,
        queue_size=QUEUE,
        max_wait_ms=0,
    )
    yield from start(settings)


def upload(client: TestClient, filename: str, data: bytes, source: str = "de", **fields: str) -> Any:
    form = {"source": source, "target": "en", **fields}
    return client.post("/translate_file", files={"file": (filename, data)}, data=form)


def translated(client: TestClient, filename: str, data: bytes, **fields: str) -> Any:
    """The download of the file's translation (checked to be one)."""
    answer = upload(client, filename, data, **fields)
    assert answer.status_code == 200, answer.text
    url = answer.json()["translatedFileUrl"]
    assert url.startswith("http://testserver/download_file/")
    download = client.get(url)
    assert download.status_code == 200, download.text
    return download


def word_file(build: Any = None) -> bytes:
    document = docx.Document()
    if build is not None:
        build(document)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def report(document: Any) -> None:
    document.sections[0].header.paragraphs[0].text = "Der Bericht über Hunde."
    document.sections[0].footer.paragraphs[0].text = "Seite eins."
    document.add_heading("Hunde im Park", level=1)
    mixed = document.add_paragraph("Ein Mann sieht ")
    mixed.add_run("zwei große Hunde").bold = True
    mixed.add_run(" im Park.")
    document.add_paragraph().add_run("Dieser Satz ist fett.").bold = True
    breaks = document.add_paragraph("Erste Zeile.")
    breaks.add_run().add_break()
    breaks.add_run("Zweite Zeile.")
    table = document.add_table(rows=2, cols=2)
    for i, text in enumerate(["Ein Hund.", "Eine Katze.", "Zwei Kinder spielen.", ""]):
        table.cell(i // 2, i % 2).text = text
    document.add_paragraph("")


def test_docx_keeps_paragraphs_tables_headers_and_bold_runs(client: TestClient) -> None:
    download = translated(client, "Bericht.docx", word_file(report))
    assert download.headers["content-type"] == (
        "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
    )
    before, after = docx.Document(io.BytesIO(word_file(report))), docx.Document(io.BytesIO(download.content))
    assert len(after.paragraphs) == len(before.paragraphs) and len(after.tables) == len(before.tables) == 1
    assert [p._p.style for p in after.paragraphs] == [p._p.style for p in before.paragraphs]
    cells = [[c.text for c in row.cells] for row in after.tables[0].rows]
    assert len(cells) == 2 and all(len(row) == 2 for row in cells) and cells[1][1] == ""
    assert all(cells[0]) and cells[1][0]
    mixed, bold, breaks = after.paragraphs[1], after.paragraphs[2], after.paragraphs[3]
    assert any(run.bold for run in mixed.runs if run.text.strip()), "the bold words stay bold"
    assert all(run.bold for run in bold.runs if run.text.strip()) and bold.text.strip()
    assert breaks.text.count("\n") == 1, "the line break is kept"
    section = after.sections[0]
    assert section.header.paragraphs[0].text.strip() and section.footer.paragraphs[0].text.strip()
    assert section.header.paragraphs[0].text != "Der Bericht über Hunde."  # (translated, however badly)


NS = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"


def test_docx_hyperlinks_fields_and_tabs_are_kept(client: TestClient) -> None:
    def linked(document: Any) -> None:
        paragraph = document.add_paragraph("Siehe ")
        paragraph._p.append(
            docx.oxml.parse_xml(f'<w:hyperlink {NS} w:anchor="x"><w:r><w:t>den Park</w:t></w:r></w:hyperlink>')
        )
        paragraph.add_run(" hier.")
        field = document.add_paragraph("Seite ")
        for xml in [
            '<w:fldChar w:fldCharType="begin"/>',
            '<w:instrText xml:space="preserve"> PAGE </w:instrText>',
            '<w:fldChar w:fldCharType="separate"/>',
            "<w:t>3</w:t>",
            '<w:fldChar w:fldCharType="end"/>',
        ]:
            field._p.append(docx.oxml.parse_xml(f"<w:r {NS}>{xml}</w:r>"))
        field.add_run(" von fünf, mit einem Hund.")
        tab = document.add_paragraph("Name:")
        tab.add_run().add_tab()
        tab.add_run("Ein großer Hund.")

    after = docx.Document(io.BytesIO(translated(client, "link.docx", word_file(linked)).content))
    links = after.paragraphs[0]._p.findall(W + "hyperlink")
    assert len(links) == 1 and links[0].get(W + "anchor") == "x" and links[0].findall(W + "r")
    field = after.paragraphs[1]._p
    order = [el.get(W + "fldCharType") or el.text for el in field.iter(W + "fldChar", W + "instrText", W + "t")]
    start = order.index("begin")
    assert order[start : start + 5] == ["begin", " PAGE ", "separate", "3", "end"], order  # one piece, in order
    assert len(after.paragraphs[2]._p.findall(f"{W}r/{W}tab")) == 1


def test_txt_keeps_its_line_layout_and_bom(client: TestClient) -> None:
    text = f"{GERMAN}\n\nDie Sonne scheint.\n   Ein Kind lacht laut.\r\nEnde.\n"
    download = translated(client, "notizen.txt", ("\ufeff" + text).encode())
    assert download.headers["content-type"] == "text/plain; charset=utf-8"
    out = download.content.decode("utf-8")
    assert out.startswith("\ufeff") and not out.startswith("\ufeff\ufeff")
    lines, source = out[1:].split("\n"), text.split("\n")
    assert len(lines) == len(source)
    assert [not line.strip() for line in lines] == [not line.strip() for line in source]
    assert lines[3].startswith("   ") and lines[3].endswith("\r") and out.endswith("\n")


def test_html_keeps_its_elements(client: TestClient) -> None:
    page = (
        "<!DOCTYPE html><html><head><title>Hunde</title></head><body><h1>Hunde im Park</h1>"
        '<p class="x">Ein Mann sieht <b>zwei Hunde</b>.</p><ul><li>Eins.</li><li>Zwei.</li></ul>'
        "<script>var x = 1;</script></body></html>"
    )
    download = translated(client, "seite.html", page.encode())
    assert download.headers["content-type"] == "text/html; charset=utf-8"

    def elements(markup: bytes) -> list[tuple[str, dict[str, str]]]:
        return [
            (el.tag, dict(el.attrib)) for el in lxml.html.document_fromstring(markup).iter() if isinstance(el.tag, str)
        ]

    assert elements(download.content) == elements(page.encode())
    assert b"var x = 1;" in download.content
    assert translated(client, "seite.HTM", b"<p>Ein Hund.</p>").headers["content-type"].startswith("text/html")


SUBTITLES = """1
00:00:01,000 --> 00:00:03,500
Ein Mann fährt mit dem Fahrrad
über die große Brücke.

2
00:00:04,000 --> 00:00:06,250
Zwei Hunde spielen.

3
00:01:02,003 --> 00:01:04,000
♪

"""


def test_srt_keeps_indices_timings_and_line_counts(client: TestClient) -> None:
    download = translated(client, "film.srt", SUBTITLES.encode())
    assert download.headers["content-type"] == "application/x-subrip; charset=utf-8"
    before, after = list(srt.parse(SUBTITLES)), list(srt.parse(download.content.decode("utf-8")))
    assert [(s.index, s.start, s.end) for s in after] == [(s.index, s.start, s.end) for s in before]
    assert after[1].start == timedelta(seconds=4) and after[2].content == "♪"
    for old, new in zip(before[:2], after[:2], strict=True):
        lines = new.content.split("\n")
        assert len(lines) == min(len(old.content.split("\n")), len(new.content.split())) and all(lines)


def test_auto_source_detects_the_documents_language(client: TestClient) -> None:
    answer = upload(client, "a.txt", f"{GERMAN} Die Kinder essen Eis.".encode(), source="auto")
    assert answer.status_code == 200, answer.text
    detected = answer.json()["detectedLanguage"]
    assert detected["language"] == "de" and detected["confidence"] > 50
    assert "detectedLanguage" not in upload(client, "a.txt", GERMAN.encode()).json()


def test_download_headers_and_a_path_like_file_name(client: TestClient) -> None:
    answer = upload(client, "../../etc/passwd.txt", GERMAN.encode())
    assert answer.status_code == 200, answer.text
    name = answer.json()["translatedFileUrl"].rsplit("/", 1)[-1]
    assert name.endswith(".txt") and "passwd" not in name and ".." not in name and len(name) > 30
    download = client.get(f"/download_file/{name}")
    assert download.headers["content-disposition"] == (
        "attachment; filename=\"passwd.txt\"; filename*=UTF-8''passwd.txt"
    )
    assert download.headers["x-content-type-options"] == "nosniff" and "no-store" in download.headers["cache-control"]
    odd = upload(client, "C:\\Users\\x\\Bericht <neu>?.txt", GERMAN.encode()).json()["translatedFileUrl"]
    disposition = client.get(odd).headers["content-disposition"]
    assert disposition == "attachment; filename=\"Bericht _neu.txt\"; filename*=UTF-8''Bericht%20_neu.txt"
    assert not Path("/etc/passwd.txt").exists()


@pytest.mark.parametrize(
    ("given", "safe"),
    [
        ("../../etc/passwd.txt", "passwd.txt"),
        ('a "b"\r\nContent-Type: x.TXT', "a _b_Content-Type_ x.txt"),
        ("..\\..\\boot.ini.txt", "boot.ini.txt"),
        ("....txt", "document.txt"),
        ("Übersicht – Straße.txt", "Übersicht _ Straße.txt"),
    ],
)
def test_file_names_are_sanitized(given: str, safe: str) -> None:
    assert safe_filename(given, ".txt") == safe


def test_unknown_and_dotted_download_names_are_json_404s(client: TestClient) -> None:
    # ("/download_file/.." itself the client resolves to "/": the path never says "..")
    for path in ["/download_file/unknown.txt", "/download_file/..%2F..%2Fetc%2Fpasswd", "/download_file/%2E%2E",
                 "/download_file/...txt", "/download_file/a..b"]:  # fmt: skip
        body = assert_error(client.get(path), 404, "not_found")
        assert body["request_id"]


def test_an_expired_result_is_gone(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    url = upload(client, "a.txt", GERMAN.encode()).json()["translatedFileUrl"]
    assert client.get(url).status_code == 200
    store = client.app.state.translator.files  # type: ignore[attr-defined]
    later = time.monotonic() + store.ttl_s + 1
    monkeypatch.setattr(store, "clock", lambda: later)
    assert_error(client.get(url), 404, "not_found")


def test_the_store_keeps_the_newest_files(client: TestClient) -> None:
    urls = [upload(client, f"{n}.txt", f"Ein Hund Nummer {n}.".encode()).json()["translatedFileUrl"] for n in range(6)]
    assert [client.get(url).status_code for url in urls] == [404, 404] + [200] * KEPT


@pytest.mark.parametrize(
    ("filename", "data", "error_type"),
    [
        ("bild.txt", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01", "invalid_file_content"),
        ("text.txt", b"Ein Hund.\x00", "invalid_file_content"),
        ("latin.txt", "Ein Hund läuft.".encode("latin-1"), "invalid_file_content"),
        ("word.srt", word_file(report), "invalid_file_content"),
        ("kaputt.srt", b"Ein Hund.\n00:00 -> 00:01\n", "invalid_file_content"),
        ("text.docx", GERMAN.encode(), "invalid_file_content"),
        ("programm.exe", b"MZ\x90\x00", "unsupported_file_format"),
        ("ohne_endung", GERMAN.encode(), "unsupported_file_format"),
        ("leer.txt", b" \n\n ", "empty_document"),
    ],
)
def test_content_must_match_the_format(client: TestClient, filename: str, data: bytes, error_type: str) -> None:
    assert_error(upload(client, filename, data), 400, error_type)


def zip_file(entries: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return out.getvalue()


def test_zip_bombs_and_other_archives_are_refused_before_opening(client: TestClient) -> None:
    with zipfile.ZipFile(io.BytesIO(word_file(report))) as archive:
        real = {name: archive.read(name) for name in archive.namelist()}
    bomb = zip_file({**real, "word/media/zeros.bin": bytes(20 * 2**20)})  # 20 MiB of zeros in ~20 kB
    assert len(bomb) < MAX_FILE
    assert "compressed" in assert_error(upload(client, "bombe.docx", bomb), 400, "unsafe_file")["error"]
    not_word = zip_file({"hallo.txt": b"Hallo"})
    assert "word/document.xml" in assert_error(upload(client, "a.docx", not_word), 400, "invalid_file_content")["error"]
    broken = zip_file({**real, "word/document.xml": b"<w:document>kaputt"})
    assert_error(upload(client, "kaputt.docx", broken), 400, "invalid_file_content")


def test_zip_limits_count_entries_size_and_ratio_from_the_directory() -> None:
    with zipfile.ZipFile(io.BytesIO(word_file())) as archive:
        real = {name: archive.read(name) for name in archive.namelist()}
    check_zip(zip_file(real), ZipLimits())
    cases = [
        ({f"x/{i}": b"" for i in range(30)}, ZipLimits(entries=len(real) + 29), "entries"),
        ({"x/big": bytes(3 * 2**20)}, ZipLimits(total_bytes=3 * 2**20), "unpacks to"),
        ({"word/big.xml": b"<a/>" * 2**18}, ZipLimits(xml_bytes=2**20), "of XML"),
        ({"x/big": bytes(3 * 2**20)}, ZipLimits(ratio=100), "compressed"),
        ({"x/small": bytes(2**19)}, ZipLimits(ratio=100), None),  # a small entry may compress well
    ]
    for extra, limits, message in cases:
        if message is None:
            check_zip(zip_file({**real, **extra}), limits)
            continue
        with pytest.raises(DocumentError, match=message) as refused:
            check_zip(zip_file({**real, **extra}), limits)
        assert refused.value.error_type == "unsafe_file"


def test_a_file_over_the_limit_is_413(client: TestClient) -> None:
    just_over = ("Ein Hund.\n" * (MAX_FILE // 10 + 1)).encode()
    assert_error(upload(client, "gross.txt", just_over), 413, "file_too_large")  # stopped while reading
    far_over = b"x" * (MAX_FILE + FORM_OVERHEAD + 1)
    assert_error(upload(client, "riesig.txt", far_over), 413, "payload_too_large")  # by Content-Length
    assert upload(client, "a.txt", GERMAN.encode()).status_code == 200  # (above TRANSLATOR_MAX_BODY_BYTES's
    # default would be refused for any other route; the file limit is the upload's)


def test_the_text_counts_against_the_character_limit_and_the_queue(client: TestClient) -> None:
    long = ("Ein Mann fährt mit dem Fahrrad über die Brücke. " * 70).encode()
    assert len(long.decode()) > CHAR_LIMIT
    assert_error(upload(client, "lang.txt", long), 400, "too_many_characters")
    many = ("Ein Hund. " * (QUEUE + 1)).encode()
    assert_error(upload(client, "saetze.txt", many), 413, "too_many_sentences")


def test_the_form_is_checked(client: TestClient) -> None:
    no_file = client.post("/translate_file", data={"source": "de", "target": "en"}, files={"x": ("a", b"")})
    assert_error(no_file, 400, "validation_error")
    no_target = client.post("/translate_file", files={"file": ("a.txt", b"Hallo.")}, data={"source": "de"})
    assert "target" in assert_error(no_target, 400, "validation_error")["error"]
    assert_error(client.post("/translate_file", json={"source": "de"}), 415, "unsupported_media_type")
    query = client.post("/translate_file?source=de&target=en", files={"file": ("a.txt", GERMAN.encode())})
    assert query.status_code == 200, query.text  # parameters in the query string, as LibreTranslate reads them
    assert_error(upload(client, "a.txt", b"Hallo.", source="fr"), 400, "unsupported_language_pair")
    big_field = client.post("/translate_file", files={"file": ("a.txt", b"Hallo.")}, data={"source": "x" * 5000})
    assert_error(big_field, 400, "invalid_multipart")


def test_api_keys_are_checked_as_for_every_route(tiny_weights_dir: Path) -> None:
    for client in start(Settings(weights_dir=tiny_weights_dir, api_keys=["geheim"])):
        assert_error(upload(client, "a.txt", GERMAN.encode()), 403, "forbidden")
        assert_error(upload(client, "a.txt", GERMAN.encode(), api_key="falsch"), 403, "forbidden")
        assert upload(client, "a.txt", GERMAN.encode(), api_key="geheim").status_code == 200
        header = client.post(
            "/translate_file",
            files={"file": ("a.txt", GERMAN.encode())},
            data={"source": "de", "target": "en"},
            headers={"X-API-Key": "geheim"},
        )
        assert header.status_code == 200, header.text


def test_frontend_settings_and_the_schema_announce_files(client: TestClient) -> None:
    settings = client.get("/frontend/settings").json()
    assert settings["filesTranslation"] is True
    assert settings["supportedFilesFormat"] == [
        *[".txt", ".html", ".htm", ".srt", ".docx"],
        *[".odt", ".odp", ".pptx", ".epub", ".pdf"],  # (tests/app/test_documents.py)
    ]
    paths = client.get("/openapi.json").json()["paths"]
    form = paths["/translate_file"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["file", "source", "target"] and form["properties"]["file"]["format"] == "binary"
    assert form["properties"]["source"]["enum"] == ["auto", "de"]
    download = paths["/download_file/{name}"]["get"]["responses"]
    assert "application/x-subrip" in download["200"]["content"] and "404" in download


def test_with_redis_storage_any_replica_answers_the_download(tiny_weights_dir: Path, redis_url: str) -> None:
    """Two app instances (two replicas) sharing one real redis-server: a file translated by one
    is downloaded from the other; the newest KEPT are kept; an unknown name is still a 404."""
    settings = Settings(weights_dir=tiny_weights_dir, file_results_storage=redis_url, file_results_max=KEPT)
    first, second = start(settings), start(settings)
    one, other = next(first), next(second)
    try:
        urls = [upload(one, f"{n}.txt", f"Ein Hund Nummer {n}.".encode()).json()["translatedFileUrl"] for n in range(6)]
        got = [other.get(url) for url in urls]
        assert [r.status_code for r in got] == [404, 404] + [200] * KEPT
        assert got[-1].headers["content-disposition"].startswith('attachment; filename="5.txt"')
        assert got[-1].text.strip()
        assert_error(other.get("/download_file/unknown.txt"), 404, "not_found")
    finally:
        first.close()
        second.close()


def test_an_unreachable_file_store_is_a_503_not_a_500(tiny_weights_dir: Path) -> None:
    from bench.server import free_port

    clients = start(Settings(weights_dir=tiny_weights_dir, file_results_storage=f"redis://127.0.0.1:{free_port()}"))
    client = next(clients)
    try:
        assert_error(upload(client, "a.txt", GERMAN.encode()), 503, "storage_unavailable")
        assert_error(client.get("/download_file/a.txt"), 503, "storage_unavailable")
    finally:
        clients.close()
