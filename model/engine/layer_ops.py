"""The operations between a pass's matrix products, behind one interface with two
implementations: ``TensorOps`` (torch's tensor operations: the reference, any device and
dtype) and ``FusedOps`` (one call of the fused C++ kernels each, float32 activations on the
CPU). ``DecoderStep`` and ``EncoderPass`` write each layer once, per normalization order, and
call these; which implementation runs is chosen once, when the pass is bound
(``layer_ops``). The two give the same results to float rounding (tests/model/test_fused.py).

A step's ``begin`` prepares what every layer of that step shares (masks as additive biases or
row maps) and returns it as the context the layers' calls take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from model.engine.binding import Norm
from model.engine.cache import CrossAttentionCache, SelfAttentionCache
from model.engine.kernels.tables import TokenTable, token_table
from model.engine.shortlist import ShortlistColumns
from model.network.attention import attend
from model.network.transformer import Embedding

_ALL_VISIBLE = torch.empty(0, dtype=torch.bool)  # ``self_attend``'s mask when every row sees every cached key
EVERY_ROW = torch.empty(0, dtype=torch.long)  # the kernels' row maps when a step computes every row


def additive_mask(mask: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor | None:
    """mask (B, 1, 1, K) bool (True: may attend) -> bias (B*H, 1, K), 0 where allowed and the
    dtype's minimum where blocked (a weight of exactly 0 after softmax, like ``fill_blocked``);
    None when nothing is blocked."""
    if bool(mask.all()):
        return None
    return mask_bias(mask, heads, dtype)


def mask_bias(mask: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``additive_mask`` for a mask known to block something: without reading it back (a device
    sync on a GPU)."""
    b, k = mask.shape[0], mask.shape[-1]
    bias = torch.zeros(b, 1, 1, k, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return bias.expand(b, heads, 1, k).reshape(b * heads, 1, k)


def attend_scaled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """q (N, Tq, Dh) already scaled, k and v (N, Tk, Dh), bias (N, 1, Tk) | None -> (N, Tq, Dh)."""
    scores = torch.bmm(q, k.transpose(1, 2)) if bias is None else torch.baddbmm(bias, q, k.transpose(1, 2))
    return torch.bmm(torch.softmax(scores, dim=-1), v)


@dataclass(frozen=True)
class StepShape:
    """A decoder step's rows: R rows, B sentences, W hypotheses a sentence (R = B * W, or the
    computed rows' count with ``rows``), H heads of Dh."""

    rows: int
    sentences: int
    width: int
    heads: int
    head_dim: int


class LayerOps(Protocol):
    """What a decoder step and an encoder pass run between their matrix products."""

    def embed(self, tokens: torch.Tensor, table: TokenTable, where: torch.Tensor, scale: float) -> torch.Tensor:
        """tokens (R,) ids, table (its rows (V, D) or packed), where (D,) or (R, D) positions -> (R, D)
        scale * table[tokens] + where."""
        ...

    def begin(
        self,
        shape: StepShape,
        memory_mask: torch.Tensor,
        self_mask: torch.Tensor | None,
        rows: torch.Tensor | None,
        sentences: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> object:
        """What every layer of one decoder step shares (its masks), as the layers' context."""
        ...

    def self_attention(self, step: object, qkv: torch.Tensor, cache: SelfAttentionCache) -> torch.Tensor:
        """qkv (R, 3D) -> the heads' outputs merged (R, D); K, V written into ``cache`` first."""
        ...

    def cross_attention(self, step: object, q: torch.Tensor, cache: CrossAttentionCache) -> torch.Tensor:
        """q (R, D) over the sentences' memory K, V in ``cache`` -> (R, D)."""
        ...

    def encoder_attention(self, qkv: torch.Tensor, mask: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """qkv (B*S, 3D), mask (B, 1, 1, S) bool -> the heads' outputs merged (B*S, D)."""
        ...

    def join(self, x: torch.Tensor, y: torch.Tensor, norm: Norm, post: bool) -> torch.Tensor:
        """A sub-layer's output y joins the stream x: post-LN norm(x + y); pre-LN x + y."""
        ...

    # Whether a memory's cross-attention K/V are projected for its tokens alone (the padding's
    # left zeros, which the mask hides): sentences join a running batch in groups padded to
    # their longest.
    projects_tokens_only: bool

    def split_kv(self, both: torch.Tensor, b: int, s: int, half: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A memory's projected K and V side by side (B*S, 2D) -> K, V (B, H, S, Dh) each,
        contiguous; float16 where ``half`` (a float16 KV cache)."""
        ...

    # Whether a step may compute only some of the cache's rows (``DecoderStep``'s ``rows``) and
    # keep its K/V cache in float16 (``KernelPlan.kv_dtype``): both are the fused kernels' only.
    computes_some_rows: bool
    caches_half: bool

    # Whether the step's self-attention runs a pending KV cache reorder's copy itself, right
    # before it reads the rows (``SelfAttentionCache.take_deferred``), and never reads a row's
    # positions from before its sentence joined (its mask hides them): a reorder may then be left
    # to the step and copy each row's own positions only (``KVCache.reorder``'s ``defer`` and
    # ``first``). The fused kernels' only.
    takes_reorder: bool

    def embed_source(self, src: torch.Tensor, embedding: Embedding, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """src (B, S) ids -> the embedded positions (B*S, D), ``Embedding.forward``'s sum; with
        ``tokens`` (T,) (places in (B, S) order) only those -> (T, D)."""
        ...

    def own_logits(self, x: torch.Tensor, columns: ShortlistColumns, sentences: torch.Tensor | None) -> torch.Tensor:
        """x (R, D) -> (R, E) each row's logits over its sentence's own shortlist columns, -inf past
        their count; ``sentences`` (R,) each computed row's sentence, None: every row, W a sentence."""
        ...


@dataclass(frozen=True)
class _TensorStep:
    shape: StepShape
    self_bias: torch.Tensor | None
    cross_bias: torch.Tensor | None


class TensorOps:
    """Attention as ``bmm`` over (rows x heads) batches, the 1/sqrt(Dh) scale folded into the
    copy that lays the queries out, masks as additive biases (``baddbmm``); joins and the
    embedding as tensor expressions."""

    def __init__(self, heads: int, head_dim: int) -> None:
        self.heads, self.head_dim = heads, head_dim
        # 1/sqrt(Dh) as a 0-d float32 tensor: a Python float in ``torch.mul`` is wrapped and
        # converted on every call; the same float32 value either way.
        self.scale = torch.tensor(1.0 / math.sqrt(head_dim), dtype=torch.float32)
        self._memory: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (memory mask, its bias)

    def embed(self, tokens: torch.Tensor, table: TokenTable, where: torch.Tensor, scale: float) -> torch.Tensor:
        embedded = table(tokens)
        if embedded.dtype != where.dtype:  # a float16 lookup table (loading.release_output_projection)
            embedded = embedded.to(where.dtype)
        return torch.add(where, embedded, alpha=scale)  # (R, D)

    def begin(
        self,
        shape: StepShape,
        memory_mask: torch.Tensor,
        self_mask: torch.Tensor | None,
        rows: torch.Tensor | None,
        sentences: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> _TensorStep:
        if rows is not None:
            raise ValueError("computing some of the rows needs the fused kernels")
        # a late joiner's mask always hides keys (``DecodeSession._mask_late_joiners``)
        self_bias = None if self_mask is None else mask_bias(self_mask, shape.heads, dtype)
        cached = self._memory  # (read once: a step shared by two threads' sessions stays consistent)
        if cached is None or cached[0] is not memory_mask:
            # made again only when the mask is another tensor (a session replaces it when sentences join or leave)
            cached = self._memory = (memory_mask, additive_mask(memory_mask, shape.heads, dtype))
        return _TensorStep(shape, self_bias, cached[1])

    def self_attention(self, step: object, qkv: torch.Tensor, cache: SelfAttentionCache) -> torch.Tensor:
        assert isinstance(step, _TensorStep)
        r, h, dh = step.shape.rows, self.heads, self.head_dim
        d = h * dh
        q = torch.mul(qkv[:, :d], self.scale).view(r * h, 1, dh)
        cache.write(qkv[:, d : 2 * d].view(r, h, 1, dh), qkv[:, 2 * d :].view(r, h, 1, dh))
        k, v = cache.flat()  # (R*H, L+1, Dh)
        return attend_scaled(q, k, v, step.self_bias).view(r, d)  # (R*H, 1, Dh) is (R, D)

    def cross_attention(self, step: object, q: torch.Tensor, cache: CrossAttentionCache) -> torch.Tensor:
        """A sentence's W hypotheses query its memory together."""
        assert isinstance(step, _TensorStep)
        r, b, w, h, dh = step.shape.rows, step.shape.sentences, step.shape.width, self.heads, self.head_dim
        d = h * dh
        q = torch.mul(q, self.scale)  # (R, D)
        q = q.view(b * h, 1, dh) if w == 1 else q.view(b, w, h, dh).transpose(1, 2).reshape(b * h, w, dh)
        out = attend_scaled(q, *cache.flat, step.cross_bias)  # (B*H, W, Dh)
        return out.view(r, d) if w == 1 else out.view(b, h, w, dh).transpose(1, 2).reshape(r, d)

    def encoder_attention(self, qkv: torch.Tensor, mask: torch.Tensor, b: int, s: int) -> torch.Tensor:
        h, d = self.heads, self.heads * self.head_dim
        q, k, v = qkv.view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)  # (B, H, S, Dh) each
        out, _ = attend(q, k, v, mask)
        return out.transpose(1, 2).reshape(b * s, d)  # heads merged, rows in (B, S) order

    def join(self, x: torch.Tensor, y: torch.Tensor, norm: Norm, post: bool) -> torch.Tensor:
        return norm(x + y) if post else x + y

    projects_tokens_only = False
    computes_some_rows = False
    caches_half = False
    takes_reorder = False

    def split_kv(self, both: torch.Tensor, b: int, s: int, half: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(A float16 cache is the fused kernels' only: ``half`` is False here.)"""
        kv = both.view(b, s, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).contiguous()
        return kv[0], kv[1]  # (B, H, S, Dh) each

    def embed_source(self, src: torch.Tensor, embedding: Embedding, tokens: torch.Tensor | None = None) -> torch.Tensor:
        b, s = src.shape
        x = embedding(src).reshape(b * s, -1)
        return x if tokens is None else x.index_select(0, tokens)

    def own_logits(self, x: torch.Tensor, columns: ShortlistColumns, sentences: torch.Tensor | None) -> torch.Tensor:
        """A batched product over the sentences' own rows padded to the widest."""
        d = x.shape[1]
        weights, valid = columns.padded_rows, columns.padded[1]  # (A, E, D), (A, E)
        if sentences is None:  # every row: W of each sentence, in order
            a = weights.shape[0]
            own = torch.bmm(x.view(a, -1, d), weights.transpose(1, 2)).masked_fill_(~valid[:, None, :], -math.inf)
        else:  # some rows (the fused kernels' step, a width they do not take): each with its sentence's rows
            own = torch.bmm(x[:, None, :], weights[sentences].transpose(1, 2))
            own = own.masked_fill_(~valid[sentences][:, None, :], -math.inf)
        return own.reshape(x.shape[0], -1)


@dataclass(frozen=True)
class _FusedStep:
    visible: torch.Tensor  # (R, L+1) bool, or empty: every row sees every key
    source: torch.Tensor  # (B, S) bool
    cache_rows: torch.Tensor  # the computed rows, or empty: every row
    sentences: torch.Tensor  # each computed row's sentence, or empty


class FusedOps:
    """Each attention sub-layer (cache write, scores, softmax, weighted sum, heads merged), each
    post-LN join and the embedding in one call of the fused kernels (``model.engine.fused``)."""

    def __init__(self, kernels: ModuleType, heads: int, head_dim: int) -> None:
        self.kernels, self.heads = kernels, heads
        self.scale = 1.0 / math.sqrt(head_dim)  # the float the kernels take
        self._memory_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (mask, mask[:, 0, 0])

    def embed(self, tokens: torch.Tensor, table: TokenTable, where: torch.Tensor, scale: float) -> torch.Tensor:
        return self.kernels.embed(tokens, table.data, table.scales, where, scale)

    def begin(
        self,
        shape: StepShape,
        memory_mask: torch.Tensor,
        self_mask: torch.Tensor | None,
        rows: torch.Tensor | None,
        sentences: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> _FusedStep:
        visible = _ALL_VISIBLE if self_mask is None else self_mask.reshape(shape.rows, -1)
        cached = self._memory_rows  # (read once: a step shared by two threads' sessions stays consistent)
        if cached is None or cached[0] is not memory_mask:
            cached = self._memory_rows = (memory_mask, memory_mask[:, 0, 0])  # (B, S) bool
        every = EVERY_ROW
        return _FusedStep(
            visible, cached[1], every if rows is None else rows, every if sentences is None else sentences
        )

    def self_attention(self, step: object, qkv: torch.Tensor, cache: SelfAttentionCache) -> torch.Tensor:
        assert isinstance(step, _FusedStep)
        k, v, position = cache.next_slot()
        reorder = cache.take_deferred()  # the pending beam reorder, copied by the attention
        return self.kernels.self_attend(qkv, k, v, position, step.visible, self.scale, step.cache_rows, reorder)

    def cross_attention(self, step: object, q: torch.Tensor, cache: CrossAttentionCache) -> torch.Tensor:
        assert isinstance(step, _FusedStep)
        return self.kernels.cross_attend(q, cache.k, cache.v, step.source, self.scale, step.sentences)

    def encoder_attention(self, qkv: torch.Tensor, mask: torch.Tensor, b: int, s: int) -> torch.Tensor:
        return self.kernels.encoder_attend(qkv, mask.reshape(b, s).contiguous(), self.heads, self.scale)

    def join(self, x: torch.Tensor, y: torch.Tensor, norm: Norm, post: bool) -> torch.Tensor:
        """post-LN: norm(x + y) in place in x, one call."""
        return self.kernels.add_norm_(x, y, norm.weight, norm.bias, norm.eps) if post else x + y

    projects_tokens_only = True
    computes_some_rows = True
    caches_half = True
    takes_reorder = True

    def split_kv(self, both: torch.Tensor, b: int, s: int, half: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One call instead of a view, a permute, a copy and two selects."""
        k, v = self.kernels.split_kv(both, b, self.heads, half)
        return k, v

    def embed_source(self, src: torch.Tensor, embedding: Embedding, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One call, only the ``tokens`` where given."""
        s = src.shape[1]
        if s > embedding.max_positions:
            raise ValueError(f"sequence of {s} positions exceeds max_positions {embedding.max_positions}")
        table = embedding.learned.weight if embedding.learned is not None else embedding.table
        assert table is not None
        ids, positions = (
            (src.reshape(-1), table[:s]) if tokens is None else (src.reshape(-1)[tokens], table[tokens % s])
        )
        tokens_table = token_table(embedding)
        return self.kernels.embed(ids, tokens_table.data, tokens_table.scales, positions, embedding.scale)

    def own_logits(self, x: torch.Tensor, columns: ShortlistColumns, sentences: torch.Tensor | None) -> torch.Tensor:
        """One call (``span_logits``) where the kernels read the rows' dtype and width; the
        reference's batched product otherwise."""
        readable = columns.extra_rows.dtype in (torch.float32, torch.float16) and x.shape[1] % 16 == 0
        if not (readable and x.dtype == torch.float32 and x.is_contiguous()):
            return TensorOps.own_logits(self, x, columns, sentences)  # type: ignore[arg-type]
        every = EVERY_ROW if sentences is None else sentences
        return self.kernels.span_logits(x, every, columns.extra_rows, columns.spans, columns.width)


def layer_ops(kernels: ModuleType | None, heads: int, head_dim: int) -> LayerOps:
    """The fused kernels' operations where a pass runs on them, the tensor operations otherwise."""
    return TensorOps(heads, head_dim) if kernels is None else FusedOps(kernels, heads, head_dim)
