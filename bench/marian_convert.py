"""Map a post-LN checkpoint onto Hugging Face ``transformers``' ``MarianMTModel``.

Marian is the same architecture as our post-LN model: scaled embeddings (sqrt(D)) plus a
sinusoidal [sin | cos] table starting at position 0, ReLU feed-forward, LayerNorm after each
residual sum, a tied output projection. The mapping only splits our fused projections
(self-attention ``qkv`` -> q, k, v; cross-attention ``kv`` -> k, v) and copies everything
else by name; the position tables are overwritten with ours so nothing depends on how a
``transformers`` version builds its table. ``final_logits_bias`` is zero (we have none),
``decoder_start_token_id`` is our BOS. Pre-LN checkpoints have no Marian equivalent and are
refused.

    python -m bench.marian_convert --weights weights/de-en --out /tmp/de-en-marian
writes a ``save_pretrained`` folder (weights and config only; no HF tokenizer).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, MarianConfig, MarianMTModel

from model.engine import loading
from model.network.config import ModelConfig
from model.network.transformer import Transformer

log = logging.getLogger(__name__)


class UnsupportedModel(ValueError):
    """The checkpoint uses a feature Marian cannot express (pre-LN)."""


def marian_config(cfg: ModelConfig) -> MarianConfig:
    """A ``MarianConfig`` describing the same network as ``cfg`` (post-LN only)."""
    if cfg.output_bias or not cfg.source_eos:
        raise UnsupportedModel("the mapping writes no output bias and appends EOS to sources")
    if cfg.norm_first:
        raise UnsupportedModel(
            "MarianMTModel is post-LN only; this checkpoint is pre-LN (norm_first=True) and cannot be mapped"
        )
    return MarianConfig(
        vocab_size=cfg.src_vocab_size,
        decoder_vocab_size=cfg.tgt_vocab_size,
        share_encoder_decoder_embeddings=cfg.share_embeddings,
        tie_word_embeddings=cfg.share_embeddings,
        max_position_embeddings=cfg.max_positions,
        d_model=cfg.d_model,
        encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        activation_function=cfg.activation,
        scale_embedding=cfg.scale_embeddings,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=cfg.pad_id,
        eos_token_id=cfg.eos_id,
        bos_token_id=cfg.bos_id,
        decoder_start_token_id=cfg.bos_id,
        forced_eos_token_id=None,
    )


def _split(linear: torch.nn.Linear, names: tuple[str, ...], prefix: str) -> dict[str, torch.Tensor]:
    """A fused Linear (n*D, D) -> n projections named ``{prefix}.{name}_proj.{weight,bias}``."""
    weights = linear.weight.chunk(len(names), dim=0)
    biases = linear.bias.chunk(len(names), dim=0)
    out = {}
    for name, w, b in zip(names, weights, biases, strict=True):
        out[f"{prefix}.{name}_proj.weight"], out[f"{prefix}.{name}_proj.bias"] = w, b
    return out


def _copy(module: torch.nn.Linear | torch.nn.LayerNorm, prefix: str) -> dict[str, torch.Tensor]:
    """weight and bias of a Linear or LayerNorm under ``prefix`` (all of ours have biases)."""
    weight, bias = module.weight, module.bias
    assert weight is not None and bias is not None
    return {f"{prefix}.weight": weight, f"{prefix}.bias": bias}


def _encoder_layer(model: Transformer, i: int) -> dict[str, torch.Tensor]:
    layer, p = model.encoder_layers[i], f"model.encoder.layers.{i}"
    return {
        **_split(layer.self_attn.qkv, ("q", "k", "v"), f"{p}.self_attn"),
        **_copy(layer.self_attn.out, f"{p}.self_attn.out_proj"),
        **_copy(layer.attn_block.norm, f"{p}.self_attn_layer_norm"),
        **_copy(layer.ff.fc1, f"{p}.fc1"),
        **_copy(layer.ff.fc2, f"{p}.fc2"),
        **_copy(layer.ff_block.norm, f"{p}.final_layer_norm"),
    }


def _decoder_layer(model: Transformer, i: int) -> dict[str, torch.Tensor]:
    layer, p = model.decoder_layers[i], f"model.decoder.layers.{i}"
    return {
        **_split(layer.self_attn.qkv, ("q", "k", "v"), f"{p}.self_attn"),
        **_copy(layer.self_attn.out, f"{p}.self_attn.out_proj"),
        **_copy(layer.self_block.norm, f"{p}.self_attn_layer_norm"),
        **_copy(layer.cross_attn.q, f"{p}.encoder_attn.q_proj"),
        **_split(layer.cross_attn.kv, ("k", "v"), f"{p}.encoder_attn"),
        **_copy(layer.cross_attn.out, f"{p}.encoder_attn.out_proj"),
        **_copy(layer.cross_block.norm, f"{p}.encoder_attn_layer_norm"),
        **_copy(layer.ff.fc1, f"{p}.fc1"),
        **_copy(layer.ff.fc2, f"{p}.fc2"),
        **_copy(layer.ff_block.norm, f"{p}.final_layer_norm"),
    }


def _embeddings(model: Transformer) -> dict[str, torch.Tensor]:
    """Token matrices (shared or not), the output projection and both position tables."""
    src, tgt = model.src_embed, model.tgt_embed
    output = model.output.weight if model.output is not None else tgt.tokens.weight
    out = {
        "model.encoder.embed_tokens.weight": src.tokens.weight,
        "model.decoder.embed_tokens.weight": tgt.tokens.weight,
        "lm_head.weight": output,
        "final_logits_bias": torch.zeros(1, model.config.tgt_vocab_size),
    }
    if model.config.share_embeddings:
        out["model.shared.weight"] = src.tokens.weight
    for name, embed in (("encoder", src), ("decoder", tgt)):
        table = embed.learned.weight if embed.learned is not None else embed.table
        assert table is not None
        out[f"model.{name}.embed_positions.weight"] = table
    return out


def marian_state(model: Transformer) -> dict[str, torch.Tensor]:
    """Every tensor of the Marian model, named as in ``MarianMTModel.state_dict()``."""
    cfg = model.config
    state = _embeddings(model)
    for i in range(cfg.encoder_layers):
        state.update(_encoder_layer(model, i))
    for i in range(cfg.decoder_layers):
        state.update(_decoder_layer(model, i))
    return {k: v.detach().to("cpu", torch.float32) for k, v in state.items()}


def generation_config(cfg: ModelConfig) -> GenerationConfig:
    """Plain decoding defaults with our special ids; callers pass beam size and lengths."""
    return GenerationConfig(
        decoder_start_token_id=cfg.bos_id,
        bos_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id,
        pad_token_id=cfg.pad_id,
        forced_eos_token_id=None,
        num_beams=1,
        do_sample=False,
    )


def to_marian(model: Transformer) -> MarianMTModel:
    """A ``MarianMTModel`` (CPU, float32, eval mode) computing the same function as ``model``."""
    cfg = model.config
    marian = MarianMTModel(marian_config(cfg))
    for module in marian.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = cfg.layer_norm_eps  # Marian's layers hard-code the default 1e-5
    state = marian_state(model)
    expected = set(marian.state_dict())
    if expected != set(state):
        raise RuntimeError(
            f"Marian mapping out of date: missing {sorted(expected - set(state))[:5]}, "
            f"unexpected {sorted(set(state) - expected)[:5]}"
        )
    with torch.no_grad():
        params = dict(marian.state_dict(keep_vars=True))
        for name, tensor in state.items():
            params[name].copy_(tensor)
    marian.generation_config = generation_config(cfg)
    return marian.eval()


def load_marian(
    checkpoint_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> MarianMTModel:
    """Load a checkpoint folder straight into a Marian model on ``device`` in ``dtype``."""
    ckpt = loading.load(checkpoint_dir, "cpu", keep_float_weights=True)
    marian: Any = to_marian(ckpt.model)  # transformers' typing of .to() confuses mypy
    return marian.to(device=device, dtype=dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, type=Path, help="checkpoint folder")
    parser.add_argument("--out", required=True, type=Path, help="folder for save_pretrained")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    marian: Any = load_marian(args.weights)
    marian.save_pretrained(str(args.out))
    log.info("wrote a MarianMTModel to %s", args.out)


if __name__ == "__main__":
    main()
