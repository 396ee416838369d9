"""Small random models and configs the tests build (one module, so test modules never import
each other). Nothing here loads data or the shipped weights."""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.transformer import Transformer

V = 60  # make_model's vocabulary: ids 0-3 are the specials (pad, unk, bos, eos)


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
