"""Shared fixtures: data paths, tiny real checkpoints, the shipped weights, the fused kernels, a
real redis-server; and the hook that makes every costly test ``slow`` (pyproject.toml's markers)."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model import checkpoint
from model.engine import fused
from model.engine.features import detected, fused_variant
from model.network.tokenizer import Tokenizer, train_tokenizer
from model.network.transformer import Transformer
from model.training.data import MULTI30K_DIR, read_lines
from tests.factories import marian_folder, tiny_config
from tests.helpers import SHIPPED, require

DATA = MULTI30K_DIR

# What a test costs (pyproject.toml's markers): any of these makes it slow, so `-m "not slow"` is the fast loop.
COSTLY = ("server", "compile", "train", "browser", "external")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``external`` on every test that runs a redis-server (the ``redis_url`` fixture), then
    ``slow`` on every test with a costly marker; tests marked ``gpu`` are skipped where torch sees
    no CUDA device (CI included: it has none, so ``require``'s rule of failing under CI cannot hold)."""
    no_cuda = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    cuda = torch.cuda.is_available()
    for item in items:
        if not cuda and item.get_closest_marker("gpu") is not None:
            item.add_marker(no_cuda)
        if "redis_url" in getattr(item, "fixturenames", ()) and item.get_closest_marker("external") is None:
            item.add_marker(pytest.mark.external)
        if item.get_closest_marker("slow") is None and any(item.get_closest_marker(m) for m in COSTLY):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def fused_kernels() -> None:
    """This CPU's fused decoder-step kernels (``model.engine.fused``), built once if torch's
    extension cache has none: requested by the tests that run them and by the fixtures that start
    servers, whose readiness deadline a first build would eat (about a minute on two cores).
    Servers started later, in this process or another, load the cached build."""
    if fused.enabled():
        fused.load(fused_variant(detected()))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    require(DATA.is_dir(), f"Multi30k not found at {DATA}")
    return DATA


@pytest.fixture(scope="session")
def tiny_tokenizer(data_dir: Path) -> Tokenizer:
    """A 1,000-piece joint sentencepiece model trained on 2,000 Multi30k pairs."""
    de = read_lines(data_dir / "train.de.gz")[:2000]
    en = read_lines(data_dir / "train.en.gz")[:2000]
    return train_tokenizer(de + en, vocab_size=1000)


@pytest.fixture(scope="session")
def tiny_weights_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Tokenizer) -> Path:
    """A weights folder with one random-initialised de-en checkpoint (real format, nonsense output)."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("weights")
    model = Transformer(tiny_config(tiny_tokenizer.vocab_size))
    meta = {"source_lang": "de", "target_lang": "en", "decoding": {"beam_size": 2, "length_penalty": 0.6}}
    checkpoint.save(root / "de-en", model, tiny_tokenizer, meta)
    return root


@pytest.fixture(scope="session")
def marian_dir(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """A random OPUS-MT-style folder, as ``save_pretrained`` writes it (``tests.factories.marian_folder``)."""
    require(importlib.util.find_spec("transformers") is not None, "transformers is not installed (dev extra)")
    return marian_folder(tmp_path_factory.mktemp("marian") / "opus-mt", read_lines(data_dir / "train.de.gz")[:3000])


@pytest.fixture(scope="session")
def imported(marian_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``marian_dir`` imported (``translator import``) as the checkpoint folder weights/de-en."""
    from model.imports import main

    out = tmp_path_factory.mktemp("weights") / "de-en"
    main([str(marian_dir), "--out", str(out)])
    return out


@pytest.fixture(scope="session")
def shipped() -> Path:
    """The shipped de-en checkpoint (committed, so CI always has it)."""
    require(SHIPPED.is_dir(), f"shipped weights not found at {SHIPPED}")
    return SHIPPED


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server (Debian's package) on a free port, for the tests' lifetime."""
    import shutil
    import subprocess

    from tests.helpers import free_port

    binary = shutil.which("redis-server")
    require(binary is not None, "redis-server not installed (apt-get install redis-server)")
    assert binary is not None
    port = free_port()
    folder = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
