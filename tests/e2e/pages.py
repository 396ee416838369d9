"""Helpers for the browser tests of the pages (a plain module: the test modules import it):
Debian's Chromium through Playwright, a real server on a chosen subset of the shipped weights,
and axe-core (the copy the ``axe-playwright-python`` package bundles) run inside a page.

Never ``playwright install``: the browser is the system's (``CHROMIUM_PATH`` overrides it).
Without Playwright, Chromium or the package the tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tests.helpers import ROOT, SHIPPED, free_port, require, stop, wait_ready

if TYPE_CHECKING:
    from playwright.sync_api import Browser, FilePayload, Page, ViewportSize

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
ARTIFACTS = Path(os.environ.get("PAGE_ARTIFACTS_DIR", ROOT / "artifacts" / "page"))
DESKTOP: ViewportSize = {"width": 1280, "height": 800}
PHONE: ViewportSize = {"width": 390, "height": 844}
TIMEOUT_MS = 30_000
Scheme = Literal["light", "dark"]
# axe's impacts, least to most; the tests allow none of the last two
SERIOUS = ("serious", "critical")


@contextmanager
def chromium() -> Iterator[Browser]:
    """One headless Chromium (the system's) for a module's tests."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None  # type: ignore[assignment]
    require(sync_playwright is not None, "the playwright package is not installed (pip install -e '.[dev]')")
    require(CHROMIUM.is_file(), f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM_PATH)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def weights_subset(folder: Path, directions: list[str]) -> Path:
    """A weights folder holding only ``directions`` (links to the shipped checkpoints): fewer
    models load faster, and a pair left out goes through the pivot (de->fr via en)."""
    require(SHIPPED.is_dir(), f"shipped weights not found at {SHIPPED}")
    for direction in directions:
        (folder / direction).symlink_to(SHIPPED.parent / direction, target_is_directory=True)
    return folder


@contextmanager
def server(weights: Path, **settings: str) -> Iterator[str]:
    """``uvicorn app.main:app`` on ``weights`` with ``TRANSLATOR_*`` settings (lower-case names):
    the app as ``translator serve`` runs it, without that command's re-execution on mimalloc
    (a second interpreter start, seconds on a busy machine, for nothing a page shows)."""
    env = {**os.environ, "TRANSLATOR_WEIGHTS_DIR": str(weights), "TRANSLATOR_THREADS": "2"}
    env.update({f"TRANSLATOR_{name.upper()}": value for name, value in settings.items()})
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryFile("w+") as log:  # shown if the server exits or never gets ready
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, 120.0, log)
            yield url
        finally:
            stop(proc)


def axe_script() -> str:
    try:
        from axe_playwright_python.base import AXE_SCRIPT
    except ImportError:
        AXE_SCRIPT = None
    require(AXE_SCRIPT is not None, "axe-playwright-python is not installed (pip install -e '.[dev]')")
    assert AXE_SCRIPT is not None
    return str(AXE_SCRIPT)


def axe_violations(page: Page, impacts: tuple[str, ...] = SERIOUS) -> list[dict[str, Any]]:
    """axe-core's violations of the page as it is now, those of ``impacts``: rule, impact,
    help and the elements (their selectors)."""
    page.evaluate(axe_script())
    results: dict[str, Any] = page.evaluate("axe.run(document, {resultTypes: ['violations']})")
    return [
        {
            "rule": v["id"],
            "impact": v["impact"],
            "help": v["help"],
            "nodes": [n["target"] for n in v["nodes"]],
        }
        for v in results["violations"]
        if v["impact"] in impacts
    ]


def text_file(name: str, text: str) -> FilePayload:
    """A file for ``Page.set_input_files``, as a user would pick it."""
    return {"name": name, "mimeType": "text/plain", "buffer": text.encode()}


def screenshot(page: Page, name: str, full_page: bool = False) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=full_page)
    return path
