"""What the tests build (one module, so test modules never import each other): small random
models and configs, an app started in process (``start``), and checks of the HTTP answers.
Nothing here loads data or the shipped weights."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
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


def marian_folder(
    path: Path,
    sentences: list[str],
    vocab: int = 300,
    spread: tuple[float, float] = (0.5, 0.1),
    eos_bias: float = 7.0,
    **overrides: object,
) -> Path:
    """A ``save_pretrained`` OPUS-MT-style folder at ``path``: a sentencepiece model trained on
    ``sentences`` (``</s>`` 0, ``<unk>`` 1, as OPUS-MT's), ``vocab.json`` its pieces plus ``<pad>``
    last, a ``MarianMTModel`` of a small ``MarianConfig`` (swish, scaled embeddings; ``overrides``)
    with random weights: embeddings and output bias drawn wide (``spread``: their std), so that the logits are peaked
    (a near-uniform row would make the argmax a coin toss of float rounding), and
    ``generation_config`` banning ``<pad>`` as OPUS-MT's does. Needs ``transformers``."""
    import io
    import json

    import sentencepiece as spm
    from transformers import GenerationConfig, MarianConfig, MarianMTModel

    path.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=buffer, vocab_size=vocab, model_type="unigram",
        eos_id=0, unk_id=1, bos_id=-1, pad_id=-1, minloglevel=2, num_threads=2,
    )  # fmt: skip
    proto = buffer.getvalue()
    (path / "source.spm").write_bytes(proto)
    (path / "target.spm").write_bytes(proto)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())] + ["<pad>"]
    (path / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
    (path / "tokenizer_config.json").write_text(json.dumps({"source_lang": "de", "target_lang": "en"}))
    pad = len(pieces) - 1
    settings: dict[str, Any] = dict(
        vocab_size=len(pieces), decoder_vocab_size=len(pieces), d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        activation_function="swish", scale_embedding=True, max_position_embeddings=128, pad_token_id=pad, init_std=0.3,
        eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=None, dropout=0.0,
    )  # fmt: skip
    settings.update(overrides)
    torch.manual_seed(0)
    marian = MarianMTModel(MarianConfig(**settings)).eval()
    with torch.no_grad():
        marian.model.shared.weight.normal_(0.0, spread[0])
        marian.final_logits_bias.normal_(0.0, spread[1])
        marian.final_logits_bias[0, 0] += eos_bias  # some sentences end before the length limit
    marian.generation_config = GenerationConfig(
        decoder_start_token_id=pad, eos_token_id=0, pad_token_id=pad, bad_words_ids=[[pad]], num_beams=4
    )
    marian.save_pretrained(str(path))
    return path


def opennmt_argos_package(path: Path, sentences: list[str], vocab: int = 300, layers: int = 2) -> Path:
    """An Argos Translate package built as Argos builds them: an OpenNMT-py Transformer checkpoint
    (pre-LN with final norms, ReLU, its sinusoidal table, scaled embeddings, <unk> <blank> <s> </s>
    first in the vocabulary; random weights, embeddings drawn wide so the logits are peaked, the
    generator's EOS bias raised so some sentences end early) converted by CTranslate2's own
    ``OpenNMTPyConverter``, zipped with ``metadata.json`` and ``sentencepiece.model`` into
    ``path`` (an ``.argosmodel``). Needs ``ctranslate2``."""
    import argparse
    import io
    import json
    import math
    import tempfile
    import zipfile

    import sentencepiece as spm
    from ctranslate2.converters import OpenNMTPyConverter

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=buffer, vocab_size=vocab, model_type="unigram",
        minloglevel=2, num_threads=2,
    )  # fmt: skip
    proto = buffer.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=proto)
    pieces = ["<unk>", "<blank>", "<s>", "</s>"] + [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]
    d, ff, heads, positions = 32, 64, 4, 128
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    pe = torch.zeros(positions, d)
    position = torch.arange(positions).unsqueeze(1).float()
    div = torch.exp(torch.arange(0, d, 2).float() * -(math.log(10000.0) / d))
    pe[:, 0::2], pe[:, 1::2] = torch.sin(position * div), torch.cos(position * div)  # OpenNMT-py's interleaved table
    model: dict[str, torch.Tensor] = {}

    def linear(name: str, rows: int, cols: int) -> None:
        model[f"{name}.weight"], model[f"{name}.bias"] = rand(rows, cols), rand(rows, std=0.1)

    def norm(name: str) -> None:
        model[f"{name}.weight"], model[f"{name}.bias"] = 1 + rand(d, std=0.1), rand(d, std=0.1)

    def attention(name: str) -> None:
        for part in ("linear_query", "linear_keys", "linear_values", "final_linear"):
            linear(f"{name}.{part}", d, d)

    for side in ("encoder", "decoder"):
        model[f"{side}.embeddings.make_embedding.emb_luts.0.weight"] = rand(len(pieces), d, std=0.5)
        model[f"{side}.embeddings.make_embedding.pe.pe"] = pe.unsqueeze(1)
        norm(f"{side}.layer_norm")
    for i in range(layers):
        layer = f"encoder.transformer.{i}"
        attention(f"{layer}.self_attn")
        norm(f"{layer}.layer_norm")
        linear(f"{layer}.feed_forward.w_1", ff, d)
        linear(f"{layer}.feed_forward.w_2", d, ff)
        norm(f"{layer}.feed_forward.layer_norm")
        layer = f"decoder.transformer_layers.{i}"
        attention(f"{layer}.self_attn")
        attention(f"{layer}.context_attn")
        norm(f"{layer}.layer_norm_1")
        norm(f"{layer}.layer_norm_2")
        linear(f"{layer}.feed_forward.w_1", ff, d)
        linear(f"{layer}.feed_forward.w_2", d, ff)
        norm(f"{layer}.feed_forward.layer_norm")
    generator = {"weight": rand(len(pieces), d, std=0.5), "bias": rand(len(pieces), std=0.1)}
    generator["bias"][3] += 4.0
    opt = argparse.Namespace(
        encoder_type="transformer", decoder_type="transformer", enc_layers=layers, dec_layers=layers, heads=heads,
        position_encoding=True, max_relative_positions=0, pos_ffn_activation_fn="relu", self_attn_type="scaled-dot",
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "translate-de_en-1_0"
        root.mkdir()
        torch.save({"model": model, "generator": generator, "vocab": {"src": pieces, "tgt": pieces}, "opt": opt},
                   Path(tmp) / "onmt.pt")  # fmt: skip
        OpenNMTPyConverter(str(Path(tmp) / "onmt.pt"), unsafe_deserialization=True).convert(str(root / "model"))
        (root / "sentencepiece.model").write_bytes(proto)
        metadata = {"package_version": "1.0", "argos_version": "1.9", "from_code": "de", "to_code": "en",
                    "name": "German-English (test)"}  # fmt: skip
        (root / "metadata.json").write_text(json.dumps(metadata))
        with zipfile.ZipFile(path, "w") as archive:
            for file in sorted(root.rglob("*")):
                archive.write(file, file.relative_to(Path(tmp)))
    return path
