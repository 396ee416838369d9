"""The Dockerfile's own install and start steps, replayed in a fresh virtual environment.

No container engine is needed: ``tests.deploy.dockerfile.Replay`` runs the builder stage's RUN
lines verbatim (with ``VARIANT=cpu``) under a temporary root, then the runtime stage's ENV, WORKDIR
and COPY, and starts its CMD; the image's HEALTHCHECK command must pass against the ready server.
pip uses this machine's configuration (its mirrors and find-links) and, like the image, no cache:
torch 2.13.0 comes from PyTorch's CPU index, or from a local wheel where that index is out of reach.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from model.engine.features import detected, fused_variant
from tests.deploy.dockerfile import Replay, exec_form, healthcheck_command, host_env, parse
from tests.helpers import ROOT, SHIPPED, free_port, stop, wait_ready

DOCKERFILE = ROOT / "Dockerfile"
DEV_ONLY = ("pytest", "ruff", "mypy", "hadolint", "docker-compose")

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.external, pytest.mark.usefixtures("fused_kernels")]


@dataclass(frozen=True)
class Installed:
    root: Path
    env: dict[str, str]  # the runtime stage's environment, mapped under root
    workdir: Path
    replay: Replay


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, tiny_weights_dir: Path) -> Installed:
    """The builder stage run for real (VARIANT=cpu), then the runtime stage's ENV/WORKDIR/COPY."""
    root = tmp_path_factory.mktemp("image")
    shims = root / "host-bin"  # the image's `python`: this interpreter's base Python, not our venv
    shims.mkdir()
    (shims / "python").symlink_to(getattr(sys, "_base_executable", sys.executable))
    env = host_env([shims])
    weights = SHIPPED.parent if SHIPPED.is_dir() else tiny_weights_dir
    replay = Replay(
        parse(DOCKERFILE.read_text()),
        root=root,
        context=ROOT,
        base_env=env,
        # this CPU's kernel variant only: the other three are the same build with other flags, and
        # compiling them cost this test a minute on two cores
        build_args={"VARIANT": "cpu", "FUSED_VARIANTS": fused_variant(detected())},
        context_overrides={"weights": weights},
    )
    replay.run_stage("builder")
    runtime_env, workdir = replay.run_stage("runtime", run_steps=False)
    return Installed(root, runtime_env, workdir, replay)


@pytest.fixture(scope="module")
def image_server(installed: Installed) -> Iterator[str]:
    """The runtime stage's CMD, as ``docker run -e TRANSLATOR_HOST=127.0.0.1 -e TRANSLATOR_PORT=...``."""
    runtime = installed.replay.dockerfile.stage("runtime")
    cmd = runtime.last("CMD")
    assert cmd is not None
    port = free_port()
    env = {**installed.env, "TRANSLATOR_HOST": "127.0.0.1", "TRANSLATOR_PORT": str(port), "TRANSLATOR_THREADS": "1",
           "CXX": "/nonexistent/c++"}  # fmt: skip  # (the runtime image has no compiler)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            exec_form(cmd.value), cwd=installed.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, 120.0, log)
            yield url
        finally:
            stop(proc)


def venv_python(installed: Installed) -> Path:
    return Path(installed.env["VIRTUAL_ENV"]) / "bin" / "python"


def test_build_installed_a_fresh_venv_without_dev_tools(installed: Installed) -> None:
    python = venv_python(installed)
    assert python.is_file() and str(python).startswith(str(installed.root))
    assert (python.parent / "translator").is_file(), "the console script must come from the install"
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    )
    names = {line.split("==")[0].lower() for line in listed.stdout.split()}
    assert "transformer-translator" in names and "torch" in names
    assert not names & set(DEV_ONLY), f"dev tools in the image: {names & set(DEV_ONLY)}"
    probe = "import app, torch; print(app.__file__); print(torch.__version__)"
    where = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True, cwd=installed.workdir)
    app_file, torch_version = where.stdout.split()
    assert "site-packages" in app_file, f"app must be installed, not imported from the source tree: {app_file}"
    assert torch_version.startswith("2.13.0")


def test_runtime_paths_are_mapped_into_the_image_root(installed: Installed) -> None:
    weights = Path(installed.env["TRANSLATOR_WEIGHTS_DIR"])
    assert weights.is_relative_to(installed.root) and (weights / "de-en" / "config.json").is_file()
    assert installed.env["PATH"].split(os.pathsep)[0] == str(venv_python(installed).parent)
    assert installed.workdir == installed.root / "app"


def test_image_command_serves_translations(image_server: str) -> None:
    body = {"q": ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen."], "source": "de", "target": "en"}
    response = httpx.post(f"{image_server}/translate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    texts = response.json()["translatedText"]
    assert isinstance(texts, list) and len(texts) == 2
    viewer = httpx.get(f"{image_server}/", timeout=10)
    assert viewer.status_code == 200 and "<html" in viewer.text.lower(), "static files missing from the wheel"


def test_image_runs_the_fused_kernels_built_by_the_builder(installed: Installed, image_server: str) -> None:
    """The builder compiles the fused kernels into the venv (every x86 variant by default, this
    CPU's here: ``FUSED_VARIANTS``); the runtime (no compiler: its server runs
    with ``CXX`` pointing nowhere) loads its CPU's variant from there."""
    if platform.machine() != "x86_64":
        pytest.skip(f"no fused-kernel variants for {platform.machine()}")
    cache = Path(installed.env["TORCH_EXTENSIONS_DIR"])
    assert cache.is_relative_to(Path(installed.env["VIRTUAL_ENV"])), "the kernels travel with the venv"
    built = sorted(library.name.split("_")[2] for library in cache.glob("*/translator_step_*.so"))
    assert built == [fused_variant(detected())], built  # (FUSED_VARIANTS: this CPU's only, as the fixture asks)
    direction = httpx.get(f"{image_server}/info", timeout=10).json()["directions"][0]
    assert direction["fused_step"] == fused_variant(detected()), direction


def test_image_healthcheck_passes_when_ready_and_fails_without_server(installed: Installed, image_server: str) -> None:
    instruction = installed.replay.dockerfile.stage("runtime").last("HEALTHCHECK")
    assert instruction is not None
    command = healthcheck_command(instruction.value)
    port = image_server.rsplit(":", 1)[1]
    ok = subprocess.run(command, env={**installed.env, "TRANSLATOR_PORT": port}, capture_output=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    nobody = subprocess.run(
        command, env={**installed.env, "TRANSLATOR_PORT": str(free_port())}, capture_output=True, timeout=30
    )
    assert nobody.returncode != 0


TINY_TRAIN = """
name = "tiny"
[data]
dir = "{data}"
train_limit = 400
eval_limit = 8
[tokenizer]
vocab_size = 300
[model]
d_model = 16
n_heads = 2
encoder_layers = 1
decoder_layers = 1
d_ff = 32
max_positions = 128
[optim]
max_epochs = 1
max_tokens = 1000
warmup_steps = 2
average_count = 1
threads = 1
"""


def test_every_command_the_image_offers_runs_in_it(installed: Installed, data_dir: Path, tmp_path: Path) -> None:
    """The image installs no dev extras: `translator --help`, every command's --help, and a tiny
    training run and attention plot work with what it does install."""
    translator = str(venv_python(installed).parent / "translator")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [translator, *args], env=installed.env, cwd=tmp_path, capture_output=True, text=True, timeout=600
        )

    overview = run("--help")
    assert overview.returncode == 0 and all(c in overview.stdout for c in ("serve", "train", "evaluate", "plot"))
    for command in ("serve", "train", "evaluate", "plot"):
        out = run(command, "--help")
        assert out.returncode == 0 and out.stdout.startswith(f"usage: translator {command}"), out.stderr[-2000:]
    assert run("--version").stdout.startswith("translator ")
    assert run("bench", "--help").returncode == 0
    no_peers = run("bench", "load", "--help")  # its HTTP client (httpx) is a dev tool, not in the image
    assert no_peers.returncode != 0 and "transformer-translator[dev]" in no_peers.stderr

    config = tmp_path / "tiny.toml"
    config.write_text(TINY_TRAIN.format(data=data_dir))
    trained = run("train", "--config", str(config), "--out", str(tmp_path / "run"), "--max-steps-per-epoch", "2")
    assert trained.returncode == 0, trained.stderr[-3000:]
    model = tmp_path / "run" / "model"
    image = tmp_path / "attention.png"
    plotted = run("plot", "--weights", str(model), "--text", "Ein Hund rennt.", "--out", str(image), "--beam-size", "1")
    assert plotted.returncode == 0, plotted.stderr[-3000:]
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = run("plot", "training", str(tmp_path / "run"))
    assert curves.returncode == 0, curves.stderr[-3000:]
    assert (tmp_path / "run" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
