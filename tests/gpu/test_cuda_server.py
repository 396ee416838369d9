"""The service on CUDA: a real server (``TRANSLATOR_DEVICE=cuda``, float32) whose scheduler batches
concurrent requests into the CPU's translations, and whose ``/attention`` maps are well formed.
Skipped without a CUDA device (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from model import checkpoint
from model.engine import loading
from model.engine.translator import Translator
from model.training.data import read_lines
from tests.helpers import running_server

pytestmark = [pytest.mark.gpu, pytest.mark.server]

DOC = {"source": "de", "target": "en"}


@pytest.fixture(scope="module")
def served(shipped: Path) -> Iterator[str]:
    env = {
        "TRANSLATOR_WEIGHTS_DIR": str(shipped.parent),
        "TRANSLATOR_LOAD_ONLY": "de,en",
        "TRANSLATOR_DEVICE": "cuda",
        "TRANSLATOR_DTYPE": "float32",  # the CPU's tokens (tests/gpu/test_cuda_decoding.py)
        "TRANSLATOR_CACHE_SIZE": "0",
    }
    with running_server(env) as url:
        yield url


def test_info_names_the_device(served: str) -> None:
    info = httpx.get(f"{served}/info").json()
    model = next(d for d in info["directions"] if (d["source"], d["target"]) == ("de", "en"))
    assert (model["device"], model["dtype"]) == ("cuda", "float32")


def test_concurrent_requests_are_batched_into_the_cpus_translations(
    served: str, shipped: Path, data_dir: Path, fused_kernels: None
) -> None:
    """32 clients at once: the scheduler's continuous batch on the GPU, sentences joining and
    leaving it between steps, gives each the CPU's offline translation."""
    sentences = read_lines(data_dir / "test_2016_flickr.de.gz")[:32]

    def translate(text: str) -> str:
        response = httpx.post(f"{served}/translate", json={"q": text, **DOC}, timeout=60)
        assert response.status_code == 200, response.text
        return str(response.json()["translatedText"])

    with ThreadPoolExecutor(32) as pool:
        served_texts = list(pool.map(translate, sentences))
    ckpt = loading.load(shipped, "cpu", "float32")
    cpu = Translator(ckpt.model, ckpt.tokenizer, shortlist=loading.use_shortlist(ckpt))
    options = loading.decoding_options(checkpoint.read_meta(shipped), direction="de-en")
    expected = [t.text for t in cpu.translate(sentences, options)]
    differ = [i for i, (a, b) in enumerate(zip(served_texts, expected, strict=True)) if a != b]
    assert not differ, [(served_texts[i], expected[i]) for i in differ]


def test_attention_maps_come_back_from_the_gpu(served: str) -> None:
    text = "Ein Mann fährt mit dem Fahrrad."
    out = httpx.post(f"{served}/attention", json={"q": text, **DOC}, timeout=60).json()
    src, tgt = len(out["source_tokens"]), len(out["target_tokens"])
    cross = np.array(out["attention"]["cross"])
    assert cross.shape == (out["n_decoder_layers"], out["n_heads"], tgt, src)
    assert np.allclose(cross.sum(-1), 1.0, atol=0.02)  # (the maps are rounded)
    translated = httpx.post(f"{served}/translate", json={"q": text, **DOC}).json()["translatedText"]
    assert out["translatedText"] == translated and out["alignment"]
