"""The encoder-decoder Transformer of "Attention Is All You Need".

Shapes: B batch, S source length, T target length, D d_model, V vocabulary, L layers,
H heads. Masks follow ``model.network.masks`` (True = may attend).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from model.network.attention import CrossAttention, SelfAttention
from model.network.config import ModelConfig
from model.network.linear import Linear, LinearKernel, auto, linear
from model.network.masks import padding_mask


@dataclass(frozen=True)
class AttentionMaps:
    """Attention weights of one teacher-forced pass, each (L, B, H, queries, keys)."""

    encoder: torch.Tensor  # (L, B, H, S, S)
    decoder: torch.Tensor  # (L, B, H, T, T)
    cross: torch.Tensor  # (L, B, H, T, S)


def dropout(module: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, skipped at inference: an inactive ``nn.Dropout`` still dispatches an op
    (a few percent of a decoder step's operations: docs/benchmarks/README.md#optimizations)."""
    return module(x) if module.training and module.p > 0 else x


def sinusoidal_table(length: int, dim: int) -> torch.Tensor:
    """(length, dim) table: sines in the first half, cosines in the second.

    Frequencies 10000^(-i/half), the layout of Marian (Hugging Face ``MarianMTModel``), so
    the weights map onto that implementation without permuting anything.
    """
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / half))
    angles = torch.arange(length, dtype=torch.float32)[:, None] * freqs[None, :]  # (length, half)
    table = torch.cat([angles.sin(), angles.cos()], dim=1)
    return F.pad(table, (0, dim - 2 * half))


class Embedding(nn.Module):
    """Token embedding scaled by sqrt(D) (``ModelConfig.scale_embeddings``) plus positions, then dropout."""

    table: torch.Tensor | None

    def __init__(self, tokens: nn.Embedding, config: ModelConfig) -> None:
        super().__init__()
        self.tokens = tokens
        # What the lookups read where not ``tokens``' rows: the engine's packed output projection
        # of a tied model (model.engine.kernels.tables), which then releases those rows.
        self.lookup: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
        self.dropout = nn.Dropout(config.dropout)
        self.max_positions = config.max_positions
        self.learned: nn.Embedding | None = None
        table = None
        if config.positions == "learned":
            self.learned = nn.Embedding(config.max_positions, config.d_model)
        else:
            table = sinusoidal_table(config.max_positions, config.d_model)
        self.register_buffer("table", table, persistent=False)

    def forward(self, ids: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """ids: (B, T) at positions offset..offset+T-1 -> (B, T, D).

        ``positions`` (B,) instead gives each row of a single step (T = 1) its own position
        (the caller keeps them below ``max_positions``).
        """
        end = offset + ids.shape[1]
        if positions is None and end > self.max_positions:
            raise ValueError(f"sequence of {end} positions exceeds max_positions {self.max_positions}")
        table = self.learned.weight if self.learned is not None else self.table
        assert table is not None
        where = table[offset:end] if positions is None else table[positions][:, None]  # (T, D) | (B, 1, D)
        x = self.tokens(ids) if self.lookup is None else self.lookup(ids)
        if x.dtype != where.dtype:  # a float16 lookup table (loading.release_output_projection)
            x = x.to(where.dtype)
        return dropout(self.dropout, x * self.scale + where)


def activation_after(name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The feed-forward activation applied after fc1's product (``ModelConfig.activation``), or
    None for ReLU, which the linear kernels fuse into the product (``relu=True``)."""
    return {"relu": None, "swish": F.silu, "gelu": F.gelu}[name]


def feed_forward(
    fc1: Callable[[torch.Tensor, bool], torch.Tensor],
    fc2: Callable[[torch.Tensor, bool], torch.Tensor],
    after: Callable[[torch.Tensor], torch.Tensor] | None,
    x: torch.Tensor,
) -> torch.Tensor:
    """fc2(act(fc1(x))): ReLU inside fc1's kernel, any other activation (``activation_after``) on
    its output. The modules and the engine's bound layers both run it."""
    h = fc1(x, after is None)
    return fc2(h if after is None else after(h), False)


class FeedForward(nn.Module):
    """Position-wise Linear -> activation (ReLU, swish or GELU) -> Linear."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc1 = Linear(config.d_model, config.d_ff)
        self.fc2 = Linear(config.d_ff, config.d_model)
        self.dropout = nn.Dropout(config.activation_dropout)
        self.after = activation_after(config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x, relu=self.after is None)
        return self.fc2(dropout(self.dropout, h if self.after is None else self.after(h)))


class Residual(nn.Module):
    """A residual block around a sub-layer: post-LN (paper) or pre-LN."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        self.norm_first = config.norm_first

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.norm_first:
            return x + dropout(self.dropout, sublayer(self.norm(x)))
        return self.norm(x + dropout(self.dropout, sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config.d_model, config.n_heads, config.attention_dropout)
        self.ff = FeedForward(config)
        self.attn_block = Residual(config)
        self.ff_block = Residual(config)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, need_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: (B, S, D), mask: (B, 1, 1, S) -> (B, S, D), weights (B, H, S, S) | None."""
        weights = None

        def attn(h: torch.Tensor) -> torch.Tensor:
            nonlocal weights
            out, weights = self.self_attn(h, mask, need_weights=need_weights)
            return out

        x = self.attn_block(x, attn)
        return self.ff_block(x, self.ff), weights


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config.d_model, config.n_heads, config.attention_dropout)
        self.cross_attn = CrossAttention(config.d_model, config.n_heads, config.attention_dropout)
        self.ff = FeedForward(config)
        self.self_block = Residual(config)
        self.cross_block = Residual(config)
        self.ff_block = Residual(config)

    def forward(
        self,
        x: torch.Tensor,
        memory_kv: tuple[torch.Tensor, torch.Tensor],
        memory_mask: torch.Tensor,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Teacher-forced: x (B, T, D) -> (B, T, D), self weights (B,H,T,T) | None, cross
        (B,H,T,S) | None. (Incremental steps on the KV cache: ``model.engine.step``.)"""
        self_w = cross_w = None

        def self_attn(h: torch.Tensor) -> torch.Tensor:
            nonlocal self_w
            out, self_w = self.self_attn(h, None, causal=True, need_weights=need_weights)
            return out

        def cross_attn(h: torch.Tensor) -> torch.Tensor:
            nonlocal cross_w
            out, cross_w = self.cross_attn(h, memory_kv, memory_mask, need_weights)
            return out

        x = self.self_block(x, self_attn)
        x = self.cross_block(x, cross_attn)
        return self.ff_block(x, self.ff), self_w, cross_w


class Transformer(nn.Module):
    """Encoder-decoder Transformer; see ``ModelConfig`` for the switches."""

    kernel: LinearKernel = staticmethod(auto)  # the output projection's

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        src_tokens = nn.Embedding(config.src_vocab_size, d, padding_idx=config.pad_id)
        tgt_tokens = src_tokens
        if not config.share_embeddings:
            tgt_tokens = nn.Embedding(config.tgt_vocab_size, d, padding_idx=config.pad_id)
        self.src_embed = Embedding(src_tokens, config)
        self.tgt_embed = Embedding(tgt_tokens, config)
        self.tgt_embed.table = self.src_embed.table  # one sinusoidal table for both (None: learned)
        self.encoder_layers = cast(
            list[EncoderLayer], nn.ModuleList(EncoderLayer(config) for _ in range(config.encoder_layers))
        )
        self.decoder_layers = cast(
            list[DecoderLayer], nn.ModuleList(DecoderLayer(config) for _ in range(config.decoder_layers))
        )
        self.encoder_norm = nn.LayerNorm(d, eps=config.layer_norm_eps) if config.norm_first else None
        self.decoder_norm = nn.LayerNorm(d, eps=config.layer_norm_eps) if config.norm_first else None
        self.output: nn.Linear | None = None
        # The variant of the fused decoder-step kernels (model.engine.fused) to run, set by kernels.install
        # where the plan names them and they load; model.engine.step.DecoderStep runs its own tensor
        # operations without them.
        self.fused_step: str | None = None
        # The decoder's K/V cache storage where not the activations' dtype (float16: kernels.KernelPlan.kv_dtype),
        # set by kernels.install with the fused kernels, which read it; None: the activations' dtype.
        self.kv_dtype: torch.dtype | None = None
        if not config.share_embeddings:
            self.output = Linear(d, config.tgt_vocab_size, bias=False)
        # the output projection's bias (``ModelConfig.output_bias``: Marian's final_logits_bias)
        self.output_bias = nn.Parameter(torch.zeros(config.tgt_vocab_size)) if config.output_bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform matrices, zero biases, N(0, D^-1/2) embeddings (scaled by sqrt(D))."""
        for name, p in self.named_parameters():
            if "tokens" in name:
                nn.init.normal_(p, mean=0.0, std=self.config.d_model**-0.5)
                with torch.no_grad():
                    p[self.config.pad_id].zero_()
            elif p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):  # (output_bias too)
                nn.init.zeros_(p)

    # --- encoder -------------------------------------------------------------------------
    def encode(
        self, src: torch.Tensor, need_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """src: (B, S) ids -> memory (B, S, D), src mask (B, 1, 1, S), weights per layer."""
        mask = padding_mask(src, self.config.pad_id)
        x = self.src_embed(src)
        weights = []
        for layer in self.encoder_layers:
            x, w = layer(x, mask, need_weights)
            if w is not None:
                weights.append(w)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return x, mask, weights

    # --- decoder -------------------------------------------------------------------------
    def output_matrix(self) -> torch.Tensor:
        """(V, D): the output projection (the shared embedding when tied)."""
        return self.output.weight if self.output is not None else self.tgt_embed.tokens.weight

    def step_linears(self) -> list[nn.Module]:
        """The linear layers an incremental decoder step runs (``model.engine.step``), the output
        projection aside: each decoder layer's self-attention QKV and output, cross-attention
        query and output, and feed-forward. (Cross-attention K/V are projected once per
        sentence, at the encoder's row counts.) ``kernels.install`` may give them their own kernel."""
        return [
            m
            for layer in self.decoder_layers
            for m in (
                layer.self_attn.qkv,
                layer.self_attn.out,
                layer.cross_attn.q,
                layer.cross_attn.out,
                layer.ff.fc1,
                layer.ff.fc2,
            )
        ]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: (..., D) -> (..., V)."""
        if self.decoder_norm is not None:
            h = self.decoder_norm(h)
        return linear(h, self.output_matrix(), self.output_bias, self.kernel)

    def project_memory(self, memory: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """memory (B, S, D) -> every decoder layer's cross-attention K, V, each (B, H, S, Dh)."""
        return [layer.cross_attn.project_memory(memory) for layer in self.decoder_layers]

    def decode(
        self,
        tgt_in: torch.Tensor,
        memory: torch.Tensor,
        memory_mask: torch.Tensor,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Teacher-forced pass. tgt_in: (B, T) -> logits (B, T, V), self and cross weights."""
        x = self.tgt_embed(tgt_in)
        self_ws, cross_ws = [], []
        for layer in self.decoder_layers:
            memory_kv = layer.cross_attn.project_memory(memory)
            x, self_w, cross_w = layer(x, memory_kv, memory_mask, need_weights=need_weights)
            if self_w is not None and cross_w is not None:
                self_ws.append(self_w)
                cross_ws.append(cross_w)
        return self.logits(x), self_ws, cross_ws

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """src: (B, S), tgt_in: (B, T) (BOS + target[:-1]) -> logits (B, T, V)."""
        memory, mask, _ = self.encode(src)
        return self.decode(tgt_in, memory, mask)[0]

    def attention_maps(self, src: torch.Tensor, tgt_in: torch.Tensor) -> tuple[torch.Tensor, AttentionMaps]:
        """Teacher-forced pass with weights on -> logits (B, T, V) and every attention map."""
        memory, mask, enc_ws = self.encode(src, need_weights=True)
        logits, self_ws, cross_ws = self.decode(tgt_in, memory, mask, need_weights=True)
        maps = AttentionMaps(torch.stack(enc_ws), torch.stack(self_ws), torch.stack(cross_ws))
        return logits, maps

    @property
    def device(self) -> torch.device:
        """Where the model runs: its first decoder layer's norm's device. (The engine leaves the
        weights that packed copies replace, the token table too, on the meta device.)"""
        return self.decoder_layers[0].ff_block.norm.weight.device

    def num_parameters(self) -> int:
        """Distinct parameters (a shared matrix counts once)."""
        return sum(p.numel() for p in self.parameters())
