"""The API examples of docs/api.md (linked from README), run as written (with curl) against a live server.

Only the address changes (``localhost:8000`` becomes the test server's); ``--fail-with-body`` is
added to every curl so an HTTP error fails the command. Needs curl (skip without it, fail in CI).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.readme import api_commands
from tests.helpers import SHIPPED, require, running_server

pytestmark = [pytest.mark.server, pytest.mark.external, pytest.mark.usefixtures("fused_kernels")]


@pytest.fixture(scope="module")
def server(tiny_weights_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    weights = SHIPPED.parent if SHIPPED.is_dir() else tiny_weights_dir
    env = {"TRANSLATOR_WEIGHTS_DIR": str(weights), "TRANSLATOR_THREADS": "1", "TRANSLATOR_SUGGESTIONS": "true",
           "TRANSLATOR_DATA_DIR": str(tmp_path_factory.mktemp("data"))}  # fmt: skip
    with running_server(env) as url:
        yield url


def commands() -> list[str]:
    """One shell command per example (comment lines dropped, continuations kept)."""
    joined = re.sub(r"\\\n\s*", " ", api_commands())
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("command", commands())
def test_readme_example_succeeds(server: str, command: str) -> None:
    require(shutil.which("curl") is not None, "curl not found (apt-get install curl)")
    runnable = command.replace("localhost:8000", server.removeprefix("http://")).replace(
        "curl -s", "curl -sS --fail-with-body"
    )
    done = subprocess.run(["bash", "-o", "pipefail", "-c", runnable], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{runnable}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    assert done.stdout.strip(), "no output"
