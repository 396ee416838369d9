"""The incremental decoder step at inference: the network's decoder math on its KV cache,
written for few operations per step.

At the batch sizes of interactive use (one sentence: 1 row greedy, 4 rows beam 4) a step's
arithmetic is small, and what it costs is the number of operations and Python calls around
them (docs/benchmarks/README.md#fused-step). ``DecoderStep`` binds every layer's weights to its
kernel once (``model.engine.binding``) and runs a step as plain tensor calls, no module calls.
Between the matrix products it runs ``layer_ops``' operations: the fused C++ kernels where the
model has them (float32 activations on the CPU), torch's tensor operations otherwise, with the
same results to float rounding (tests/model/test_fused.py). Each layer is written once for both
(``_layers``); where every product runs on the fused kernels' packed panels and the layers are
post-LN, the whole stack is one call of theirs instead (``_stacked_layers``).

The math is the network's: ``Transformer.decode`` (teacher-forced, modules) is the reference
the tests hold it to, post-LN and pre-LN, sinusoidal and learned positions. Inference only:
no dropout, and weights must not change while a ``DecoderStep`` is used (build a new one).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from model.engine.binding import (
    BoundDecoderLayer,
    Norm,
    bind_layer,
    few_rows_of,
    fused_kernels,
    panel_stack,
    position_table,
    through,
)
from model.engine.cache import KVCache
from model.engine.encoder import EncoderPass
from model.engine.kernels import bind, token_table
from model.engine.layer_ops import StepShape, layer_ops
from model.engine.shortlist import ShortlistColumns
from model.network.linear import uses_kernels
from model.network.transformer import Transformer


class DecoderStep:
    """A model's incremental decoder step, weights bound once (see the module's docstring)."""

    def __init__(self, model: Transformer) -> None:
        cfg = model.config
        self.model = model
        self.heads, self.head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
        self.norm_first = cfg.norm_first
        # The bound kernels skip autograd and autocast; anything else takes the modules' path.
        fast = uses_kernels(model.device)
        embed = model.tgt_embed
        self.positions = position_table(model)
        self.fused = fused_kernels(model, fast)
        self.ops = layer_ops(self.fused, self.heads, self.head_dim)
        self.few_rows = few_rows_of(model, self.fused)
        self.layers = [BoundDecoderLayer.of(layer, fast, self.few_rows) for layer in model.decoder_layers]
        # where every product runs on packed panels, all layers of a step in one call
        self.stack = panel_stack(self.fused, "DecoderLayerWeights", [
            (dict(self_qkv=layer.self_attn.qkv, self_out=layer.self_attn.out, cross_q=layer.cross_attn.q,
                  cross_out=layer.cross_attn.out, fc1=layer.ff.fc1, fc2=layer.ff.fc2),
             dict(self_norm=layer.self_block.norm, cross_norm=layer.cross_block.norm, ff_norm=layer.ff_block.norm))
            for layer in model.decoder_layers
        ], cfg)  # fmt: skip
        # each layer's cross-attention K/V projection, for the memory of sentences that join
        self.cross_kv = [bind_layer(layer.cross_attn.kv, fast, self.few_rows) for layer in model.decoder_layers]
        out, bias = model.output_matrix(), model.output_bias
        self.output = (
            self.few_rows.wrap(bind(model.kernel, out, bias), model.kernel, out, bias, panels=False)
            if fast
            else through(model.kernel, out, bias)
        )
        self.final_norm = None if model.decoder_norm is None else Norm.of(model.decoder_norm)
        self.tokens, self.embed_scale = token_table(embed), embed.scale
        self.max_positions = embed.max_positions
        self.scale_value = 1.0 / math.sqrt(self.head_dim)  # (the float the fused kernels take)
        # the K/V cache in float16 (int8 plans: kernels.KernelPlan.kv_dtype), for the fused kernels only
        self.half_cache = self.ops.caches_half and model.kv_dtype == torch.float16

    def project_memory(
        self, memory: torch.Tensor, mask: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """memory (B, S, D) -> every layer's cross-attention K, V, each (B, H, S, Dh) and
        contiguous: ``Transformer.project_memory`` on the bound kernels, one copy a layer; in
        float16 where the model's cache is (``half_cache``: the self-attention cache follows
        their dtype, ``LayerCache``). With the memory's ``mask`` (B, 1, 1, S) and the fused
        kernels, only the sentences' tokens are projected and K, V are zeros at the padded
        positions, which the mask hides: sentences join a running batch in groups padded to
        their longest, as ``EncoderPass._unpadded`` says, and these products were the
        admissions' largest cost after the encoder (docs/benchmarks/README.md#encoder-chunk)."""
        b, s, d = memory.shape
        flat = memory.reshape(b * s, d)
        tokens = None  # (T,) the tokens' places in (B, S) order, where there is padding
        if mask is not None and self.ops.projects_tokens_only:
            places = mask.reshape(-1).nonzero()[:, 0]
            if places.numel() < b * s:
                tokens, flat = places, flat.index_select(0, places)
        projected = []
        for kv in self.cross_kv:
            both = kv(flat, False)  # (T or B*S, 2 * D)
            if tokens is not None:
                both = both.new_zeros(b * s, both.shape[1]).index_copy_(0, tokens, both)
            projected.append(self.ops.split_kv(both, b, s, self.half_cache))
        return projected

    def __call__(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        memory_mask: torch.Tensor,
        positions: torch.Tensor | None = None,
        self_mask: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One incremental step -> logits (R, V). tokens: (R,) the last emitted ids, R = B * W (W
        hypotheses per sentence); memory_mask (B, 1, 1, S).

        By default every row is at position ``cache.length`` and sees every cached key. Rows
        that joined a running batch later pass their own ``positions`` (R,) and a ``self_mask``
        (R, 1, 1, cache.length + 1) that hides the keys from before they joined.

        ``rows`` (R',) int64, fused kernels only (``fused``): compute only these of the cache's
        B * W rows, in order; tokens, positions and self_mask are then theirs (R' of each), and so
        are the logits. The other rows' keys and values at this position are left unwritten: for
        rows that nothing reads from there on (``DecodeSession``'s joiners' copies)."""
        x, _ = self._hidden(tokens, cache, memory_mask, positions, self_mask, rows)
        return self.output(x, False)

    def shortlisted(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        memory_mask: torch.Tensor,
        columns: ShortlistColumns,
        positions: torch.Tensor | None = None,
        self_mask: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``__call__`` through a shortlist's columns (``model.engine.shortlist``): the logits (R, N)
        over the N every sentence shares and (R, E) each row's over its sentence's own, -inf past
        its count (apart: the beams' advance reads both, and joining them would copy every row's
        logits once more)."""
        x, sentences = self._hidden(tokens, cache, memory_mask, positions, self_mask, rows)
        return self._shortlist_logits(x, columns, sentences)

    def _hidden(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        memory_mask: torch.Tensor,
        positions: torch.Tensor | None,
        self_mask: torch.Tensor | None,
        rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step up to the output projection -> the final hidden states (R, D) and each
        computed row's sentence (R',) where only ``rows`` are computed."""
        if rows is not None and not self.ops.computes_some_rows:
            raise ValueError("computing some of the rows needs the fused kernels")
        length = cache.length
        if positions is None:
            if length >= self.max_positions:
                raise ValueError(f"sequence of {length + 1} positions exceeds max_positions {self.max_positions}")
            where = self.positions[length]  # (D,)
        else:
            where = self.positions[positions]  # (R, D)
        # each computed row's sentence (the cache's rows are W a sentence)
        sentences = None if rows is None else rows.div(cache.batch_size // cache.sentences, rounding_mode="floor")
        x = self.ops.embed(tokens, self.tokens, where, self.embed_scale)  # (R, D)
        r, b = x.shape[0], cache.sentences
        shape = StepShape(r, b, r // b, self.heads, self.head_dim)
        step = self.ops.begin(shape, memory_mask, self_mask, rows, sentences, x.dtype)
        x = self._layers(x, step, cache) if self.stack is None else self._stacked_layers(x, step, cache)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, sentences

    def _shortlist_logits(
        self, x: torch.Tensor, columns: ShortlistColumns, sentences: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (R, D) -> logits over a shortlist's columns: (R, N) the shared ones for every row (one
        product), and (R, E) each row's sentence's own (``span_logits`` on the fused kernels, a
        batched product over the sentences padded to the widest otherwise)."""
        shared = self.few_rows.product(x, columns.always_rows, columns.panels)  # (R, N)
        if columns.width == 0:
            return shared, shared.new_empty(x.shape[0], 0)
        own = self.ops.own_logits(x, columns, sentences)
        return shared, own.to(shared.dtype)

    def _layers(self, x: torch.Tensor, step: object, cache: KVCache) -> torch.Tensor:
        """x (R, D) through every layer -> (R, D): a sub-layer's input normed first (pre-LN) or
        its output joined and normed (post-LN, ``LayerOps.join``)."""
        ops, post = self.ops, not self.norm_first
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            qkv = layer.qkv(x if post else layer.self_norm(x), False)  # (R, 3D)
            y = layer.self_out(ops.self_attention(step, qkv, layer_cache.self_attention), False)
            x = ops.join(x, y, layer.self_norm, post)
            q = layer.cross_q(x if post else layer.cross_norm(x), False)  # (R, D)
            y = layer.cross_out(ops.cross_attention(step, q, layer_cache.cross_attention), False)
            x = ops.join(x, y, layer.cross_norm, post)
            x = ops.join(x, layer.ff(x if post else layer.ff_norm(x)), layer.ff_norm, post)
        return x

    def _stacked_layers(self, x: torch.Tensor, step: object, cache: KVCache) -> torch.Tensor:
        """x (R, D) through every layer in one call of the fused kernels' ``decoder_layers``
        (post-LN with ReLU, every product on packed panels: ``binding.stack_runs``) -> (R, D)."""
        assert self.fused is not None and self.stack is not None
        visible, source = step.visible, step.source  # type: ignore[attr-defined]
        cache_rows, sentences = step.cache_rows, step.sentences  # type: ignore[attr-defined]
        slots = [layer_cache.self_attention.next_slot() for layer_cache in cache.layers]
        # each layer's pending reorder, copied by its attention (``SelfAttentionCache.reorder``'s defer)
        reorders = [layer_cache.self_attention.take_deferred() for layer_cache in cache.layers]
        memories = [layer_cache.cross_attention for layer_cache in cache.layers]
        params, eps = self.stack
        return self.fused.decoder_layers(
            x, params, [k for k, _, _ in slots], [v for _, v, _ in slots], [p for _, _, p in slots], visible,
            [m.k for m in memories], [m.v for m in memories], source, self.scale_value, eps, cache_rows, sentences,
            reorders,
        )  # fmt: skip


# Each model's passes, bound once: a decoding session starts with them instead of binding every
# layer again, a few percent of one sentence's decoding (docs/benchmarks/README.md#fused-step).
_PASSES: weakref.WeakKeyDictionary[Transformer, _Passes] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Passes:
    key: tuple[object, ...]  # what they were bound under (``_bound_under``)
    parameters: list[nn.Parameter]
    encoder: EncoderPass
    decoder: DecoderStep


def _bound_under(model: Transformer, parameters: list[nn.Parameter]) -> tuple[object, ...]:
    return (
        uses_kernels(model.device),
        model.fused_step,
        model.kv_dtype,
        id(model.kernel),
        tuple((p.data_ptr(), -1 if p.is_inference() else p._version) for p in parameters),
    )


def bound_passes(model: Transformer) -> tuple[EncoderPass, DecoderStep]:
    """``model``'s ``EncoderPass`` and ``DecoderStep``, made once and handed to every decoding
    session while what they bound is unchanged: the same kernels path (``uses_kernels``: grad
    and autocast modes), fused kernels, KV cache dtype and linear kernel, and every parameter's storage and
    in-place version (a training step, ``load_state_dict`` or ``model.to`` changes them; not
    seen: a parameter replaced by a new object, or one made in inference mode changed in place,
    which has no version counter: build the passes yourself after that). Both
    are safe to share: ``EncoderPass`` keeps nothing between calls, and ``DecoderStep`` caches
    per memory mask only."""
    cached = _PASSES.get(model)
    if cached is None or cached.key != _bound_under(model, cached.parameters):
        parameters = list(model.parameters())
        cached = _Passes(_bound_under(model, parameters), parameters, EncoderPass(model), DecoderStep(model))
        _PASSES[model] = cached
    return cached.encoder, cached.decoder
