"""The attention viewer (``/viewer``) in real headless Chromium against a real uvicorn process of the app.

Needs the ``playwright`` Python package and Debian's ``chromium`` (never ``playwright install``).
Without them the tests skip, except under CI=true, where they fail. Screenshots go to
``artifacts/viewer/`` (override with ``VIEWER_ARTIFACTS_DIR``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import ROOT, SHIPPED, free_port, require, stop, wait_ready

pytestmark = [pytest.mark.server, pytest.mark.browser, pytest.mark.usefixtures("fused_kernels")]

try:
    from playwright.sync_api import Browser, Page, ViewportSize, sync_playwright
except ImportError:  # the skip (or CI failure) happens in the fixture, with the reason
    sync_playwright = None  # type: ignore[assignment]

CHROMIUM = Path(os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(os.environ.get("VIEWER_ARTIFACTS_DIR", ROOT / "artifacts" / "viewer"))
EXAMPLE = "Zwei junge Männer spielen Fußball auf einer Wiese."
DESKTOP: ViewportSize = {"width": 1280, "height": 800}
PHONE: ViewportSize = {"width": 390, "height": 844}
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def server(tiny_weights_dir: Path) -> Iterator[str]:
    """``uvicorn app.main:app`` on a free port, serving weights/de-en when present, else a tiny checkpoint."""
    weights = SHIPPED.parent if SHIPPED.is_dir() else tiny_weights_dir
    port = free_port()
    env = {**os.environ, "TRANSLATOR_WEIGHTS_DIR": str(weights), "TRANSLATOR_THREADS": "2"}
    command = [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, 120.0, log)
            yield url
        finally:
            stop(proc)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    require(sync_playwright is not None, "the playwright package is not installed (pip install playwright)")
    require(CHROMIUM.is_file(), f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM_PATH)")
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors: {errors}"


def attention_json(url: str, **extra: Any) -> dict[str, Any]:
    body = {"q": EXAMPLE, "source": "de", "target": "en", "beam_size": 4, **extra}
    response = httpx.post(f"{url}/attention", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def open_viewer(page: Page, url: str) -> None:
    page.goto(url + "/viewer")
    page.wait_for_selector("#app[data-state=ready]", timeout=TIMEOUT_MS)


def shape(page: Page, selector: str = "canvas.heatmap") -> tuple[int, int]:
    canvas = page.locator(selector).first
    return int(canvas.get_attribute("data-rows") or -1), int(canvas.get_attribute("data-cols") or -1)


def drawing(page: Page) -> str:
    return str(page.eval_on_selector("canvas.heatmap", "c => c.toDataURL()"))


def screenshot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path))
    assert path.stat().st_size > 0
    return path


def test_example_loads_with_translation_and_heatmap(page: Page, server: str) -> None:
    open_viewer(page, server)
    expected = attention_json(server)
    assert page.inner_text("#translation") == expected["translatedText"]
    panels = page.locator("#heatmaps .panel")
    assert panels.count() == expected["n_heads"]  # "all heads" is the default
    assert [panels.nth(i).get_attribute("data-head") for i in range(panels.count())] == [
        str(h) for h in expected["heads"]
    ]
    for i in range(panels.count()):
        assert shape(page, f"#heatmaps .panel:nth-child({i + 1}) canvas.heatmap") == (
            len(expected["target_tokens"]),
            len(expected["source_tokens"]),
        )
    screenshot(page, "viewer-1280x800.png")


def test_switching_kind_layer_and_head_redraws_without_refetching(page: Page, server: str) -> None:
    open_viewer(page, server)
    expected = attention_json(server)
    fetched: list[str] = []
    page.on("request", lambda request: fetched.append(request.url) if "/attention" in request.url else None)

    page.select_option("#head", "0")
    assert page.locator("canvas.heatmap").count() == 1
    assert page.get_attribute("canvas.heatmap", "data-head") == "0"
    head0 = drawing(page)
    page.select_option("#head", "1")
    assert page.get_attribute("canvas.heatmap", "data-head") == "1"
    assert drawing(page) != head0

    page.select_option("#layer", str(expected["layers"][-1]))
    assert page.get_attribute("#heatmaps", "data-layer") == str(expected["layers"][-1])
    page.check("#kind-encoder")
    assert shape(page) == (len(expected["source_tokens"]), len(expected["source_tokens"]))
    assert page.is_disabled("#show-alignment")
    page.check("#kind-decoder")
    assert shape(page) == (len(expected["target_tokens"]), len(expected["target_input_tokens"]))
    assert fetched == []


def test_alignment_toggle_marks_the_cross_map(page: Page, server: str) -> None:
    open_viewer(page, server)
    page.select_option("#head", "0")
    plain = drawing(page)
    page.check("#show-alignment")
    assert drawing(page) != plain
    page.uncheck("#show-alignment")
    assert drawing(page) == plain


def test_hover_shows_tokens_and_weight(page: Page, server: str) -> None:
    open_viewer(page, server)
    expected = attention_json(server)
    page.select_option("#head", "2")
    canvas = page.locator("canvas.heatmap")
    cell = float(canvas.get_attribute("data-cell") or 0)
    origin_x = float(canvas.get_attribute("data-origin-x") or 0)
    row, col = 1, len(expected["source_tokens"]) - 2
    canvas.hover(position={"x": origin_x + (col + 0.5) * cell, "y": (row + 0.5) * cell})
    tooltip = page.locator("#tooltip")
    tooltip.wait_for(state="visible")
    assert tooltip.locator("[data-role=query]").inner_text() == expected["target_tokens"][row]
    assert tooltip.locator("[data-role=key]").inner_text() == expected["source_tokens"][col]
    weight = expected["attention"]["cross"][0][2][row][col]
    assert float(tooltip.locator("[data-role=weight]").inner_text()) == pytest.approx(weight, abs=1e-4)
    screenshot(page, "viewer-tooltip.png")
    page.mouse.move(1, 1)
    tooltip.wait_for(state="hidden")


def test_word_level_refetches_and_draws_words(page: Page, server: str) -> None:
    open_viewer(page, server)
    expected = attention_json(server, level="word")
    page.select_option("#level", "word")
    page.wait_for_selector("#heatmaps[data-level=word]", timeout=TIMEOUT_MS)
    assert shape(page) == (len(expected["target_tokens"]), len(expected["source_tokens"]))
    assert page.inner_text("#translation") == expected["translatedText"]


def test_api_errors_are_shown(page: Page, server: str) -> None:
    open_viewer(page, server)
    page.fill("#source-text", "   ")
    page.click("#translate-button")
    page.wait_for_selector("#app[data-state=error]", timeout=TIMEOUT_MS)
    error = page.locator("#error")
    assert error.is_visible()
    assert "400" in error.inner_text() and error.get_attribute("data-error-type")
    screenshot(page, "viewer-error.png")


def test_phone_layout_fits_the_screen(browser: Browser, server: str) -> None:
    context = browser.new_context(viewport=PHONE, device_scale_factor=2, is_mobile=True, has_touch=True)
    page = context.new_page()
    try:
        open_viewer(page, server)
        overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow}px wider than a phone screen"
        widest = page.evaluate(
            "() => Math.max(...[...document.querySelectorAll('canvas.heatmap')]"
            ".map(c => c.getBoundingClientRect().right))"
        )
        assert widest <= PHONE["width"]
        screenshot(page, "viewer-390x844.png")
        canvas = page.locator("canvas.heatmap").first
        canvas.scroll_into_view_if_needed()
        cell = float(canvas.get_attribute("data-cell") or 0)
        origin_x = float(canvas.get_attribute("data-origin-x") or 0)
        canvas.tap(position={"x": origin_x + cell / 2, "y": cell / 2})
        page.locator("#tooltip").wait_for(state="visible")  # stays after the finger lifts
        expected = attention_json(server)
        assert page.inner_text("#tooltip [data-role=query]") == expected["target_tokens"][0]
        assert page.inner_text("#tooltip [data-role=key]") == expected["source_tokens"][0]
        page.screenshot(path=str(ARTIFACTS / "viewer-390x844-full.png"), full_page=True)
    finally:
        context.close()
