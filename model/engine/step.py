"""The incremental decoder step at inference: the network's decoder math on its KV cache,
written for few operations per step; and ``EncoderPass``, the encoder written the same way for
the sentences a decoding session admits.

At the batch sizes of interactive use (one sentence: 1 row greedy, 4 rows beam 4) a step's
arithmetic is small, and what it costs is the number of operations and Python calls around
them (docs/benchmarks.md "The small-batch step"). ``DecoderStep`` binds every layer's weights
to its kernel once (``kernels.bind``) and runs a step as plain tensor calls, no module calls:

- attention as ``bmm`` over (rows x heads) batches, the 1/sqrt(Dh) scale folded into the copy
  that lays the queries out for it, and a source mask as an additive bias made once per batch
  composition (``baddbmm``): no per-step mask inversion or fill;
- the query, key and value of self-attention from one fused projection, keys and values
  written straight into the cache;
- heads merged by a view (``bmm``'s output is already (rows, heads x Dh)).

Where the model has the fused kernels (``model.engine.fused``: float32 activations on the CPU), each
attention sub-layer and each post-LN residual join is one call of them instead (~25% less time a
step at one sentence: docs/benchmarks.md "The fused step"), and so are the matrix products of at
most a few rows (``_FewRows``: the weights streamed with a prefetch, ~12% less a sentence at beam
4: "Small-row matrix products"), and of up to a few hundred on weights packed into panels (where a
loaded checkpoint's layers do not run on their panels alone already: ``kernels.PackedPanels``,
"Packed panels"); larger products stay the bound kernels'. On int8 plans the int8 products run
on the kernels' own int8 product ("An int8 product of our own"). The encoder's
attention and joins, and the joining sentences' cross-attention K/V, take them too. The same
results to float rounding (tests/model/test_fused.py).

The math is the network's: ``Transformer.decode`` (teacher-forced, modules) is the reference
the tests hold it to, post-LN and pre-LN, sinusoidal and learned positions. Inference only:
no dropout, and weights must not change while a ``DecoderStep`` is used (build a new one).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from model.engine import fused
from model.engine.cache import KVCache
from model.engine.kernels import BoundLinear, LinearKernel, PackedPanels, bind, int8_panels, reads_float_weight
from model.engine.kernels import aten as kernel_aten
from model.engine.shortlist import ShortlistColumns
from model.network.attention import attend
from model.network.linear import Linear, linear, uses_kernels
from model.network.masks import padding_mask
from model.network.transformer import DecoderLayer, EncoderLayer, Transformer


def _position_table(model: Transformer) -> torch.Tensor:
    """(P, D) the target positions a decoder step adds: learned or sinusoidal."""
    embed = model.tgt_embed
    positions = embed.learned.weight if embed.learned is not None else embed.table
    assert positions is not None
    return positions


def _device(model: Transformer) -> torch.device:
    """Where the model runs: its target embeddings' device (never released, unlike an untied
    output matrix, which inference on packed kernels leaves on the meta device)."""
    return model.tgt_embed.tokens.weight.device


def step_dtype(model: Transformer) -> torch.dtype:
    """What a decoder step computes in (its position table's dtype)."""
    return _position_table(model).dtype


def _fused_kernels(model: Transformer, fast: bool) -> ModuleType | None:
    """The fused kernels (``model.engine.fused``) a pass of ``model`` runs on: those the model names,
    where it runs float32 on the CPU's bound kernels (``fast``); else None."""
    positions = _position_table(model)
    if fast and positions.dtype == torch.float32 and positions.device.type == "cpu":
        return fused.load(model.fused_step)
    return None


def _bound(module: Linear) -> BoundLinear:
    return bind(module.kernel, module.weight, module.bias)


def _through(kernel: LinearKernel, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
    """The modules' own path (``model.network.linear.linear``: autograd and autocast aware)."""

    def run(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        return linear(x, weight, bias, kernel, relu)

    return run


def _through_linear(module: Linear) -> BoundLinear:
    return _through(module.kernel, module.weight, module.bias)


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float

    @classmethod
    def of(cls, norm: nn.LayerNorm) -> _Norm:
        return cls(norm.weight, norm.bias, norm.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


@dataclass(frozen=True)
class _FewRows:
    """Products of at most ``limit`` rows on the fused kernels' own matrix product (``linear``:
    the weights streamed with a prefetch, bias and ReLU in the same pass; ~30% faster than MKL at
    4 rows, ~10% at one: docs/benchmarks.md "Small-row matrix products"), and of up to
    ``panel_limit`` rows on a copy of the weight packed into panels (``panel_linear``, packed at
    the layer's first such call; faster than MKL from 5 rows to a few hundred: "Packed panels");
    more rows, or a weight they cannot read (packed int8 or oneDNN weights, a float16 table), on
    the bound kernel. An int8 layer of fbgemm's takes the kernels' own int8 product
    (``int8_linear``) up to ``int8_limit`` rows (``fused.INT8_ROWS``), on its quantized weight
    packed for them; one of the kernels' int8 panels already (``kernels.PackedInt8Panels``) is bound
    to them as it is."""

    kernels: ModuleType | None
    limit: int
    panel_limit: int = 0
    int8_limit: int = 0  # int8 layers: products of at most this many rows on the kernels' ``int8_linear``

    def wrap(
        self,
        bound: BoundLinear,
        kernel: LinearKernel,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        panels: bool = True,
    ) -> BoundLinear:
        """``bound`` (the layer's ``kernel`` on ``weight``, ``bias``), its products of few rows on
        the kernels' ``linear`` where the layer computes in float32 from that float weight (not
        int8, whose float weight may be kept for lookups or as a reference), and its products of
        more, up to ``panel_limit``, on packed panels where the layer runs MKL (``aten``: a model
        that kept its float weights; ``loading.load`` gives such layers their panels alone) and
        ``panels`` (not for the output projection: a vocabulary-wide copy, never measured)."""
        kernels = self.kernels
        if kernels is None:
            return bound
        if not reads_float_weight(kernel):
            return self._int8(bound, kernel, weight, bias)
        few = self.limit if fused.streamable(weight, bias) else 0
        on_mkl = panels and kernel is kernel_aten
        panel_limit = self.panel_limit if on_mkl and fused.packable(weight, bias, kernels.panel_width()) else 0
        if few <= 0 and panel_limit <= few:
            return bound
        linear, panel_linear, b = kernels.linear, kernels.panel_linear, _NO_BIAS if bias is None else bias
        packed: list[torch.Tensor] = []  # the panels, made at the first product that takes them

        def run(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
            rows = x.shape[0]
            if rows <= few and few and x.is_contiguous():
                return linear(x, weight, b, relu)
            if rows <= panel_limit and panel_limit and x.is_contiguous():
                if not packed:
                    packed.append(kernels.pack_panels(weight))
                return panel_linear(x, packed[0], b, relu)
            return bound(x, relu)

        return run

    def _int8(
        self, bound: BoundLinear, kernel: LinearKernel, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> BoundLinear:
        """``bound`` for an int8 layer (fbgemm's), its products of up to ``int8_limit`` rows on the
        kernels' ``int8_linear`` (fbgemm's quantized weight, packed into their panels now; each
        row's activations quantized apart: docs/benchmarks.md "An int8 product of our own")."""
        kernels = self.kernels
        ours = int8_panels(kernel, weight, bias, kernels) if self.int8_limit > 0 and kernels is not None else None
        if ours is None:
            return bound
        limit = self.int8_limit

        def run(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
            if x.shape[0] <= limit and x.dtype == torch.float32 and x.is_contiguous():
                return ours.run(x, relu)
            return bound(x, relu)

        return run

    def product(
        self, x: torch.Tensor, weight: torch.Tensor, panels: Callable[[ModuleType], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """x (R, K) wᵀ for a float weight (N, K) that is a new tensor at every call (a shortlist's
        rows), so checked here with attribute reads only: on the kernels' ``linear`` up to
        ``limit`` rows, then up to ``panel_limit`` on the panels ``panels(kernels)`` gives for it
        (``Vocabulary.panels``: ``always``'s rows, packed once); ``F.linear`` where
        neither fits."""
        kernels, rows = self.kernels, x.shape[0]
        readable = weight.dtype == torch.float32 and weight.shape[1] % 16 == 0 and weight.is_contiguous()
        if kernels is None or not (readable and x.is_contiguous()):
            return F.linear(x, weight)
        if rows <= self.limit:
            return kernels.linear(x, weight, _NO_BIAS, False)
        if panels is not None and rows <= self.panel_limit:
            return kernels.panel_product(x, panels(kernels), weight.shape[0])
        return F.linear(x, weight)


_NO_BIAS = torch.empty(0)
_ALL_VISIBLE = torch.empty(0, dtype=torch.bool)  # ``self_attend``'s mask when every row sees every cached key
_EVERY_ROW = torch.empty(0, dtype=torch.long)  # the kernels' row maps when a step computes every row


def _few_rows(model: Transformer, kernels: ModuleType | None) -> _FewRows:
    """The small-product kernels of ``model``'s passes: the fused kernels' limits for its variant."""
    if kernels is None:
        return _FewRows(None, 0)
    variant = model.fused_step
    return _FewRows(
        kernels, fused.few_rows_limit(variant), fused.panel_rows_limit(variant), fused.int8_rows_limit(variant)
    )


def _bind(module: Linear, fast: bool, few: _FewRows) -> BoundLinear:
    """``module`` bound to its kernel, its small products on the fused kernels (``_FewRows``);
    where the kernels do not run (``fast`` false), the module's own path."""
    return few.wrap(_bound(module), module.kernel, module.weight, module.bias) if fast else _through_linear(module)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights, bound: self-attention (fused QKV, output), cross-attention
    (query, output; its K/V come projected in the cache), feed-forward, and the three norms."""

    qkv: BoundLinear
    self_out: BoundLinear
    cross_q: BoundLinear
    cross_out: BoundLinear
    fc1: BoundLinear
    fc2: BoundLinear
    self_norm: _Norm
    cross_norm: _Norm
    ff_norm: _Norm

    @classmethod
    def of(cls, layer: DecoderLayer, fast: bool, few: _FewRows) -> _Layer:
        def b(module: Linear) -> BoundLinear:
            return _bind(module, fast, few)

        sa, ca, ff = layer.self_attn, layer.cross_attn, layer.ff
        return cls(
            b(sa.qkv), b(sa.out), b(ca.q), b(ca.out), b(ff.fc1), b(ff.fc2),
            _Norm.of(layer.self_block.norm), _Norm.of(layer.cross_block.norm), _Norm.of(layer.ff_block.norm),
        )  # fmt: skip


def _panel_stack(
    kernels: ModuleType | None, weights: str, layers: list[tuple[dict[str, Linear], dict[str, nn.LayerNorm]]]
) -> tuple[list[object], float] | None:
    """The layers of the fused kernels' ``decoder_layers`` or ``encoder_layers`` (every layer of a
    pass in one call: at one row the Python between the kernels was a sixth of a decoder step),
    each the kernels' class ``weights`` (``DecoderLayerWeights``, ``EncoderLayerWeights``) made
    from its linear layers and norms by the kernels' names, and the norms' epsilon, where they can
    run: post-LN layers whose products all run on these kernels' packed panels (``PackedPanels``:
    float32 weights released on a plan on ``panels``, ``loading.load``) and whose norms share one
    epsilon; else None."""
    if kernels is None:
        return None
    stack: list[object] = []
    eps = set()
    for linears, norms in layers:
        named: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, module in linears.items():
            kernel = module.kernel
            if not isinstance(kernel, PackedPanels) or kernel.product != kernels.panel_linear:
                return None
            named[name] = (kernel.panels, kernel.bias)
        for name, norm in norms.items():
            named[name] = (norm.weight, norm.bias)
            eps.add(norm.eps)
        stack.append(getattr(kernels, weights)(**named))
    return (stack, eps.pop()) if len(eps) == 1 else None


def _residual(x: torch.Tensor, y: torch.Tensor, norm: _Norm, norm_first: bool) -> torch.Tensor:
    """A sub-layer's output y joins the stream x: post-LN norm(x + y); pre-LN (y computed from
    norm(x)) x + y."""
    return x + y if norm_first else norm(x + y)


def _join(fused: ModuleType, x: torch.Tensor, y: torch.Tensor, norm: _Norm, post: bool) -> torch.Tensor:
    """``_residual`` on the fused kernels: post-LN norm(x + y) in place in x (one call); pre-LN x + y."""
    return fused.add_norm_(x, y, norm.weight, norm.bias, norm.eps) if post else x + y


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """q (N, Tq, Dh) already scaled, k and v (N, Tk, Dh), bias (N, 1, Tk) | None -> (N, Tq, Dh)."""
    scores = torch.bmm(q, k.transpose(1, 2)) if bias is None else torch.baddbmm(bias, q, k.transpose(1, 2))
    return torch.bmm(torch.softmax(scores, dim=-1), v)


def additive_mask(mask: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor | None:
    """mask (B, 1, 1, K) bool (True: may attend) -> bias (B*H, 1, K), 0 where allowed and the
    dtype's minimum where blocked (a weight of exactly 0 after softmax, like ``fill_blocked``);
    None when nothing is blocked."""
    if bool(mask.all()):
        return None
    b, k = mask.shape[0], mask.shape[-1]
    bias = torch.zeros(b, 1, 1, k, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return bias.expand(b, heads, 1, k).reshape(b * heads, 1, k)


class DecoderStep:
    """A model's incremental decoder step, weights bound once (see the module's docstring)."""

    def __init__(self, model: Transformer) -> None:
        cfg = model.config
        self.model = model
        self.heads, self.head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
        # 1/sqrt(Dh) as a 0-d float32 tensor: a Python float in ``torch.mul`` is wrapped and
        # converted on every call (6 calls a step); the same float32 value either way.
        self.scale = torch.tensor(1.0 / math.sqrt(self.head_dim), dtype=torch.float32)
        self.norm_first = cfg.norm_first
        # The bound kernels skip autograd and autocast; anything else takes the modules' path.
        fast = uses_kernels(_device(model))
        embed = model.tgt_embed
        self.positions = _position_table(model)
        self.fused = _fused_kernels(model, fast)
        self.few_rows = _few_rows(model, self.fused)
        self.layers = [_Layer.of(layer, fast, self.few_rows) for layer in model.decoder_layers]
        # where every product runs on packed panels, all layers of a step in one call
        self.stack = None if self.norm_first else _panel_stack(self.fused, "DecoderLayerWeights", [
            (dict(self_qkv=layer.self_attn.qkv, self_out=layer.self_attn.out, cross_q=layer.cross_attn.q,
                  cross_out=layer.cross_attn.out, fc1=layer.ff.fc1, fc2=layer.ff.fc2),
             dict(self_norm=layer.self_block.norm, cross_norm=layer.cross_block.norm, ff_norm=layer.ff_block.norm))
            for layer in model.decoder_layers
        ])  # fmt: skip
        # each layer's cross-attention K/V projection, for the memory of sentences that join
        self.cross_kv = [_bind(layer.cross_attn.kv, fast, self.few_rows) for layer in model.decoder_layers]
        out = model.output_matrix()
        self.output = (
            self.few_rows.wrap(bind(model.kernel, out, None), model.kernel, out, None, panels=False)
            if fast
            else _through(model.kernel, out, None)
        )
        self.final_norm = None if model.decoder_norm is None else _Norm.of(model.decoder_norm)
        self.tokens, self.embed_scale = embed.tokens.weight, embed.scale
        self.max_positions = embed.max_positions
        self._memory: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (mask, its bias)
        # for the fused kernels: the scale as the float they take; the memory mask's rows
        self.scale_value = 1.0 / math.sqrt(self.head_dim)
        # the K/V cache in float16 (int8 plans: kernels.KernelPlan.kv_dtype), for the fused kernels only
        self.half_cache = self.fused is not None and model.kv_dtype == torch.float16
        self._memory_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (mask, mask[:, 0, 0])

    def _memory_bias(self, memory_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The cross-attention bias (B*H, 1, S) of a memory mask, made again only when the
        mask is another tensor (a session replaces it when sentences join or leave)."""
        cached = self._memory  # (read once: a step shared by two threads' sessions stays consistent)
        if cached is None or cached[0] is not memory_mask:
            cached = self._memory = (memory_mask, additive_mask(memory_mask, self.heads, dtype))
        return cached[1]

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
        admissions' largest cost after the encoder (docs/benchmarks.md "Marian on the Zen 5, and
        serving against offline measured again")."""
        b, s, d = memory.shape
        flat = memory.reshape(b * s, d)
        tokens = None  # (T,) the tokens' places in (B, S) order, where there is padding
        if mask is not None and self.fused is not None:
            places = mask.reshape(-1).nonzero()[:, 0]
            if places.numel() < b * s:
                tokens, flat = places, flat.index_select(0, places)
        projected = []
        for kv in self.cross_kv:
            if self.fused is not None:  # one call instead of a view, a permute, a copy and two selects
                both = kv(flat, False)  # (T or B*S, 2 * D)
                if tokens is not None:
                    both = both.new_zeros(b * s, both.shape[1]).index_copy_(0, tokens, both)
                k, v = self.fused.split_kv(both, b, self.heads, self.half_cache)
                projected.append((k, v))
                continue
            both = kv(flat, False).view(b, s, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).contiguous()
            projected.append((both[0], both[1]))  # (B, H, S, Dh) each
        return projected

    def __call__(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        memory_mask: torch.Tensor,
        positions: torch.Tensor | None = None,
        self_mask: torch.Tensor | None = None,
        output: ShortlistColumns | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One incremental step. tokens: (R,) the last emitted ids, R = B * W (W hypotheses
        per sentence); memory_mask (B, 1, 1, S) -> logits (R, V); or with a shortlist's columns
        (``output``, ``model.engine.shortlist``) the logits (R, N) over the N every sentence shares and
        (R, E) each row's over its sentence's own, -inf past its count (apart: the beams' advance
        reads both, and joining them would copy every row's logits once more).

        By default every row is at position ``cache.length`` and sees every cached key. Rows
        that joined a running batch later pass their own ``positions`` (R,) and a ``self_mask``
        (R, 1, 1, cache.length + 1) that hides the keys from before they joined.

        ``rows`` (R',) int64, fused kernels only (``fused``): compute only these of the cache's
        B * W rows, in order; tokens, positions and self_mask are then theirs (R' of each), and so
        are the logits. The other rows' keys and values at this position are left unwritten: for
        rows that nothing reads from there on (``DecodeSession``'s joiners' copies)."""
        if rows is not None and self.fused is None:
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
        if self.fused is not None:
            x = self.fused.embed(tokens, self.tokens, where, self.embed_scale)  # (R, D)
            x = self._fused_layers(x, cache, memory_mask, self_mask, rows, sentences)
        else:
            embedded = F.embedding(tokens, self.tokens)
            if embedded.dtype != where.dtype:  # a float16 lookup table (loading.release_output_projection)
                embedded = embedded.to(where.dtype)
            x = torch.add(where, embedded, alpha=self.embed_scale)  # (R, D)
            x = self._layers(x, cache, memory_mask, self_mask)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if output is None:
            return self.output(x, False)
        return self._shortlist_logits(x, output, sentences)

    def _shortlist_logits(
        self, x: torch.Tensor, columns: ShortlistColumns, sentences: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (R, D) -> logits over a shortlist's columns: (R, N) the shared ones for every row (one
        product), and (R, E) each row's sentence's own (``span_logits`` on the fused kernels, a
        batched product over the sentences padded to the widest otherwise)."""
        shared = self.few_rows.product(x, columns.always_rows, columns.panels)  # (R, N)
        if columns.width == 0:
            return shared, shared.new_empty(x.shape[0], 0)
        d = x.shape[1]
        readable = columns.extra_rows.dtype in (torch.float32, torch.float16) and d % 16 == 0
        if self.fused is not None and readable and x.dtype == torch.float32 and x.is_contiguous():
            every = _EVERY_ROW if sentences is None else sentences
            own = self.fused.span_logits(x, every, columns.extra_rows, columns.spans, columns.width)
        else:  # a batched product over the sentences' own rows padded to the widest
            weights, valid = columns.padded_rows, columns.padded[1]  # (A, E, D), (A, E)
            if sentences is None:  # every row: W of each sentence, in order
                a = weights.shape[0]
                own = torch.bmm(x.view(a, -1, d), weights.transpose(1, 2)).masked_fill_(~valid[:, None, :], -math.inf)
            else:  # some rows (fused kernels, a width they do not take): each with its sentence's rows
                own = torch.bmm(x[:, None, :], weights[sentences].transpose(1, 2))
                own = own.masked_fill_(~valid[sentences][:, None, :], -math.inf)
            own = own.reshape(x.shape[0], -1)
        return shared, own.to(shared.dtype)

    def _layers(
        self, x: torch.Tensor, cache: KVCache, memory_mask: torch.Tensor, self_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """x (R, D) through every layer on tensor operations -> (R, D)."""
        h, dh, scale = self.heads, self.head_dim, self.scale
        r, d, b = x.shape[0], x.shape[1], cache.sentences
        w = r // b
        cross_bias = self._memory_bias(memory_mask, x.dtype)
        self_bias = None if self_mask is None else additive_mask(self_mask, h, x.dtype)
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            # self-attention: one projection, K/V appended to the cache, (R*H) batched matmuls
            hx = layer.self_norm(x) if self.norm_first else x
            qkv = layer.qkv(hx, False)  # (R, 3D)
            q = torch.mul(qkv[:, :d], scale).view(r * h, 1, dh)
            cached = layer_cache.self_attention
            cached.write(qkv[:, d : 2 * d].view(r, h, 1, dh), qkv[:, 2 * d :].view(r, h, 1, dh))
            k, v = cached.flat()  # (R*H, L+1, Dh)
            out = _attend(q, k, v, self_bias).view(r, d)  # (R*H, 1, Dh) is (R, D)
            x = _residual(x, layer.self_out(out, False), layer.self_norm, self.norm_first)
            # cross-attention: a sentence's W hypotheses query its memory together
            hx = layer.cross_norm(x) if self.norm_first else x
            q = torch.mul(layer.cross_q(hx, False), scale)  # (R, D)
            q = q.view(b * h, 1, dh) if w == 1 else q.view(b, w, h, dh).transpose(1, 2).reshape(b * h, w, dh)
            out = _attend(q, *layer_cache.cross_attention.flat, cross_bias)  # (B*H, W, Dh)
            out = out.view(r, d) if w == 1 else out.view(b, h, w, dh).transpose(1, 2).reshape(r, d)
            x = _residual(x, layer.cross_out(out, False), layer.cross_norm, self.norm_first)
            # feed-forward
            hx = layer.ff_norm(x) if self.norm_first else x
            x = _residual(x, layer.fc2(layer.fc1(hx, True), False), layer.ff_norm, self.norm_first)
        return x

    def _fused_layers(
        self,
        x: torch.Tensor,
        cache: KVCache,
        memory_mask: torch.Tensor,
        self_mask: torch.Tensor | None,
        computed: torch.Tensor | None = None,
        sentences: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (R, D) through every layer, each attention sub-layer and post-LN residual join one
        call of the fused kernels (``model.engine.fused``) -> (R, D); ``computed``: ``__call__``'s ``rows``,
        ``sentences`` each one's sentence."""
        fused, scale, post = self.fused, self.scale_value, not self.norm_first
        assert fused is not None
        cache_rows = _EVERY_ROW if computed is None else computed
        sentences = _EVERY_ROW if sentences is None else sentences
        visible = _ALL_VISIBLE if self_mask is None else self_mask.reshape(x.shape[0], -1)
        rows = self._memory_rows
        if rows is None or rows[0] is not memory_mask:
            rows = self._memory_rows = (memory_mask, memory_mask[:, 0, 0])  # (B, S) bool
        source = rows[1]
        if self.stack is not None:
            slots = [layer_cache.self_attention.next_slot() for layer_cache in cache.layers]
            # each layer's pending reorder, copied by its attention (``SelfAttentionCache.reorder``'s defer)
            reorders = [layer_cache.self_attention.take_deferred() for layer_cache in cache.layers]
            memories = [layer_cache.cross_attention for layer_cache in cache.layers]
            params, eps = self.stack
            return fused.decoder_layers(
                x, params, [k for k, _, _ in slots], [v for _, v, _ in slots], [p for _, _, p in slots], visible,
                [m.k for m in memories], [m.v for m in memories], source, scale, eps, cache_rows, sentences, reorders,
            )  # fmt: skip
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            k, v, position = layer_cache.self_attention.next_slot()
            reorder = layer_cache.self_attention.take_deferred()
            qkv = layer.qkv(x if post else layer.self_norm(x), False)  # (R, 3D)
            y = layer.self_out(fused.self_attend(qkv, k, v, position, visible, scale, cache_rows, reorder), False)
            x = _join(fused, x, y, layer.self_norm, post)
            cross = layer_cache.cross_attention
            q = layer.cross_q(x if post else layer.cross_norm(x), False)
            y = layer.cross_out(fused.cross_attend(q, cross.k, cross.v, source, scale, sentences), False)
            x = _join(fused, x, y, layer.cross_norm, post)
            y = layer.fc2(layer.fc1(x if post else layer.ff_norm(x), True), False)
            x = _join(fused, x, y, layer.ff_norm, post)
        return x


@dataclass(frozen=True)
class _EncoderLayer:
    """One encoder layer's weights, bound: fused QKV, attention output, feed-forward, two norms."""

    qkv: BoundLinear
    out: BoundLinear
    fc1: BoundLinear
    fc2: BoundLinear
    attn_norm: _Norm
    ff_norm: _Norm

    @classmethod
    def of(cls, layer: EncoderLayer, fast: bool, few: _FewRows) -> _EncoderLayer:
        def b(module: Linear) -> BoundLinear:
            return _bind(module, fast, few)

        sa, ff = layer.self_attn, layer.ff
        return cls(
            b(sa.qkv), b(sa.out), b(ff.fc1), b(ff.fc2),
            _Norm.of(layer.attn_block.norm), _Norm.of(layer.ff_block.norm),
        )  # fmt: skip


# The encoder's activations grow with the batch (the feed-forward layer's alone are B x S x 4D
# floats, and int8's fbgemm linear allocates an int32 accumulator as large beside its output):
# 64 sentences of 42 pieces made ~27 MiB of them, and the heap holes they left grew the process
# at every longer batch. Groups of at most this many padded positions bound them: bench.decode's
# batch-64 peak int8 greedy 137 -> 114 MiB (median of 5), beam 4 162 -> 153, float32 2-3 MiB less,
# speed within the noise; the encoder alone 2% (float32) / 5% (int8) slower at 1,024, 7% / 13% at
# 512 (docs/benchmarks.md "MKL's buffer pool, and where the rest of batch memory goes").
ENCODER_CHUNK_TOKENS = 1024


class EncoderPass:
    """A model's encoder at inference, weights bound to their kernels once: the same math as
    ``Transformer.encode`` (the same attention function, so the same numbers; on the fused
    kernels' attention and joins, the same to float rounding), without the module calls around
    it. A decoding session encodes every sentence that joins it, a few at a time under
    continuous batching, where the modules' per-call overhead was a sixth of the encoder's time
    (docs/benchmarks.md "Serving: the event loop's share"). Inference only: no dropout, and
    weights must not change while it is used; where the linear layers do not run on their
    kernels (``uses_kernels``: a GPU, autograd, autocast), it takes the modules' path,
    as ``DecoderStep`` does."""

    def __init__(self, model: Transformer) -> None:
        cfg = model.config
        self.model = model
        self.heads, self.pad_id, self.norm_first = cfg.n_heads, cfg.pad_id, cfg.norm_first
        fast = uses_kernels(_device(model))
        # the fused kernels' attention, post-LN joins and small products where the decoder step
        # has them: at one sentence the encoder's SDPA, head permutes, adds and norms cost a third
        # of its time (docs/benchmarks.md "Small-row matrix products"), and MKL runs its products
        # of a few sentences' rows far below its peak ("Packed panels")
        self.fused = _fused_kernels(model, fast)
        few = _few_rows(model, self.fused)
        self.layers = [_EncoderLayer.of(layer, fast, few) for layer in model.encoder_layers]
        self.final_norm = None if model.encoder_norm is None else _Norm.of(model.encoder_norm)
        self.scale = 1.0 / math.sqrt(cfg.d_model // cfg.n_heads)
        # where every product runs on packed panels, all layers in one call
        self.stack = None if self.norm_first else _panel_stack(self.fused, "EncoderLayerWeights", [
            (dict(qkv=layer.self_attn.qkv, out=layer.self_attn.out, fc1=layer.ff.fc1, fc2=layer.ff.fc2),
             dict(attn_norm=layer.attn_block.norm, ff_norm=layer.ff_block.norm))
            for layer in model.encoder_layers
        ])  # fmt: skip

    def __call__(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src: (B, S) ids -> memory (B, S, D), source mask (B, 1, 1, S). Sentences go through
        the layers in groups of at most ``ENCODER_CHUNK_TOKENS`` padded positions (at least one
        sentence), each group's output written into the batch's memory; where every layer runs
        in one call of the fused kernels (``stack``), their tokens alone (``_unpadded``)."""
        mask = padding_mask(src, self.pad_id)
        b, s = src.shape
        if self.stack is not None:
            return self._unpadded(src, mask), mask
        per = max(1, ENCODER_CHUNK_TOKENS // max(s, 1))
        if b <= per:
            return self._encode(src, mask), mask
        first = self._encode(src[:per], mask[:per])
        memory = first.new_empty(b, s, first.shape[-1])
        memory[:per] = first
        del first
        for start in range(per, b, per):
            memory[start : start + per] = self._encode(src[start : start + per], mask[start : start + per])
        return memory, mask

    def _unpadded(self, src: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """src (B, S) ids, mask (B, 1, 1, S) -> memory (B, S, D), zeros at padded positions. The
        sentences' tokens go through the layers end to end, without their padding (the fused
        kernels' ``encoder_layers_ragged``): sentences that join a running batch a few at a time
        are as long as chance makes them, and test_2016 in groups of four padded to their longest
        is 39% padding (sorted batches of 64: 8%) that the products would compute for nothing
        (docs/benchmarks.md "Admissions without padding"). Groups of whole sentences of at most
        ``ENCODER_CHUNK_TOKENS`` tokens, as the padded path's."""
        fused = self.fused
        assert fused is not None and self.stack is not None
        b, s = src.shape
        tokens = mask.reshape(-1).nonzero()[:, 0]  # (T,) the tokens' places in (B, S) order
        x = self._fused_embed(src, tokens)  # (T, D)
        lengths = mask.reshape(b, s).sum(1).tolist()
        params, eps = self.stack
        memory = x.new_zeros(b * s, x.shape[1])
        start = first = 0
        while first < b:  # whole sentences, at most ENCODER_CHUNK_TOKENS tokens (at least one sentence)
            last, stop = first + 1, start + lengths[first]
            while last < b and stop + lengths[last] - start <= ENCODER_CHUNK_TOKENS:
                stop += lengths[last]
                last += 1
            offsets = torch.tensor([0, *itertools.accumulate(lengths[first:last])])
            y = fused.encoder_layers_ragged(x[start:stop], params, offsets, self.heads, self.scale, eps)
            memory.index_copy_(0, tokens[start:stop], y if self.final_norm is None else self.final_norm(y))
            start, first = stop, last
        return memory.view(b, s, -1)

    def _encode(self, src: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """src: (B, S) ids, mask (B, 1, 1, S) -> memory (B, S, D), all sentences at once."""
        b, s = src.shape
        if self.fused is not None:
            x = self._fused_layers(self._fused_embed(src), mask.reshape(b, s))  # (B*S, D)
            d = x.shape[1]
            return (x if self.final_norm is None else self.final_norm(x)).view(b, s, d)
        x = self.model.src_embed(src)  # (B, S, D)
        d, h = x.shape[2], self.heads
        x = x.reshape(b * s, d)
        for layer in self.layers:
            y = layer.attn_norm(x) if self.norm_first else x
            q, k, v = layer.qkv(y, False).view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)  # (B, H, S, Dh) each
            out, _ = attend(q, k, v, mask)
            merged = out.transpose(1, 2).reshape(b * s, d)  # heads merged, rows in (B, S) order
            x = _residual(x, layer.out(merged, False), layer.attn_norm, self.norm_first)
            y = layer.ff_norm(x) if self.norm_first else x
            x = _residual(x, layer.fc2(layer.fc1(y, True), False), layer.ff_norm, self.norm_first)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x.view(b, s, d)

    def _fused_embed(self, src: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """src (B, S) ids -> the embedded positions (B*S, D), or only those at ``tokens`` (T,)
        (places in (B, S) order) -> (T, D), in one call of the fused kernels
        (``Embedding.forward``'s sum: scaled token embedding plus position)."""
        embedding = self.model.src_embed
        s = src.shape[1]
        if s > embedding.max_positions:
            raise ValueError(f"sequence of {s} positions exceeds max_positions {embedding.max_positions}")
        table = embedding.learned.weight if embedding.learned is not None else embedding.table
        assert table is not None and self.fused is not None
        ids, positions = (
            (src.reshape(-1), table[:s]) if tokens is None else (src.reshape(-1)[tokens], table[tokens % s])
        )
        return self.fused.embed(ids, embedding.tokens.weight, positions, embedding.scale)

    def _fused_layers(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B*S, D) through every layer, attention and post-LN joins on the fused kernels;
        mask (B, S) bool -> (B*S, D)."""
        fused, post, h, scale = self.fused, not self.norm_first, self.heads, self.scale
        assert fused is not None
        mask = mask.contiguous()
        if self.stack is not None:
            params, eps = self.stack
            return fused.encoder_layers(x, params, mask, h, scale, eps)
        for layer in self.layers:
            qkv = layer.qkv(x if post else layer.attn_norm(x), False)  # (B*S, 3D)
            y = layer.out(fused.encoder_attend(qkv, mask, h, scale), False)
            x = _join(fused, x, y, layer.attn_norm, post)
            y = layer.fc2(layer.fc1(x if post else layer.ff_norm(x), True), False)
            x = _join(fused, x, y, layer.ff_norm, post)
        return x


# Each model's passes, bound once: a decoding session starts with them instead of binding every
# layer again (~0.4 ms, a few percent of one sentence's decoding: docs/benchmarks.md "The fused step").
_PASSES: weakref.WeakKeyDictionary[Transformer, _Passes] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Passes:
    key: tuple[object, ...]  # what they were bound under (``_bound_under``)
    parameters: list[nn.Parameter]
    encoder: EncoderPass
    decoder: DecoderStep


def _bound_under(model: Transformer, parameters: list[nn.Parameter]) -> tuple[object, ...]:
    return (
        uses_kernels(_device(model)),
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
