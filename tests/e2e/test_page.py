"""The translation page at ``/`` in real headless Chromium against one real server (de-en, en-de
and en-fr: de->fr goes through English) that restricts its clients as a public one would: API
keys required (``KEY``; ``TIGHT`` allowed one request a minute), suggestions on, files of at most
2,000 bytes. Typing, swapping, detection, the word alignment, alternatives, a file round trip,
errors in words (a real 429 and 413 among them), keyboard-only use, and axe-core's checks in light
and dark mode at desktop and phone width. One browser and one server for the module.

Screenshots go to ``artifacts/page/`` (``PAGE_ARTIFACTS_DIR``).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlparse

import httpx
import pytest

from tests.e2e import pages
from tests.e2e.pages import DESKTOP, PHONE, TIMEOUT_MS

pytestmark = [pytest.mark.server, pytest.mark.browser, pytest.mark.usefixtures("fused_kernels")]

try:
    from playwright.sync_api import Browser, BrowserContext, Error, Page, Route, ViewportSize, expect

    expect.set_options(timeout=TIMEOUT_MS)
except ImportError:  # the skip (or CI failure) happens in the fixture, with the reason
    pass

EXAMPLE = "Zwei junge Männer spielen Fußball auf einer Wiese."
TWO = f"{EXAMPLE} Ein Hund läuft."
KEY = "open-key"
TIGHT = "tight-key"  # one request a minute
HEADERS = {"X-API-Key": KEY}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    weights = pages.weights_subset(tmp_path_factory.mktemp("weights"), ["de-en", "en-de", "en-fr"])
    with pages.server(
        weights,
        api_keys=KEY,
        api_key_limits=json.dumps({TIGHT: {"req_limit": 1}}),
        suggestions="true",
        data_dir=str(tmp_path_factory.mktemp("data")),
        max_file_bytes="2000",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with pages.chromium() as launched:
        yield launched


def new_context(browser: Browser, server: str, key: str | None = KEY, **options: Any) -> BrowserContext:
    """A fresh browser profile whose page holds ``key`` as a user who typed it once (None: none)."""
    context = browser.new_context(base_url=server, **{"viewport": DESKTOP, **options})
    if key is not None:
        context.add_init_script(f"window.localStorage.setItem('translator.apiKey', {json.dumps(key)})")
    return context


@contextlib.contextmanager
def watched(context: BrowserContext) -> Iterator[Page]:
    """The context's page, closed after the test, which fails on any JavaScript error."""
    opened = context.new_page()
    opened.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    opened.on("pageerror", lambda err: errors.append(str(err)))
    try:
        yield opened
    finally:
        context.close()
    assert not errors, f"JavaScript errors: {errors}"


@pytest.fixture
def page(browser: Browser, server: str) -> Iterator[Page]:
    with watched(new_context(browser, server)) as opened:
        yield opened


def open_page(page: Page, **params: str) -> None:
    """``/`` with these URL parameters; back once it is idle, or translated when ``q`` is given."""
    page.goto("/" + (f"?{urlencode(params)}" if params else ""))
    page.wait_for_selector(f"#app[data-state={'ready' if params.get('q') else 'idle'}]")


def api(url: str, path: str, **body: Any) -> Any:
    response = httpx.post(f"{url}{path}", json=body, headers=HEADERS, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def translation(url: str, q: str, source: str, target: str, **extra: Any) -> dict[str, Any]:
    answer: dict[str, Any] = api(url, "/translate", q=q, source=source, target=target, **extra)
    return answer


def test_typing_translates_with_the_count_and_the_state_in_the_url(page: Page, server: str) -> None:
    open_page(page)
    sent: list[str] = []
    page.on("request", lambda r: sent.append(r.url) if urlparse(r.url).path == "/translate" else None)
    page.locator("#source-text").press_sequentially(EXAMPLE, delay=10)
    expected = translation(server, EXAMPLE, "auto", "en")
    expect(page.locator("#translation")).to_have_text(expected["translatedText"])
    confidence = f"{round(expected['detectedLanguage']['confidence'], 1):g}"
    expect(page.locator("#detected")).to_have_text(f"Detected: German ({confidence} % confidence)")
    assert page.inner_text("#char-count") == f"{len(EXAMPLE)} / 5,000 characters"
    assert 1 <= len(sent) <= 2, f"not debounced: {len(sent)} requests for one burst of typing"
    assert parse_qs(urlparse(page.url).query) == {"source": ["auto"], "target": ["en"], "q": [EXAMPLE]}
    page.reload()  # the URL is the page's state: a shared link opens on the same translation
    page.wait_for_selector("#app[data-state=ready]")
    assert page.input_value("#source-text") == EXAMPLE
    expect(page.locator("#translation")).to_have_text(expected["translatedText"])


def test_an_older_answer_never_replaces_a_newer_one(page: Page, server: str) -> None:
    open_page(page, source="de", target="en")
    held: list[Route] = []

    def hold_the_first(route: Route) -> None:
        if held:
            route.continue_()
        else:
            held.append(route)  # answered only after the newer one

    page.route("**/translate", hold_the_first)
    failed: list[str] = []
    page.on("requestfailed", lambda r: failed.append(r.url) if urlparse(r.url).path == "/translate" else None)
    with page.expect_request("**/translate"):
        page.fill("#source-text", "Ein Hund läuft.")
    newer = "Eine Katze schläft."
    page.fill("#source-text", newer)
    expected = translation(server, newer, "de", "en")["translatedText"]
    expect(page.locator("#translation")).to_have_text(expected)
    assert held, "the first request never went out"
    with contextlib.suppress(Error):  # (the page cancelled it already)
        held[0].continue_()
    page.wait_for_timeout(500)
    expect(page.locator("#translation")).to_have_text(expected)
    assert failed, "the earlier request was not cancelled"


def test_swap_exchanges_the_languages_and_the_texts(page: Page, server: str) -> None:
    source = "Ein Hund läuft."
    open_page(page, source="de", target="en", q=source)
    english = translation(server, source, "de", "en")["translatedText"]
    expect(page.locator("#translation")).to_have_text(english)
    page.click("#swap")
    expect(page.locator("#source")).to_have_value("en")
    expect(page.locator("#target")).to_have_value("de")
    assert page.input_value("#source-text") == english
    expect(page.locator("#translation")).to_have_text(translation(server, english, "en", "de")["translatedText"])
    assert parse_qs(urlparse(page.url).query)["source"] == ["en"]


def test_detection_and_languages_it_cannot_translate_are_said_in_words(page: Page, server: str) -> None:
    open_page(page, source="auto", target="en")
    assert page.eval_on_selector_all("#target option", "os => os.map(o => o.value)") == ["de", "en", "fr"]
    page.fill("#source-text", "Hola, me llamo Juan y vivo en Madrid con mi familia.")
    error = page.locator("#error")
    expect(error).to_have_attribute("data-error-type", "unsupported_language")
    expect(error).to_contain_text("looks like Spanish")
    expect(error).to_contain_text("It translates from German, English")
    page.fill("#source-text", "A man rides a bicycle down the street.")
    expect(error).to_contain_text("already in English")
    page.select_option("#target", "de")
    expect(page.locator("#detected")).to_contain_text("Detected: English")
    expect(error).to_be_hidden()
    # German lists its direct target and French through English (the pivot)
    page.select_option("#source", "de")
    assert page.eval_on_selector_all("#target option", "os => os.map(o => o.value)") == ["en", "fr"]


def test_a_word_of_the_translation_highlights_its_source_words(page: Page, server: str) -> None:
    open_page(page, source="de", target="en", q=TWO)
    maps = api(server, "/attention", q=EXAMPLE, source="de", target="en", level="word", kinds=["cross"])
    expected = {a["target_index"]: a["source_token"] for a in maps["alignment"]}
    words = page.locator("#translation .w[data-s='0']")
    assert words.count() == len(expected)
    for i in range(words.count()):
        words.nth(i).hover()
        expect(page.locator("#backdrop mark.strong")).to_have_text(expected[i])
        expect(page.locator("#align-info")).to_contain_text(f"comes from “{expected[i]}”")
    # selecting words shows the source words of each
    page.mouse.move(0, 0)
    page.evaluate(
        """() => {
            const words = document.querySelectorAll("#translation .w[data-s='0']");
            const range = document.createRange();
            range.setStart(words[1].firstChild, 0);
            range.setEnd(words[2].firstChild, words[2].textContent.length);
            getSelection().removeAllRanges();
            getSelection().addRange(range);
        }"""
    )
    marks = page.locator("#backdrop mark.strong")
    expect(marks).to_have_text([expected[1], expected[2]] if expected[1] != expected[2] else [expected[1]])
    page.evaluate("getSelection().removeAllRanges()")
    expect(marks).to_have_count(0)
    screenshot_path = pages.screenshot(page, "page-alignment.png")
    assert screenshot_path.stat().st_size > 0
    # a click keeps a word chosen; the viewer opens on its sentence
    page.locator("#translation .w[data-s='1']").first.click()
    page.click("#viewer-link")
    page.wait_for_url(re.compile(r"/viewer\?"))
    page.wait_for_selector("#app[data-state=ready]")
    assert page.input_value("#source-text") == "Ein Hund läuft."
    assert page.input_value("#direction") == "de-en"


def test_alignment_through_the_pivot(page: Page, server: str) -> None:
    open_page(page, source="de", target="fr", q="Ein Hund läuft.")
    expected = translation(server, "Ein Hund läuft.", "de", "fr")
    assert expected["translatedText"] == "Un chien court."
    expect(page.locator("#translation")).to_have_text(expected["translatedText"])
    page.locator("#translation .w", has_text="chien").hover()
    expect(page.locator("#backdrop mark.strong")).to_have_text("Hund")


def test_alternatives_when_asked_for(page: Page, server: str) -> None:
    open_page(page, source="de", target="en", q=EXAMPLE)
    expect(page.locator("#alternatives")).to_be_hidden()
    page.check("#want-alternatives")
    expected = translation(server, EXAMPLE, "de", "en", alternatives=3)
    items = page.locator("#alternatives-list li")
    expect(items).to_have_text(expected["alternatives"])
    expect(page.locator("#translation")).to_have_text(expected["translatedText"])


def test_a_text_file_round_trip(page: Page, server: str, tmp_path: Path) -> None:
    open_page(page, source="de", target="en")
    settings = httpx.get(f"{server}/frontend/settings", timeout=10).json()
    assert page.get_attribute("#file-input", "accept") == ",".join(settings["supportedFilesFormat"])
    content = "Ein Hund läuft.\nZwei Männer spielen Fußball auf einer Wiese.\n"
    page.set_input_files("#file-input", files=[pages.text_file("notes.txt", content)])
    link = page.locator("#file-download")
    expect(link).to_be_visible()
    assert page.get_attribute("#file-job", "data-state") == "done"
    assert page.eval_on_selector("#file-progress", "p => p.value") == 1
    with page.expect_download() as download:
        link.click()
    saved = tmp_path / download.value.suggested_filename
    download.value.save_as(saved)
    lines = saved.read_text(encoding="utf-8").splitlines()
    assert lines == [translation(server, line, "de", "en")["translatedText"] for line in content.splitlines()]
    # a dropped file of a kind the server does not take is refused in words, before any upload
    page.evaluate(
        """() => {
            const data = new DataTransfer();
            data.items.add(new File(["x"], "notes.xyz"));
            const drop = new DragEvent("drop", {dataTransfer: data, bubbles: true});
            document.getElementById("dropzone").dispatchEvent(drop);
        }"""
    )
    expect(page.locator("#file-error")).to_contain_text("This kind of file is not supported")
    expect(page.locator("#file-error")).to_contain_text(", ".join(settings["supportedFilesFormat"]))


FAKE_ERRORS = [
    (413, "payload_too_large", "request body larger than 1000000 bytes", "Too large to send"),
    (429, "queue_full", "too busy, retry shortly", "The server is busy"),
    (504, "timeout", "no answer within 30 s", "The translation took too long"),
    (400, "unsupported_language_pair", "no model for de->cs; available: de->en", "No model here translates"),
]


def answering(status: int, body: dict[str, str]) -> Callable[[Route], None]:
    """A route handler that answers with this error (and a Retry-After of 7 s)."""

    def answer(route: Route) -> None:
        route.fulfill(status=status, json=body, headers={"Retry-After": "7"})

    return answer


def test_api_errors_are_shown_in_words(page: Page) -> None:
    open_page(page, source="de", target="en")
    error = page.locator("#error")
    for n, (status, kind, message, words) in enumerate(FAKE_ERRORS):
        body = {"error": message, "error_type": kind, "request_id": "x"}
        page.route("**/translate", answering(status, body))
        page.fill("#source-text", f"Ein Hund läuft {n}.")
        expect(error).to_have_attribute("data-error-type", kind)
        expect(error).to_contain_text(words)
        assert str(status) == error.get_attribute("data-status")
        if status == 429:
            expect(error).to_contain_text(re.compile(r"Try again in [1-7] seconds?\."))
        page.unroute("**/translate")
    # over the character limit: said before anything is sent
    page.fill("#source-text", "a" * 5001)
    expect(error).to_contain_text("5,001 characters; this server takes at most 5,000")
    assert page.get_attribute("#char-count", "data-over") == "true"


def test_keyboard_alone(browser: Browser, server: str) -> None:
    context = new_context(browser, server, permissions=["clipboard-read", "clipboard-write"])
    with watched(context) as page:
        open_page(page, source="de", target="en")
        order = []
        for _ in range(13):
            page.keyboard.press("Tab")
            order.append(page.evaluate("document.activeElement.id"))
        assert order == [
            "viewer-link", "docs-link", "api-key", "source", "swap", "target", "source-text", "clear", "translation",
            "want-alternatives", "suggest-open", "copy", "file-input",
        ]  # fmt: skip
        page.focus("#api-key")
        for _ in range(4):
            page.keyboard.press("Tab")  # source, swap, target, text
        page.keyboard.type("Ein Hund läuft.")
        english = translation(server, "Ein Hund läuft.", "de", "en")["translatedText"]
        expect(page.locator("#translation")).to_have_text(english)
        page.keyboard.press("Shift+Tab")
        page.keyboard.press("Shift+Tab")  # the swap button
        page.keyboard.press("Enter")
        expect(page.locator("#source")).to_have_value("en")
        assert page.input_value("#source-text") == english
        german = translation(server, english, "en", "de")["translatedText"]
        expect(page.locator("#translation")).to_have_text(german)
        for _ in range(4):
            page.keyboard.press("Tab")  # target, text, clear, translation
        assert page.evaluate("document.activeElement.id") == "translation"
        page.keyboard.press("ArrowRight")
        expect(page.locator("#translation .w.active")).to_have_count(1)
        expect(page.locator("#align-info")).to_contain_text("comes from")
        expect(page.locator("#backdrop mark.strong")).not_to_have_count(0)
        page.keyboard.press("End")
        expect(page.locator("#translation .w.active")).to_have_attribute("data-w", re.compile(r"\d+"))
        page.keyboard.press("Tab")
        page.keyboard.press("Space")  # alternatives
        expect(page.locator("#alternatives")).to_be_visible()
        page.keyboard.press("Tab")  # "improve this translation"
        page.keyboard.press("Tab")
        page.keyboard.press("Enter")  # copy
        expect(page.locator("#copy")).to_have_text("Copied")
        assert page.evaluate("navigator.clipboard.readText()") == page.inner_text("#translation")


@pytest.mark.parametrize(
    ("scheme", "viewport"), [("light", DESKTOP), ("dark", PHONE)], ids=["light-desktop", "dark-phone"]
)
def test_no_serious_accessibility_violations(
    browser: Browser, server: str, scheme: pages.Scheme, viewport: ViewportSize
) -> None:
    phone = viewport is PHONE
    context = new_context(browser, server, viewport=viewport, color_scheme=scheme, is_mobile=phone, has_touch=phone)
    with watched(context) as page:
        open_page(page, source="de", target="en", q=TWO)
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == ("rgb(17, 20, 24)" if scheme == "dark" else "rgb(245, 246, 248)")
        page.check("#want-alternatives")
        expect(page.locator("#alternatives-list li")).not_to_have_count(0)
        word = page.locator("#translation .w").nth(2)
        if phone:
            word.tap()
        else:
            word.hover()
        expect(page.locator("#backdrop mark.strong")).not_to_have_count(0)
        assert pages.axe_violations(page) == []
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow}px wider than the window"
        pages.screenshot(page, f"page-{scheme}-{viewport['width']}.png", full_page=True)
        page.select_option("#source", "auto")
        page.fill("#source-text", "Hola, me llamo Juan y vivo en Madrid con mi familia.")
        expect(page.locator("#error")).to_be_visible()
        assert pages.axe_violations(page) == []  # with an error shown


def test_a_required_key_is_asked_for(browser: Browser, server: str) -> None:
    with watched(new_context(browser, server, key=None)) as page:
        open_page(page, source="de", target="en")
        expect(page.locator("#api-key")).to_be_visible()
        assert page.inner_text("label[for=api-key]") == "API key (required)"
        page.fill("#source-text", "Ein Hund läuft.")
        error = page.locator("#error")
        expect(error).to_contain_text("An API key is needed")
        expect(page.locator("#api-key")).to_be_focused()
        page.keyboard.type(KEY)
        page.keyboard.press("Enter")
        expect(page.locator("#translation")).to_have_text("A dog is running.")
        expect(error).to_be_hidden()


def test_a_rate_limit_is_shown_with_its_wait(browser: Browser, server: str) -> None:
    with watched(new_context(browser, server, key=TIGHT)) as page:
        open_page(page, source="de", target="en")  # nothing to translate yet: the key's one request is left
        page.fill("#source-text", "Ein Hund läuft.")
        expect(page.locator("#translation")).to_have_text("A dog is running.")
        page.fill("#source-text", "Eine Katze schläft.")
        error = page.locator("#error")
        expect(error).to_have_attribute("data-status", "429")
        expect(error).to_contain_text("Too many requests")
        expect(error).to_contain_text("this server allows 1 request per minute")
        text = error.inner_text()
        wait = int(re.search(r"Try again in (\d+) seconds?\.", text).group(1))  # type: ignore[union-attr]
        assert 1 <= wait <= 60, text
        expect(error).to_have_attribute("data-wait", str(wait - 1), timeout=3_000)  # counting down
        expect(page.locator("#translation")).to_have_text("")  # not the earlier text's translation
        pages.screenshot(page, "page-429.png")


def test_a_suggestion_is_sent(page: Page) -> None:
    open_page(page, source="de", target="en", q="Ein Hund läuft.")
    expect(page.locator("#translation")).to_have_text("A dog is running.")
    page.click("#suggest-open")
    expect(page.locator("#suggestion")).to_be_focused()
    expect(page.locator("#suggestion")).to_have_value("A dog is running.")
    page.fill("#suggestion", "A dog runs.")
    page.click("#suggest-send")
    expect(page.locator("#align-info")).to_have_text("Thank you: your translation was saved.")
    expect(page.locator("#suggest-form")).to_be_hidden()


def test_a_file_over_the_limit_is_refused_in_words(page: Page) -> None:
    open_page(page, source="de", target="en")
    big = "Ein Hund läuft über die Wiese.\n" * 100
    page.set_input_files("#file-input", files=[pages.text_file("long.txt", big)])
    error = page.locator("#file-error")
    expect(error).to_have_attribute("data-status", "413")
    expect(error).to_contain_text("The file is too large")
    expect(error).to_contain_text("up to 2 kB")
