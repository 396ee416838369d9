"""The translation page against a server that restricts its clients: API keys required, one key
allowed a single request a minute, suggestions on, files of at most 2,000 bytes (de-en only).
One browser and one server for the module; the open server's tests are test_page.py's."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from urllib.parse import urlencode

import pytest

from tests.e2e import pages
from tests.e2e.pages import DESKTOP, TIMEOUT_MS

pytestmark = [pytest.mark.server, pytest.mark.browser, pytest.mark.usefixtures("fused_kernels")]

try:
    from playwright.sync_api import Browser, Page, expect

    expect.set_options(timeout=TIMEOUT_MS)
except ImportError:  # the skip (or CI failure) happens in the fixture, with the reason
    pass

KEY = "open-key"
TIGHT = "tight-key"  # one request a minute


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    weights = pages.weights_subset(tmp_path_factory.mktemp("weights"), ["de-en"])
    limits = {TIGHT: {"req_limit": 1}}
    data = tmp_path_factory.mktemp("data")
    with pages.server(
        weights,
        api_keys=KEY,
        api_key_limits=json.dumps(limits),
        suggestions="true",
        data_dir=str(data),
        max_file_bytes="2000",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with pages.chromium() as launched:
        yield launched


@pytest.fixture
def page(browser: Browser, server: str) -> Iterator[Page]:
    context = browser.new_context(viewport=DESKTOP, base_url=server)
    opened = context.new_page()
    opened.set_default_timeout(TIMEOUT_MS)
    yield opened
    context.close()


def open_page(page: Page, key: str = "", **params: str) -> None:
    page.goto("/?" + urlencode({"source": "de", "target": "en", **params}))
    page.wait_for_selector("#app:not([data-state=loading])")
    if key:
        page.fill("#api-key", key)
        page.press("#api-key", "Enter")


def test_a_required_key_is_asked_for(page: Page) -> None:
    open_page(page)
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
    assert pages.axe_violations(page) == []  # with the key field and the suggestion button shown


def test_a_rate_limit_is_shown_with_its_wait(page: Page) -> None:
    open_page(page, key=TIGHT)  # the key's one request: translating nothing costs none
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
    pages.screenshot(page, "page-429.png")


def test_a_suggestion_is_sent(page: Page) -> None:
    open_page(page, key=KEY, q="Ein Hund läuft.")
    expect(page.locator("#translation")).to_have_text("A dog is running.")
    page.click("#suggest-open")
    expect(page.locator("#suggestion")).to_be_focused()
    expect(page.locator("#suggestion")).to_have_value("A dog is running.")
    page.fill("#suggestion", "A dog runs.")
    page.click("#suggest-send")
    expect(page.locator("#align-info")).to_have_text("Thank you: your translation was saved.")
    expect(page.locator("#suggest-form")).to_be_hidden()


def test_a_file_over_the_limit_is_refused_in_words(page: Page) -> None:
    open_page(page, key=KEY)
    big = "Ein Hund läuft über die Wiese.\n" * 100
    page.set_input_files("#file-input", files=[pages.text_file("long.txt", big)])
    error = page.locator("#file-error")
    expect(error).to_have_attribute("data-status", "413")
    expect(error).to_contain_text("The file is too large")
    expect(error).to_contain_text("up to 2 kB")
