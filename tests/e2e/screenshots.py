"""The README's pictures of the translation page, taken of the real page in Debian's Chromium
against a real server of the shipped weights (de-en, en-de, en-fr):

    .venv/bin/python -m tests.e2e.screenshots            # docs/img/page-desktop.png, page-phone.png

Desktop width in light mode, phone width in dark mode, each with a translation, its alternatives
and a word's alignment showing; reduced to a palette of 64 colours so the files stay small.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from PIL import Image

from tests.e2e.pages import DESKTOP, PHONE, Scheme, chromium, server, weights_subset
from tests.helpers import ROOT

if TYPE_CHECKING:
    from playwright.sync_api import ViewportSize

TEXT = "Zwei junge Männer spielen Fußball auf einer Wiese. Ein Hund läuft."
SHOTS: tuple[tuple[str, ViewportSize, Scheme], ...] = (
    ("page-desktop.png", DESKTOP, "light"),
    ("page-phone.png", PHONE, "dark"),
)


def shrink(path: Path, colours: int = 64) -> None:
    """A palette PNG: screenshots of flat colours lose nothing visible and most of their size."""
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colours, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def take(url: str, out: Path) -> list[Path]:
    made = []
    with chromium() as browser:
        for name, viewport, scheme in SHOTS:
            phone = viewport is PHONE
            context = browser.new_context(viewport=viewport, color_scheme=scheme, is_mobile=phone, has_touch=phone)
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.goto(f"{url}/?{urlencode({'source': 'auto', 'target': 'en', 'q': TEXT})}")
            page.wait_for_selector("#app[data-state=ready]")
            page.check("#want-alternatives")
            page.wait_for_selector("#alternatives-list li")
            word = page.locator("#translation .w", has_text="men").first
            if phone:
                word.tap()
            else:
                word.click()
            page.wait_for_selector("#backdrop mark.strong")
            page.evaluate("document.activeElement.blur()")
            path = out / name
            page.screenshot(path=str(path), full_page=True)
            shrink(path)
            made.append(path)
            context.close()
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="folder for the PNGs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        weights = weights_subset(Path(folder), ["de-en", "en-de", "en-fr"])
        with server(weights) as url:
            for path in take(url, args.out):
                print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
