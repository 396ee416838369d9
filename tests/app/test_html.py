"""``format: "html"`` through the real app and the shipped de->en model: the text translated,
the markup kept (checked with lxml, the parser the service uses), hostile markup answered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import lxml.html
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from app.settings import Settings
from tests.factories import start


@pytest.fixture(scope="module")
def client(shipped: Path) -> Iterator[TestClient]:
    yield from start(Settings(weights_dir=shipped.parent, max_wait_ms=0, threads=2))


def translate(client: TestClient, q: str | list[str], **extra: object) -> dict:
    response = client.post("/translate", json={"q": q, "source": "de", "target": "en", "format": "html", **extra})
    assert response.status_code == 200, response.text
    return response.json()


def fragment(html: str) -> etree._Element:
    return lxml.html.fragment_fromstring(html, create_parent="div")


def structure(root: etree._Element) -> list[tuple[str, dict[str, str]]]:
    """Elements in document order with their attributes (translated ones left out)."""
    return [
        (el.tag, {k: v for k, v in el.attrib.items() if k not in ("title", "alt", "placeholder")})
        for el in root.iter()
        if isinstance(el.tag, str)
    ]


PAGE = (
    '<h1 title="Ein Hund">Ein Mann fährt Fahrrad.</h1>'
    '<p class="x">Zwei Hunde spielen im Schnee. Ein Kind lacht.</p>'
    '<img src="hund.png" alt="Ein brauner Hund">'
    "<pre>Ein Mann  fährt\n  Fahrrad.</pre>"
    "<p>Code: <code>Ein Mann</code></p>"
    '<p translate="no">Ein Mann fährt Fahrrad.</p>'
    '<p class="notranslate">Eine Frau.</p>'
    '<script>var s = "Ein Mann";</script><style>p { color: red }</style>'
    "<!-- Ein Kommentar -->"
    '<input placeholder="Ein Mann">'
)


def test_text_and_attributes_are_translated_and_the_markup_kept(client: TestClient) -> None:
    out = translate(client, PAGE)["translatedText"]
    before, after = fragment(PAGE), fragment(out)
    assert structure(after) == structure(before)
    assert "man" in after.findtext("h1").lower() and "bicycle" in after.findtext("h1").lower()
    assert "dog" in after.find("h1").get("title").lower()
    assert "dog" in after.find("img").get("alt").lower()
    assert "man" in after.find("input").get("placeholder").lower()
    two_sentences = after.find("p").text_content().lower()
    assert "dogs" in two_sentences and "child" in two_sentences
    # not translated: pre, code, translate="no", notranslate, script, style, comments
    assert after.findtext("pre") == "Ein Mann  fährt\n  Fahrrad."
    assert after.findtext(".//code") == "Ein Mann"
    assert after.findall("p")[2].text == "Ein Mann fährt Fahrrad."
    assert after.findall("p")[3].text == "Eine Frau."
    assert after.findtext("script") == 'var s = "Ein Mann";'
    assert after.findtext("style") == "p { color: red }"
    assert " Ein Kommentar " in [c.text for c in after.iter(etree.Comment)]


def test_inline_tags_stay_around_the_words_they_mark(client: TestClient) -> None:
    html = '<p>Ein <b>roter</b> Hund läuft über die <a href="/wiese">grüne Wiese</a>.</p>'
    out = fragment(translate(client, html)["translatedText"])
    bold, link = out.find(".//b"), out.find(".//a")
    assert "red" in bold.text and "dog" not in bold.text
    assert link.get("href") == "/wiese" and "green" in link.text and "dog" not in link.text
    assert "dog" in out.find("p").text_content()


def test_entities_and_line_breaks_survive(client: TestClient) -> None:
    html = "<p>Ein Hund.<br>Eine Katze &amp; ein Hund.&nbsp;</p>"
    out = translate(client, html)["translatedText"]
    assert "<br>" in out and "&nbsp;" in out
    p = fragment(out).find("p")
    assert p.find("br") is not None
    assert "dog" in (p.text or "").lower()


def test_a_whole_document_keeps_its_doctype_head_and_body(client: TestClient) -> None:
    html = (
        '<!DOCTYPE html><html lang="de"><head><meta charset="utf-8"><title>Ein Hund</title></head>'
        "<body><p>Ein Mann fährt Fahrrad.</p></body></html>"
    )
    out = translate(client, html)["translatedText"]
    assert out.startswith("<!DOCTYPE html>")
    doc = lxml.html.document_fromstring(out)
    assert doc.get("lang") == "de" and doc.find(".//meta").get("charset") == "utf-8"
    assert "dog" in doc.findtext(".//title").lower()
    assert "bicycle" in doc.findtext(".//p").lower()


def test_lists_auto_detection_and_alternatives(client: TestClient) -> None:
    body = translate(client, ["<p>Ein Hund.</p>", "<b>Eine Katze.</b>"], source="auto", alternatives=2)
    assert [d["language"] for d in body["detectedLanguage"]] == ["de", "de"]
    assert body["alternatives"] == [[], []]  # none for HTML, as LibreTranslate answers
    assert fragment(body["translatedText"][1]).find("b") is not None


@pytest.mark.parametrize(
    "html",
    [
        "<p>Ein Hund <b>läuft <i>schnell</b> weg</i>",
        "</div></p>Ein Hund.<<<>>>",
        "<p <b>Ein Hund</b>",
        "<table><td>Ein Hund<tr><p>Eine Katze</table>",
        "&amp;&lt;&#xZZ;&bogus; Ein Hund",
        '<?xml version="1.0" encoding="iso-8859-1"?><html><body>Ein Hund.</body></html>',
        "<!DOCTYPE html>",
        "<!-- nur ein Kommentar -->",
        "<br><br><img src=x>",
        "´Ü\x03\x15=\U0003c078 <p title='a\x03b'>Ein \x0b Hund\x00</p>\ufffe",  # what libxml2 refuses
    ],
)
def test_malformed_html_gets_best_effort_output(client: TestClient, html: str) -> None:
    out = translate(client, html)["translatedText"]
    lxml.html.fragments_fromstring(out) if out.strip() else None  # parses again


tags = st.sampled_from(["p", "b", "i", "a", "div", "span", "code", "br", "img", "script", "li", "ul"])
piece = st.one_of(
    st.sampled_from(["Ein Hund", " läuft. ", "Eine Katze", "&amp;", "&nbsp;", "<", ">", '"', "\n", "ü"]),
    st.sampled_from(["\x00", "\x03", "\ufffe"]),  # not allowed in HTML text
    tags.map(lambda t: f"<{t}>"),
    tags.map(lambda t: f"</{t}>"),
    tags.map(lambda t: f'<{t} title="Ein Hund" translate="no">'),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(piece, min_size=1, max_size=25).map("".join))
def test_any_markup_is_answered_without_a_server_error(client: TestClient, html: str) -> None:
    response = client.post("/translate", json={"q": html, "source": "de", "target": "en", "format": "html"})
    assert response.status_code < 500, response.text
    if response.status_code != 200:  # (only an empty text is refused)
        assert response.json()["error_type"] == "empty_text"
