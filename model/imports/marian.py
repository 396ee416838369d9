"""OPUS-MT: a Hugging Face ``MarianMTModel`` folder (``save_pretrained``: config.json, weights,
``source.spm``, ``target.spm``, ``vocab.json``) as our network. Read without ``transformers``.

Marian is our post-LN network with options: swish (or ReLU, GELU) feed-forward, embeddings
scaled by sqrt(D) (``scale_embedding``), a sinusoidal [sin | cos] table (stored as transformers
computes it, in float64 then rounded, so the positions are its own to the bit), the output bias
``final_logits_bias``, a joint or separate vocabulary (``vocab.json``, ``target_vocab.json``),
EOS after each source, and decoding that starts from PAD. The projections map as
``bench/marian_convert.py`` maps ours onto Marian, the other way: q, k, v into our fused ``qkv``,
cross-attention k, v into ``kv``.

``generation_config.json``'s ``bad_words_ids`` of single pieces (OPUS-MT's ``[[PAD]]``) become
-inf in the output bias: the piece is never emitted, as transformers 4's Marian did by setting its
logit to -inf (transformers 5 masks it after the softmax instead: the same choices, beam scores
within the masked piece's probability). ``num_beams`` becomes the card's beam size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from model.imports import Imported, UnsupportedModel, languages
from model.network.config import ModelConfig
from model.network.vocabulary import VocabularyTokenizer

ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}
LAYER_NORM_EPS = 1e-5  # transformers' Marian layers use LayerNorm's default


def is_marian(path: Path) -> bool:
    file = path / "config.json"
    if not path.is_dir() or not file.is_file():
        return False
    try:
        return json.loads(file.read_text()).get("model_type") == "marian"
    except (ValueError, AttributeError):
        return False


def _json(path: Path, default: Any = None) -> Any:
    if not path.is_file():
        if default is None:
            raise UnsupportedModel(f"{path}: missing")
        return default
    return json.loads(path.read_text())


def sinusoidal_positions(n: int, dim: int) -> torch.Tensor:
    """transformers' ``MarianSinusoidalPositionalEmbedding.create_weight``: float64, then float32."""
    enc = np.array([[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)] for pos in range(n)])
    out = torch.empty(n, dim)
    half = dim // 2 if dim % 2 == 0 else dim // 2 + 1
    out[:, :half] = torch.tensor(np.sin(enc[:, 0::2]), dtype=torch.float32)
    out[:, half:] = torch.tensor(np.cos(enc[:, 1::2]), dtype=torch.float32)
    return out


def _weights(path: Path) -> dict[str, torch.Tensor]:
    single = path / "model.safetensors"
    files = [single] if single.is_file() else sorted(path.glob("model-*-of-*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    if not files:
        bin_file = path / "pytorch_model.bin"
        if not bin_file.is_file():
            raise UnsupportedModel(f"{path}: no model.safetensors or pytorch_model.bin")
        tensors = torch.load(bin_file, map_location="cpu", weights_only=True)
    return {k: v.float() for k, v in tensors.items()}


def _config(hf: dict[str, Any], vocab: int, target_vocab: int, shared: bool, unk: int) -> ModelConfig:
    """Our ModelConfig for a MarianConfig; UnsupportedModel naming what has no equivalent."""
    problems = []
    pairs = [("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")]
    for enc, dec in pairs:
        if hf.get(enc) != hf.get(dec):
            problems.append(f"{enc} {hf.get(enc)} != {dec} {hf.get(dec)} (one width for both stacks)")
    activation = hf.get("activation_function", "gelu")
    if activation not in ACTIVATIONS:
        problems.append(f"activation_function {activation!r} (supported: {', '.join(ACTIVATIONS)})")
    for key in ("normalize_before", "normalize_embedding", "add_final_layer_norm", "layernorm_embedding"):
        if hf.get(key):
            problems.append(f"{key} (Marian is post-LN without embedding norms)")
    pad, eos, start = hf.get("pad_token_id"), hf.get("eos_token_id"), hf.get("decoder_start_token_id")
    start = pad if start is None else start
    if pad is None or start is None or eos is None:
        problems.append("no pad_token_id or eos_token_id")
        raise UnsupportedModel("this Marian model cannot run exactly here: " + "; ".join(problems))
    elif start != pad and start == eos:
        problems.append(f"decoder_start_token_id {start} is EOS")
    if problems:
        raise UnsupportedModel("this Marian model cannot run exactly here: " + "; ".join(problems))
    try:
        return _model_config(hf, vocab, target_vocab, shared, unk, int(pad), int(eos), int(start))
    except ValueError as err:
        raise UnsupportedModel(f"this Marian model cannot run exactly here: {err}") from err


def _model_config(
    hf: dict[str, Any], vocab: int, target_vocab: int, shared: bool, unk: int, pad: int, eos: int, start: int
) -> ModelConfig:
    return ModelConfig(
        src_vocab_size=vocab,
        tgt_vocab_size=target_vocab,
        d_model=hf["d_model"],
        n_heads=hf["encoder_attention_heads"],
        encoder_layers=hf["encoder_layers"],
        decoder_layers=hf["decoder_layers"],
        d_ff=hf["encoder_ffn_dim"],
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        positions="learned",
        max_positions=hf.get("max_position_embeddings", 512),
        share_embeddings=shared,
        layer_norm_eps=LAYER_NORM_EPS,
        activation=ACTIVATIONS[hf.get("activation_function", "gelu")],  # type: ignore[arg-type]
        scale_embeddings=bool(hf.get("scale_embedding", False)),
        output_bias=True,
        source_eos=True,
        pad_id=pad,
        unk_id=unk,
        bos_id=start,
        eos_id=eos,
    )


def _split(names: tuple[str, ...], prefix: str, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q, k, v (or k, v) projections -> one fused weight and bias, in that order."""
    return {
        "weight": torch.cat([w[f"{prefix}.{n}_proj.weight"] for n in names]),
        "bias": torch.cat([w[f"{prefix}.{n}_proj.bias"] for n in names]),
    }


def _layers(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}

    def put(ours: str, theirs: str) -> None:
        for part in ("weight", "bias"):
            state[f"{ours}.{part}"] = w[f"{theirs}.{part}"]

    def fused(ours: str, names: tuple[str, ...], theirs: str) -> None:
        for part, tensor in _split(names, theirs, w).items():
            state[f"{ours}.{part}"] = tensor

    for i in range(cfg.encoder_layers):
        ours, theirs = f"encoder_layers.{i}", f"model.encoder.layers.{i}"
        fused(f"{ours}.self_attn.qkv", ("q", "k", "v"), f"{theirs}.self_attn")
        put(f"{ours}.self_attn.out", f"{theirs}.self_attn.out_proj")
        put(f"{ours}.attn_block.norm", f"{theirs}.self_attn_layer_norm")
        put(f"{ours}.ff.fc1", f"{theirs}.fc1")
        put(f"{ours}.ff.fc2", f"{theirs}.fc2")
        put(f"{ours}.ff_block.norm", f"{theirs}.final_layer_norm")
    for i in range(cfg.decoder_layers):
        ours, theirs = f"decoder_layers.{i}", f"model.decoder.layers.{i}"
        fused(f"{ours}.self_attn.qkv", ("q", "k", "v"), f"{theirs}.self_attn")
        put(f"{ours}.self_attn.out", f"{theirs}.self_attn.out_proj")
        put(f"{ours}.self_block.norm", f"{theirs}.self_attn_layer_norm")
        put(f"{ours}.cross_attn.q", f"{theirs}.encoder_attn.q_proj")
        fused(f"{ours}.cross_attn.kv", ("k", "v"), f"{theirs}.encoder_attn")
        put(f"{ours}.cross_attn.out", f"{theirs}.encoder_attn.out_proj")
        put(f"{ours}.cross_block.norm", f"{theirs}.encoder_attn_layer_norm")
        put(f"{ours}.ff.fc1", f"{theirs}.fc1")
        put(f"{ours}.ff.fc2", f"{theirs}.fc2")
        put(f"{ours}.ff_block.norm", f"{theirs}.final_layer_norm")
    return state


def _first(w: dict[str, torch.Tensor], *names: str) -> torch.Tensor | None:
    return next((w[n] for n in names if n in w), None)


def _vocabulary(path: Path, name: str, size: int) -> list[str]:
    """vocab.json ({piece: id}) as the list of pieces by id, which must be 0 .. size-1."""
    by_id = {int(i): piece for piece, i in _json(path / name).items()}
    if sorted(by_id) != list(range(size)):
        raise UnsupportedModel(f"{path / name}: ids are not 0..{size - 1} (the model's vocabulary)")
    return [by_id[i] for i in range(size)]


def read(path: Path, out: Path, source: str | None = None, target: str | None = None) -> Imported:
    hf = _json(path / "config.json")
    tok = _json(path / "tokenizer_config.json", {})
    gen = _json(path / "generation_config.json", {})
    w = _weights(path)
    src_table = _first(w, "model.encoder.embed_tokens.weight", "model.shared.weight")
    tgt_table = _first(w, "model.decoder.embed_tokens.weight", "model.shared.weight")
    if src_table is None or tgt_table is None:
        raise UnsupportedModel(f"{path}: no token embeddings in the weights")
    tied = hf.get("tie_word_embeddings", True)
    out_table = _first(w, "lm_head.weight") if not tied or "lm_head.weight" in w else tgt_table
    assert out_table is not None
    shared = (
        src_table.shape == tgt_table.shape and torch.equal(src_table, tgt_table) and torch.equal(tgt_table, out_table)
    )
    separate = bool(tok.get("separate_vocabs", False))
    source_vocab = _vocabulary(path, "vocab.json", src_table.shape[0])
    target_vocab = _vocabulary(path, "target_vocab.json", tgt_table.shape[0]) if separate else None
    # dropped from texts, as transformers' decode(skip_special_tokens=True) drops them
    specials = [
        tok.get(key, default)
        for key, default in (("eos_token", "</s>"), ("pad_token", "<pad>"), ("unk_token", "<unk>"))
    ]
    for spm_file in ("source.spm", "target.spm"):
        if not (path / spm_file).is_file():
            raise UnsupportedModel(f"{path / spm_file}: missing")
    tokenizer = VocabularyTokenizer(
        (path / "source.spm").read_bytes(), (path / "target.spm").read_bytes(), source_vocab, target_vocab,
        tok.get("unk_token", "<unk>"), specials,
    )  # fmt: skip
    cfg = _config(hf, src_table.shape[0], tgt_table.shape[0], shared, tokenizer.unk_id)

    bias = w.get("final_logits_bias", torch.zeros(1, cfg.tgt_vocab_size)).reshape(-1).clone()
    banned = []
    for words in gen.get("bad_words_ids") or hf.get("bad_words_ids") or []:
        if len(words) != 1:
            raise UnsupportedModel(f"bad_words_ids entry {words}: only single pieces can be banned here")
        banned.append(words[0])
    bias[banned] = -math.inf
    positions = _first(w, "model.encoder.embed_positions.weight")
    table = positions if positions is not None else sinusoidal_positions(cfg.max_positions, cfg.d_model)
    target_table = _first(w, "model.decoder.embed_positions.weight") if positions is not None else None
    state = {
        "src_embed.tokens.weight": src_table,
        "src_embed.learned.weight": table,
        "tgt_embed.learned.weight": table if target_table is None else target_table,
        "output_bias": bias,
        **_layers(cfg, w),
    }
    if not shared:
        state["tgt_embed.tokens.weight"], state["output.weight"] = tgt_table, out_table
    src, tgt = languages(out, source, target, None)
    decoding: dict[str, Any] = {"beam_size": int(gen.get("num_beams") or hf.get("num_beams") or 4)}
    meta = {
        "source_lang": src,
        "target_lang": tgt,
        "decoding": decoding,
        "imported": {"format": "marian", "from": str(path), "transformers_config": hf},
    }
    origin = [
        f"Format: Hugging Face MarianMTModel (`save_pretrained`), {hf.get('_name_or_path') or path.name}",
        f"Pieces never emitted (generation_config bad_words_ids): {banned or 'none'}",
        "Positions: transformers' sinusoidal table, stored as computed (float64, rounded to float32)",
    ]
    return Imported(cfg, state, tokenizer, meta, origin)
