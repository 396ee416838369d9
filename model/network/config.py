"""The one configuration object that builds the network."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

PositionKind = Literal["sinusoidal", "learned"]
Activation = Literal["relu", "swish", "gelu"]
ACTIVATIONS = ("relu", "swish", "gelu")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the encoder-decoder Transformer.

    ``share_embeddings`` ties the source embedding, the target embedding and the output
    projection to one matrix; it requires a joint vocabulary (equal vocabulary sizes).
    ``norm_first`` switches from the paper's post-LN residual blocks to pre-LN blocks
    (which add a final LayerNorm after each stack, as OpenNMT-py's Transformer has).

    What imported models (``model.imports``: OPUS-MT / Marian folders, Argos Translate packages)
    need beside the paper's network: ``activation`` of the feed-forward layer (``swish`` is
    SiLU, x * sigmoid(x), Marian's; ``gelu`` the exact erf form); ``scale_embeddings`` (token
    embeddings times sqrt(D), or not); ``output_bias`` (a bias on the output projection:
    Marian's ``final_logits_bias``, where -inf marks a piece never emitted); ``source_eos``
    (whether EOS ends every source: Marian's does, OpenNMT-py's does not). Marian's decoder
    starts from its PAD piece, so ``bos_id`` may equal ``pad_id`` (the one pair of special ids
    that may coincide). Positions: a stored table (``learned``) holds any layout exactly.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 256
    n_heads: int = 4
    encoder_layers: int = 4
    decoder_layers: int = 4
    d_ff: int = 1024
    dropout: float = 0.3
    attention_dropout: float = 0.1
    activation_dropout: float = 0.0
    norm_first: bool = False
    positions: PositionKind = "sinusoidal"
    max_positions: int = 512
    share_embeddings: bool = True
    layer_norm_eps: float = 1e-5
    activation: Activation = "relu"
    scale_embeddings: bool = True
    output_bias: bool = False
    source_eos: bool = True
    pad_id: int = 0
    unk_id: int = 1
    bos_id: int = 2
    eos_id: int = 3

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        out = []
        for name in (
            "src_vocab_size",
            "tgt_vocab_size",
            "d_model",
            "n_heads",
            "d_ff",
            "encoder_layers",
            "decoder_layers",
            "max_positions",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                out.append(f"{name} must be a positive integer, got {value!r}")
        if out:
            return out
        if self.d_model % self.n_heads:
            out.append(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            out.append("share_embeddings needs a joint vocabulary (equal vocabulary sizes)")
        if self.positions not in ("sinusoidal", "learned"):
            out.append(f"positions must be 'sinusoidal' or 'learned', got {self.positions!r}")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                out.append(f"{name} must be in [0, 1)")
        if self.activation not in ACTIVATIONS:
            out.append(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        ids = (self.pad_id, self.unk_id, self.bos_id, self.eos_id)
        distinct = len({self.pad_id, self.unk_id, self.eos_id, self.bos_id}) == 4 or (
            self.bos_id == self.pad_id and len({self.pad_id, self.unk_id, self.eos_id}) == 3
        )
        if not distinct or any(not 0 <= i < self.tgt_vocab_size for i in ids):
            out.append(f"special ids must be distinct (BOS may be PAD) and inside the vocabulary, got {ids}")
        return out

    @property
    def max_tokens(self) -> int:
        """The longest source (pieces, before its EOS) and the longest output (generated tokens,
        EOS included) the model takes: one position fewer than ``max_positions``, which the
        source's EOS and the decoder's BOS take. Everything that caps a length reads this."""
        return self.max_positions - 1

    @property
    def source_suffix(self) -> tuple[int, ...]:
        """What ends every source sentence: EOS, or nothing (``source_eos``)."""
        return (self.eos_id,) if self.source_eos else ()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a dict, rejecting unknown keys (a typo must not silently vanish)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {unknown}")
        return cls(**data)
