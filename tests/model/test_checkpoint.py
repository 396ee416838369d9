"""Checkpoint folders: round trip, and clear errors for broken ones."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model import checkpoint
from model.checkpoint import CheckpointError
from model.engine import fused, kernels, loading
from model.engine.features import detected, fused_variant
from model.engine.kernels import onednn_ops
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.network.tokenizer import Tokenizer
from model.network.transformer import Transformer
from tests.factories import PACKED_FEATURES, packed_plan, tiny_config
from tests.helpers import require

SENTENCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee auf einer Wiese."]


def copy_of(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(folder, target)
    return target


def test_round_trip_gives_identical_outputs(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    torch.manual_seed(0)
    model = Transformer(tiny_config(tiny_tokenizer.vocab_size)).eval()
    checkpoint.save(tmp_path / "c", model, tiny_tokenizer, {"source_lang": "de", "target_lang": "en"})
    loaded = loading.load(tmp_path / "c", keep_float_weights=True)
    src = torch.tensor([[5, 6, 7, 3]])
    tgt = torch.tensor([[2, 8, 9]])
    torch.testing.assert_close(loaded.model(src, tgt), model(src, tgt), atol=0, rtol=0)
    opts = DecodingOptions(beam_size=3, n_best=2)
    # the loaded model's kernels on the original too: the plan's step kernel may differ from auto's
    kernels.install(model, loaded.plan, model.step_linears())
    before = Translator(model, tiny_tokenizer).translate(SENTENCES, opts)
    after = Translator(loaded.model, loaded.tokenizer).translate(SENTENCES, opts)
    assert before == after
    assert loaded.meta["source_lang"] == "de"
    assert not any(p.suffix in (".pt", ".pkl", ".bin") for p in (tmp_path / "c").iterdir())


@pytest.mark.isa
def test_a_model_loaded_for_inference_is_not_saved_half_released(tmp_path: Path, tiny_weights_dir: Path) -> None:
    """Where the layers' float weights were released at load, saving says so and how to keep
    them, instead of writing a checkpoint without them."""
    ckpt = loading.load(tiny_weights_dir / "de-en", features=PACKED_FEATURES)
    if not any(p.is_meta for p in ckpt.model.parameters()):
        pytest.skip(f"{ckpt.plan.describe()}: nothing released on this CPU")
    with pytest.raises(CheckpointError, match="keep_float_weights=True"):
        checkpoint.save(tmp_path / "r", ckpt.model, ckpt.tokenizer, ckpt.meta)
    assert not (tmp_path / "r" / checkpoint.WEIGHTS).exists()


def test_fp16_storage_halves_the_file(tmp_path: Path, tiny_weights_dir: Path) -> None:
    ckpt = loading.load(tiny_weights_dir / "de-en", keep_float_weights=True)
    checkpoint.save(tmp_path / "h", ckpt.model, ckpt.tokenizer, ckpt.meta, dtype=torch.float16)
    full = (tiny_weights_dir / "de-en" / checkpoint.WEIGHTS).stat().st_size
    half = (tmp_path / "h" / checkpoint.WEIGHTS).stat().st_size
    assert half < 0.6 * full
    assert loading.load(tmp_path / "h", keep_float_weights=True).model.src_embed.tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("precision", ["float32", "int8"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("stored", [torch.float16, torch.float32])
@pytest.mark.isa
def test_inference_reads_the_embeddings_once_and_in_float16_where_exact(
    tmp_path: Path,
    tiny_tokenizer: Tokenizer,
    precision: str,
    tied: bool,
    stored: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loaded for inference on packed kernels, the output projection runs on a packed copy of
    its own: an untied output matrix is released, and the token embeddings, read by lookups
    only, are kept in float16 where that holds them exactly (a checkpoint stored in float16),
    else in float32. Logits and translations are those of the float weights, bit for bit.
    (The reference keeps its float weights, so ``onednn`` would hand its one-row calls to
    ``F.linear``, which rounds differently from the packed call the lean model makes at every row
    count; the reference runs packed at every row count too, so that only the release differs. For
    the same reason neither runs its small products on the fused kernels' ``linear`` or packed
    panels, which read only kept float weights.)"""
    monkeypatch.setattr(onednn_ops, "ATEN_MAX_ROWS", 0)
    for variant in list(fused.FEW_ROWS):
        monkeypatch.setitem(fused.FEW_ROWS, variant, 0)
        monkeypatch.setitem(fused.PANEL_ROWS, variant, 0)
    packed_plan(precision)
    torch.manual_seed(3)
    model = Transformer(tiny_config(tiny_tokenizer.vocab_size, share_embeddings=tied)).eval()
    checkpoint.save(tmp_path / "c", model, tiny_tokenizer, {"source_lang": "de", "target_lang": "en"}, dtype=stored)
    same = {"precision": precision, "features": PACKED_FEATURES, "fused": False}
    full = loading.load(tmp_path / "c", **same, keep_float_weights=True).model
    lean = loading.load(tmp_path / "c", **same).model

    assert kernels.is_packed(lean.kernel)
    assert (lean.output is None) == tied and (tied or lean.output_matrix().is_meta)
    lookups = {lean.src_embed.tokens.weight.dtype, lean.tgt_embed.tokens.weight.dtype}
    assert lookups == {torch.float16 if stored == torch.float16 else torch.float32}
    src, tgt = torch.tensor([[5, 6, 7, 3], [9, 3, 0, 0]]), torch.tensor([[2, 8, 9], [2, 4, 0]])
    with torch.inference_mode():
        assert torch.equal(lean(src, tgt), full(src, tgt))
    for beam in (1, 3):
        opts = DecodingOptions(beam_size=beam, n_best=beam)
        assert Translator(lean, tiny_tokenizer).translate(SENTENCES, opts) == Translator(
            full, tiny_tokenizer
        ).translate(SENTENCES, opts)
    with pytest.raises(RuntimeError, match="released for inference"):  # with gradients: not a dtype error
        lean.logits(torch.zeros(1, lean.config.d_model))


@pytest.mark.isa
def test_float32_layers_where_mkl_would_run_keep_only_their_panels(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    """Loaded for inference in float32 where the plan runs MKL's sgemm (an Intel CPU) and the fused
    kernels build: every layer whose weight the panels take runs from its panels alone
    (``PackedPanels``, the float weight a placeholder), the output projection too, its panels the
    tied token table (``kernels.TokenTable``); logits match the kept float weights' to float rounding (those run
    other products at some row counts) and translations are the same; with gradients a released
    layer refuses to run."""
    features = replace(detected(), intel=True)
    if not features.avx2:
        pytest.skip("the fused kernels have no panels without AVX2 and FMA")
    plan = kernels.choose("cpu", "float32", features)
    require(kernels.panel_kernels(plan) is not None, "the fused step kernels do not build here: see the log")
    torch.manual_seed(3)
    model = Transformer(tiny_config(tiny_tokenizer.vocab_size, share_embeddings=True)).eval()
    checkpoint.save(tmp_path / "c", model, tiny_tokenizer, {"source_lang": "de", "target_lang": "en"})
    full = loading.load(tmp_path / "c", features=features, keep_float_weights=True).model
    lean = loading.load(tmp_path / "c", features=features).model
    layers = [lean.encoder_layers[0].self_attn.qkv, lean.decoder_layers[1].ff.fc2, lean.decoder_layers[0].cross_attn.kv]
    for layer in layers:
        assert isinstance(layer.kernel, kernels.PackedPanels) and kernels.is_packed(layer.kernel)
        assert layer.weight.is_meta
    assert not full.decoder_layers[1].ff.fc2.weight.is_meta
    # the output projection on its panels too, which the tied lookups read: no float rows beside them
    assert isinstance(lean.kernel, kernels.PackedPanels) and lean.output_matrix().is_meta
    assert lean.src_embed.lookup is lean.tgt_embed.lookup and isinstance(lean.tgt_embed.lookup, kernels.TokenTable)
    src, tgt = torch.tensor([[5, 6, 7, 3], [9, 3, 0, 0]]), torch.tensor([[2, 8, 9], [2, 4, 0]])
    with torch.inference_mode():
        torch.testing.assert_close(lean(src, tgt), full(src, tgt), atol=1e-4, rtol=1e-4)
    for beam in (1, 3):
        opts = DecodingOptions(beam_size=beam, n_best=beam)
        got = Translator(lean, tiny_tokenizer).translate(SENTENCES, opts)
        assert [h.text for h in got] == [h.text for h in Translator(full, tiny_tokenizer).translate(SENTENCES, opts)]
    with pytest.raises(RuntimeError, match="released for inference"):
        layers[1](torch.zeros(1, layers[1].in_features))


def test_large_weights_are_written_in_shards_under_the_limit(
    tmp_path: Path, tiny_weights_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = loading.load(tiny_weights_dir / "de-en", keep_float_weights=True)
    whole = (tiny_weights_dir / "de-en" / checkpoint.WEIGHTS).stat().st_size
    monkeypatch.setattr(checkpoint, "SHARD_BYTES", whole // 3)
    folder = checkpoint.save(tmp_path / "s", ckpt.model, ckpt.tokenizer, ckpt.meta)
    shards = checkpoint.weight_files(folder)
    assert len(shards) >= 3 and not (folder / checkpoint.WEIGHTS).exists()
    assert [p.name for p in shards] == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, 1 + len(shards))
    ]
    biggest = max(t.numel() * t.element_size() for t in checkpoint.unique_state(ckpt.model).values())
    assert all(p.stat().st_size <= max(whole // 3, biggest) + 4096 for p in shards)  # (+ the header)
    loaded = loading.load(folder, keep_float_weights=True)
    for name, tensor in checkpoint.unique_state(ckpt.model).items():
        torch.testing.assert_close(checkpoint.unique_state(loaded.model)[name], tensor, atol=0, rtol=0)
    (shards[1]).unlink()  # a missing shard: the names no longer match
    with pytest.raises(CheckpointError, match="missing"):
        loading.load(folder)
    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 15 * 2**20)  # saved again in one file: the shards go
    checkpoint.save(folder, ckpt.model, ckpt.tokenizer, ckpt.meta)
    assert checkpoint.weight_files(folder) == [folder / checkpoint.WEIGHTS]


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda p: (p / "model.safetensors").unlink(), "model.safetensors: missing"),
        (lambda p: (p / "model.safetensors").write_bytes(b"\x00garbage" * 10), "corrupt"),
        (lambda p: (p / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda p: (p / "config.json").unlink(), "config.json: missing"),
        (lambda p: (p / "spm.model").write_bytes(b"nonsense"), "spm.model"),
    ],
)
def test_broken_files_give_clear_errors(tmp_path: Path, tiny_weights_dir: Path, breakage, message: str) -> None:  # type: ignore[no-untyped-def]
    folder = copy_of(tiny_weights_dir / "de-en", tmp_path)
    breakage(folder)
    with pytest.raises(CheckpointError, match=message):
        loading.load(folder)


def test_mismatched_config_gives_clear_error(tmp_path: Path, tiny_weights_dir: Path) -> None:
    folder = copy_of(tiny_weights_dir / "de-en", tmp_path)
    meta = json.loads((folder / "config.json").read_text())
    meta["model"]["d_ff"] = 128
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="shapes do not match"):
        loading.load(folder)
    meta["model"]["d_ff"] = 64
    meta["model"]["decoder_layers"] = 3
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="missing"):
        loading.load(folder)
    meta["model"]["decoder_layers"] = 2
    meta["model"]["n_heads"] = 5
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="divisible"):
        loading.load(folder)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        loading.load(tmp_path / "nope")


def test_a_many_to_many_card_may_recommend_options_per_direction(tmp_path: Path) -> None:
    """``[decoding.length_penalty_by_direction]`` in a training config reaches config.json, and
    the options built for a direction (the service's and model.training.evaluate's) take its entry;
    other directions keep the card's length penalty."""
    from model.training.config import load_train_config

    config = tmp_path / "m2m.toml"
    config.write_text(
        'name = "m2m"\n[model]\nd_model = 32\n[decoding]\nbeam_size = 5\nlength_penalty = 1.4\n'
        "[decoding.length_penalty_by_direction]\ncs-en = 0.6\nde-fr = 2.2\n"
    )
    decoding = load_train_config(config).decoding
    assert decoding.length_penalty_by_direction == {"cs-en": 0.6, "de-fr": 2.2}
    meta = {"decoding": json.loads(json.dumps(decoding.__dict__))}  # as model.training.train writes config.json
    assert loading.decoding_options(meta, direction="cs-en").length_penalty == 0.6
    assert loading.decoding_options(meta, 2, direction="de-fr") == DecodingOptions(beam_size=2, length_penalty=2.2)
    assert loading.decoding_options(meta, direction="fr-de").length_penalty == 1.4
    assert loading.decoding_options(meta).length_penalty == 1.4
    assert checkpoint.recommended_decoding(meta, "cs-en") == {
        "beam_size": 5, "length_penalty": 0.6, "max_length_a": 1.5, "max_length_b": 10,
        "no_repeat_ngram_size": 0, "repetition_penalty": 1.0,
    }  # fmt: skip
    assert checkpoint.recommended_decoding({}, "cs-en") == {}
    # the n-gram size likewise (bench.repetition's choice per direction)
    guarded = {
        "decoding": {**meta["decoding"], "no_repeat_ngram_size": 4, "no_repeat_ngram_size_by_direction": {"de-fr": 5}}
    }
    assert loading.decoding_options(guarded, direction="de-fr").no_repeat_ngram_size == 5
    assert loading.decoding_options(guarded, direction="fr-de").no_repeat_ngram_size == 4


@pytest.mark.isa
def test_a_plan_on_panels_whose_kernels_fail_to_build_is_made_again_without_them(
    tmp_path: Path, tiny_weights_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler that is there but fails (``CXX=false``, an empty extension cache): float32 is
    planned on panels, the load finds the kernels did not build (logged), plans again as without
    them (oneDNN, or MKL on Intel CPUs) and translates; no layer is left on panels."""
    require(detected().avx2 and detected().fma, "no panels without AVX2 and FMA")
    false = shutil.which("false")
    require(false is not None, "no `false` program")
    monkeypatch.setattr(fused, "_loaded", {})  # nothing built in this process
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("CXX", str(false))
    assert kernels.choose("cpu", "float32").kernel == "panels"
    ckpt = loading.load(tiny_weights_dir / "de-en")
    assert ckpt.plan == kernels.choose("cpu", "float32", fused=False) and ckpt.plan.kernel in ("onednn", "aten")
    assert ckpt.model.fused_step is None and not fused.buildable(fused_variant(detected()))
    assert not any(isinstance(getattr(m, "kernel", None), kernels.PackedPanels) for m in ckpt.model.modules())
    out = Translator(ckpt.model, ckpt.tokenizer).decode_ids([[5, 6, 7]], DecodingOptions(beam_size=2))
    assert out[0][0].ids
