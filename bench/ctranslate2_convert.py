"""Convert a checkpoint folder into a CTranslate2 model directory.

    python -m bench.ctranslate2_convert --weights weights/de-en --out /tmp/de-en-ct2 [--quantization int8] [--force]

Uses CTranslate2's model-spec API (``TransformerSpec.from_config``) and sets every weight
explicitly, the position table included, so nothing depends on CTranslate2's defaults:

- embeddings: the token matrix, scaled by sqrt(D) (``scale_embeddings``), plus our position
  table (sinusoidal [sin | cos] halves, or the learned one) for ``max_positions`` positions;
- attention: self-attention ``linear[0]`` is our fused ``qkv`` (same q, k, v order), ``linear[1]``
  the output; cross-attention ``linear[0]`` is ``q``, ``linear[1]`` the fused ``kv`` (k, v
  order, as CTranslate2 expects), ``linear[2]`` the output;
- layer norms: each sub-layer's ``layer_norm`` is our residual block's norm; CTranslate2
  applies it after the residual sum when ``pre_norm=False`` (post-LN) and before the
  sub-layer when ``pre_norm=True``, where the stacks' final norms go to ``layer_norm``;
- output: the (possibly shared) projection matrix, no bias; the decoder starts from the BOS
  embedding (``start_from_zero_embedding=False``), source sentences get EOS appended.

Vocabularies are the sentencepiece pieces in id order, so CTranslate2 ids equal ours and
``<unk>``, ``<s>``, ``</s>`` name our UNK, BOS and EOS ids.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ctranslate2.converters.converter import Converter
from ctranslate2.specs import common_spec, transformer_spec
from torch import nn

from model.engine import loading
from model.network.attention import CrossAttention, SelfAttention
from model.network.tokenizer import Tokenizer
from model.network.transformer import DecoderLayer, Embedding, EncoderLayer, FeedForward, Transformer

log = logging.getLogger(__name__)

ACTIVATIONS = {
    "relu": common_spec.Activation.RELU,
    "swish": common_spec.Activation.SWISH,
    "gelu": common_spec.Activation.GELU,
}


def _array(t: torch.Tensor) -> np.ndarray:
    """A float32 numpy copy (CTranslate2 quantizes at save or load time, not us)."""
    return t.detach().to("cpu", torch.float32).numpy().copy()


def _set_linear(spec: common_spec.LinearSpec, linear: nn.Linear) -> None:
    spec.weight = _array(linear.weight)  # (out, in), the layout CTranslate2 expects
    if linear.bias is not None:
        spec.bias = _array(linear.bias)


def _set_layer_norm(spec: common_spec.LayerNormSpec, norm: nn.LayerNorm) -> None:
    spec.gamma = _array(norm.weight)
    spec.beta = _array(norm.bias)


def _set_ffn(spec: transformer_spec.FeedForwardSpec, ff: FeedForward, norm: nn.LayerNorm) -> None:
    _set_layer_norm(spec.layer_norm, norm)
    _set_linear(spec.linear_0, ff.fc1)
    _set_linear(spec.linear_1, ff.fc2)


def _set_self_attention(spec: Any, attn: SelfAttention, norm: nn.LayerNorm) -> None:
    _set_layer_norm(spec.layer_norm, norm)
    _set_linear(spec.linear[0], attn.qkv)
    _set_linear(spec.linear[1], attn.out)


def _set_cross_attention(spec: Any, attn: CrossAttention, norm: nn.LayerNorm) -> None:
    _set_layer_norm(spec.layer_norm, norm)
    _set_linear(spec.linear[0], attn.q)
    _set_linear(spec.linear[1], attn.kv)
    _set_linear(spec.linear[2], attn.out)


def _set_embeddings(spec: Any, embed: Embedding, d_model: int) -> None:
    """Token matrix, sqrt(D) scale and the position table (max_positions, D)."""
    table = embed.learned.weight if embed.learned is not None else embed.table
    assert table is not None
    spec.scale_embeddings = embed.scale  # sqrt(D), or 1 (ModelConfig.scale_embeddings)
    spec.position_encodings.encodings = _array(table)
    embeddings = spec.embeddings
    target = embeddings[0] if isinstance(embeddings, list) else embeddings
    target.weight = _array(embed.tokens.weight)


def _set_encoder(spec: transformer_spec.TransformerEncoderSpec, model: Transformer) -> None:
    _set_embeddings(spec, model.src_embed, model.config.d_model)
    if model.encoder_norm is not None:
        _set_layer_norm(spec.layer_norm, model.encoder_norm)
    layer: EncoderLayer
    for layer_spec, layer in zip(spec.layer, model.encoder_layers, strict=True):
        _set_self_attention(layer_spec.self_attention, layer.self_attn, layer.attn_block.norm)
        _set_ffn(layer_spec.ffn, layer.ff, layer.ff_block.norm)


def _set_decoder(spec: transformer_spec.TransformerDecoderSpec, model: Transformer) -> None:
    _set_embeddings(spec, model.tgt_embed, model.config.d_model)
    spec.start_from_zero_embedding = False  # the first input is the BOS embedding, as in ours
    if model.decoder_norm is not None:
        _set_layer_norm(spec.layer_norm, model.decoder_norm)
    output = model.output.weight if model.output is not None else model.tgt_embed.tokens.weight
    spec.projection.weight = _array(output)
    layer: DecoderLayer
    for layer_spec, layer in zip(spec.layer, model.decoder_layers, strict=True):
        _set_self_attention(layer_spec.self_attention, layer.self_attn, layer.self_block.norm)
        _set_cross_attention(layer_spec.attention, layer.cross_attn, layer.cross_block.norm)
        _set_ffn(layer_spec.ffn, layer.ff, layer.ff_block.norm)


def vocabulary(tokenizer: Tokenizer) -> list[str]:
    """Sentencepiece pieces in id order (so CTranslate2's ids are ours)."""
    return tokenizer.pieces(range(tokenizer.vocab_size))


def build_spec(model: Transformer, tokenizer: Tokenizer) -> transformer_spec.TransformerSpec:
    """A validated ``TransformerSpec`` holding ``model``'s weights and ``tokenizer``'s vocabulary."""
    cfg = model.config
    if cfg.src_vocab_size != tokenizer.vocab_size or cfg.tgt_vocab_size != tokenizer.vocab_size:
        raise ValueError("CTranslate2 conversion needs the joint vocabulary of the checkpoint's tokenizer")
    if cfg.output_bias or not cfg.source_eos or cfg.bos_id == cfg.pad_id:
        raise ValueError("CTranslate2 conversion maps the shipped models' layout (no output bias, source EOS, BOS)")
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers),
        cfg.n_heads,
        pre_norm=cfg.norm_first,
        activation=ACTIVATIONS[cfg.activation],
    )
    _set_encoder(spec.encoder, model)
    _set_decoder(spec.decoder, model)
    pieces = vocabulary(tokenizer)
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    config = spec.config
    config.unk_token, config.bos_token, config.eos_token = pieces[cfg.unk_id], pieces[cfg.bos_id], pieces[cfg.eos_id]
    config.decoder_start_token = pieces[cfg.bos_id]
    config.add_source_bos, config.add_source_eos = False, True  # source = pieces + EOS, as in ours
    config.layer_norm_epsilon = cfg.layer_norm_eps
    spec.validate()
    return spec


class CheckpointConverter(Converter):  # type: ignore[misc]
    """CTranslate2's own ``Converter`` (validate, optimize, quantize, save the vocabularies and
    config) over a checkpoint folder's spec (``build_spec``): the way CTranslate2's converters for
    other frameworks turn a model into a CTranslate2 folder, e.g. for an Argos Translate package."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.checkpoint_dir = checkpoint_dir

    def _load(self) -> transformer_spec.TransformerSpec:
        ckpt = loading.load(self.checkpoint_dir, "cpu", keep_float_weights=True)
        return build_spec(ckpt.model, ckpt.tokenizer)


def convert(
    checkpoint_dir: str | Path, output_dir: str | Path, quantization: str | None = None, force: bool = False
) -> Path:
    """Write a CTranslate2 model directory for a checkpoint folder; returns ``output_dir``.

    ``quantization`` (e.g. "int8") stores quantized weights; None keeps float32 (a float32
    model can still run as int8 with ``compute_type="int8"`` when loaded). An existing
    ``output_dir`` is replaced only with ``force``.
    """
    ckpt = loading.load(checkpoint_dir, "cpu", keep_float_weights=True)
    out = write(build_spec(ckpt.model, ckpt.tokenizer), output_dir, quantization, force)
    log.info("converted %s to CTranslate2 at %s (quantization %s)", checkpoint_dir, out, quantization)
    return out


def write(
    spec: transformer_spec.TransformerSpec,
    output_dir: str | Path,
    quantization: str | None = None,
    force: bool = False,
) -> Path:
    """Optimize (alias tied weights, quantize) and save a spec into a fresh ``output_dir``."""
    out = Path(output_dir)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists (use --force to replace it)")
    spec.optimize(quantization=quantization)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    spec.save(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, type=Path, help="checkpoint folder")
    parser.add_argument("--out", required=True, type=Path, help="CTranslate2 model directory to write")
    parser.add_argument("--quantization", help="e.g. int8, int8_float32, float16 (default: float32)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    convert(args.weights, args.out, args.quantization, args.force)


if __name__ == "__main__":
    main()
