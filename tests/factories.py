"""What the tests build (one module, so test modules never import each other): small random
models and configs, an app started in process (``start``), and checks of the HTTP answers.
Nothing here loads data or the shipped weights."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp

from app.main import create_app
from app.settings import Settings
from model.engine import kernels
from model.engine.cache import init_cache
from model.engine.features import detected
from model.engine.kernels import KernelPlan, UnsupportedPrecision
from model.engine.step import DecoderStep
from model.network.config import ModelConfig
from model.network.transformer import Transformer

V = 60  # make_model's vocabulary: ids 0-3 are the specials (pad, unk, bos, eos)
DOC = {"source": "de", "target": "en"}  # the direction of the tests' checkpoints


def sources(n: int, seed: int = 1, min_len: int = 2, max_len: int = 12, vocab: int = V) -> list[list[int]]:
    """``n`` random source sentences of ``min_len``-``max_len`` ids each (no specials), eos-ended."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [[*torch.randint(4, vocab, (length,), generator=g).tolist(), 3] for length in lengths]


def tiny_config(vocab: int, **overrides: object) -> ModelConfig:
    """Two layers of width 32, no dropout: milliseconds per step on any CPU."""
    base: dict[str, object] = dict(
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        d_model=32,
        n_heads=4,
        encoder_layers=2,
        decoder_layers=2,
        d_ff=64,
        dropout=0.0,
        attention_dropout=0.0,
        max_positions=128,
    )
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


# This CPU as if it were not Intel's: without the fused kernels (``fused=False``: off, or no
# compiler) float32 runs oneDNN (packed) wherever it can, so the oneDNN paths are tested on every
# CPU, although plans with a compiler put float32 on the fused kernels' panels.
PACKED_FEATURES = replace(detected(), intel=False)


def packed_plan(precision: str) -> KernelPlan:
    """This CPU's kernel plan for ``precision`` without the fused kernels (float32: as
    ``PACKED_FEATURES``); the test is skipped where it cannot run or runs ``F.linear`` (nothing
    packed, nothing released)."""
    try:
        plan = kernels.choose("cpu", precision, PACKED_FEATURES, fused=False)
    except UnsupportedPrecision:
        pytest.skip(f"{precision} does not run on this CPU")
    if plan.kernel == "aten":
        pytest.skip(f"{precision} runs F.linear on this CPU: nothing is packed, nothing released")
    return plan


def assert_steps_match(
    model: Transformer, src: torch.Tensor, tgt: torch.Tensor, expected: torch.Tensor, tol: float
) -> None:
    """The incremental decoder step (``model.engine.step``, on the KV cache) of src (B, S) and tgt (B, T)
    gives ``expected[:, t]`` (expected: (B, T, V), a teacher-forced pass) at every step t."""
    memory, mask, _ = model.encode(src)
    cache = init_cache(model, memory, capacity=tgt.shape[1])
    step = DecoderStep(model)
    for t in range(tgt.shape[1]):
        torch.testing.assert_close(step(tgt[:, t], cache, mask), expected[:, t], atol=tol, rtol=tol)
    assert cache.length == tgt.shape[1]


def make_model(seed: int = 0, vocab: int = V, **overrides: object) -> Transformer:
    """A seeded random tiny model (64 positions) in eval mode, its output embedding sharpened
    a little so it does not emit uniform noise."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(vocab, **{"max_positions": 64, **overrides}))
    with torch.no_grad():
        model.tgt_embed.tokens.weight.mul_(4.0)
    return model.eval()


def random_model(vocab: int, eos_scale: float = 1.0, **overrides: object) -> Transformer:
    """A random tiny model whose output distribution is sharp enough to avoid near-ties
    (the output projection x4, EOS's row x ``eos_scale``)."""
    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab, **overrides)).eval()
    with torch.no_grad():
        output = model.output.weight if model.output is not None else model.tgt_embed.tokens.weight
        output.mul_(4.0)
        output[model.config.eos_id].mul_(eos_scale)
    return model


def start(settings: Settings) -> Iterator[TestClient]:
    yield from start_app(create_app(settings))


def start_app(app: ASGIApp) -> Iterator[TestClient]:
    """A test client of ``app`` (an app ``create_app`` made, or one wrapping it), once /ready is 200."""
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").json()
            time.sleep(0.05)
        yield client


def assert_error(response: Any, status: int, error_type: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) >= {"error", "error_type"} and body["error"]
    if error_type:
        assert body["error_type"] == error_type
    return body


def server_timing(response: Any) -> dict[str, float]:
    """Server-Timing's "name;dur=ms, ..." -> {name: ms}, in the header's order."""
    out = {}
    for part in response.headers["server-timing"].split(","):
        name, dur = part.strip().split(";")
        assert dur.startswith("dur=")
        out[name] = float(dur[4:])
    return out


def sample(client: TestClient, name: str, **labels: str) -> float:
    families = text_string_to_metric_families(client.get("/metrics").text)
    found = [s.value for f in families for s in f.samples if s.name == name and s.labels == labels]
    return found[0] if found else 0.0
