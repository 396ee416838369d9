"""Reading the user docs' sections, marked blocks and the settings table (for the README tests).

README.md links to the rest: the settings table, the Docker and scaling-out sections live in
docs/deploy.md, the API examples in docs/api.md.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import ROOT

README = ROOT / "README.md"
API = ROOT / "docs" / "api.md"
DEPLOY = ROOT / "docs" / "deploy.md"
TABLE_MARKER = "<!-- settings-table"
_ROW = re.compile(r"^\| `(?P<variable>[A-Z0-9_]+)` \| (?P<default>[^|]*) \| (?P<meaning>[^|]*) \|$")


def readme(path: Path = README) -> str:
    return path.read_text()


def section(title: str, path: Path = README) -> str:
    """The text of ``## title`` in ``path`` up to the next second-level heading."""
    text = readme(path)
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def block_after(marker: str, language: str, path: Path = README) -> str:
    """The fenced block that follows an HTML comment marker in ``path``."""
    text = readme(path)
    after = text[text.index(marker) :]
    match = re.search(rf"```{language}\n(.*?)\n```", after, re.S)
    assert match is not None, f"no ```{language} block after {marker}"
    return match.group(1)


def table_rows() -> list[dict[str, str]]:
    text = readme(DEPLOY)
    lines = text[text.index(TABLE_MARKER) :].splitlines()[1:]
    rows = []
    for line in lines[2:]:  # header and separator
        if not line.startswith("|"):
            break
        match = _ROW.match(line)
        assert match is not None, f"malformed settings row: {line}"
        rows.append({k: v.strip() for k, v in match.groupdict().items()})
    return rows


def api_commands() -> str:
    return block_after("<!-- api-examples -->", "bash", API)
