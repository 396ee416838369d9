"""Multi-head attention: self-attention and cross-attention, as the network's modules (training,
teacher-forced passes, attention maps; incremental steps on the KV cache are ``model.engine.step``).

Both return ``(out, weights | None)``. Weights are computed only when asked for; the fast
path is ``torch.nn.functional.scaled_dot_product_attention``, except for a few queries on
the CPU (incremental decoding steps, see ``SMALL_QUERY``), where plain matmul-softmax-matmul
is faster. Nothing is stored on modules.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.network.linear import Linear
from model.network.masks import causal_mask, fill_blocked

# Up to this many queries per head (incremental decoding: one query per hypothesis, or a
# sentence's beam of queries against its memory), plain matmul-softmax-matmul is faster than
# SDPA's CPU kernels, whose set-up dominates at these sizes
# (docs/benchmarks/README.md#numbers-behind-the-code).
SMALL_QUERY = 8

AttentionOutput = tuple[torch.Tensor, torch.Tensor | None]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> AttentionOutput:
    """Scaled dot-product attention over heads.

    q: (B, H, Tq, Dh), k and v: (B, H, Tk, Dh), mask: bool broadcastable to (B, H, Tq, Tk)
    (True = may attend; see ``model.network.masks``). ``causal`` adds a causal mask (needs Tq == Tk).
    -> out (B, H, Tq, Dh), weights (B, H, Tq, Tk) or None.
    """
    explicit = need_weights or (q.shape[-2] <= SMALL_QUERY and q.device.type == "cpu" and not dropout_p)
    if causal and mask is None and not explicit:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True), None
    if causal:
        causal_part = causal_mask(q.shape[-2], q.device)
        mask = causal_part if mask is None else mask & causal_part
    if not explicit:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p), None
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    weights = torch.softmax(fill_blocked(scores, mask), dim=-1)
    out = (F.dropout(weights, p=dropout_p) if dropout_p else weights) @ v
    return out, weights if need_weights else None


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, D) -> (B, H, T, D/H)."""
    b, t, d = x.shape
    return x.view(b, t, n_heads, d // n_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, Dh) -> (B, T, H*Dh)."""
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)


class SelfAttention(nn.Module):
    """Self-attention with one fused Q/K/V projection."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = Linear(d_model, 3 * d_model)
        self.out = Linear(d_model, d_model)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        need_weights: bool = False,
    ) -> AttentionOutput:
        """x: (B, T, D) -> (B, T, D). (Incremental steps on the KV cache: ``model.engine.step``.)"""
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each (B, T, D)
        q, k, v = (split_heads(t, self.n_heads) for t in (q, k, v))  # (B, H, T, Dh)
        p = self.dropout if self.training else 0.0
        out, weights = attend(q, k, v, mask, causal, p, need_weights)
        return self.out(merge_heads(out)), weights


class CrossAttention(nn.Module):
    """Decoder-to-encoder attention; K/V of the memory can be computed once and reused."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.q = Linear(d_model, d_model)
        self.kv = Linear(d_model, 2 * d_model)
        self.out = Linear(d_model, d_model)

    def project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """memory: (B, S, D) -> K, V each (B, H, S, Dh), contiguous: made once per batch and
        read at every decoding step, where a strided K/V would be copied by each matmul."""
        k, v = self.kv(memory).chunk(2, dim=-1)
        return split_heads(k, self.n_heads).contiguous(), split_heads(v, self.n_heads).contiguous()

    def forward(
        self,
        x: torch.Tensor,
        memory_kv: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        need_weights: bool = False,
    ) -> AttentionOutput:
        """x: (R, T, D), memory_kv from ``project_memory`` (B, H, S, Dh), mask (B, 1, 1, S) -> (R, T, D).

        R = B * W: each group of W consecutive rows (a sentence's beam hypotheses) reads one
        sentence's memory. The groups' queries are stacked, so memory is never copied per beam.
        """
        q = split_heads(self.q(x), self.n_heads)  # (R, H, T, Dh)
        k, v = memory_kv
        r, h, t, dh = q.shape
        width = r // k.shape[0]
        if width > 1:
            q = q.view(-1, width, h, t, dh).transpose(1, 2).reshape(-1, h, width * t, dh)  # (B, H, W*T, Dh)
        p = self.dropout if self.training else 0.0
        out, weights = attend(q, k, v, mask, False, p, need_weights)
        if width > 1:  # back to one row per hypothesis
            out = out.view(-1, h, width, t, dh).transpose(1, 2).reshape(r, h, t, dh)
            if weights is not None:
                weights = weights.view(-1, h, width, t, k.shape[2]).transpose(1, 2).reshape(r, h, t, k.shape[2])
        return self.out(merge_heads(out)), weights
