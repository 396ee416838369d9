"""A model's weights bound once for its inference passes (``DecoderStep``, ``EncoderPass``): each
linear layer to its kernel (``kernels.bind``), its small products on the fused kernels' own
(``FewRows``), the layer norms as plain tensors, and, where every product of a pass runs on
packed panels, the parameters of the fused kernels' whole layer stack (``panel_stack``).

Binding once is what lets a step run as plain tensor calls, with no module calls around them
(docs/benchmarks/README.md#fused-step)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from model.engine import fused
from model.engine.kernels import BoundLinear, LinearKernel, PackedPanels, bind, int8_panels, reads_float_weight
from model.engine.kernels import aten as kernel_aten
from model.network.config import ModelConfig
from model.network.linear import Linear, linear
from model.network.transformer import DecoderLayer, EncoderLayer, Transformer, activation_after, feed_forward


def position_table(model: Transformer) -> torch.Tensor:
    """(P, D) the target positions a decoder step adds: learned or sinusoidal."""
    embed = model.tgt_embed
    positions = embed.learned.weight if embed.learned is not None else embed.table
    assert positions is not None
    return positions


def step_dtype(model: Transformer) -> torch.dtype:
    """What a decoder step computes in (its position table's dtype)."""
    return position_table(model).dtype


def fused_kernels(model: Transformer, fast: bool) -> ModuleType | None:
    """The fused kernels (``model.engine.fused``) a pass of ``model`` runs on: those the model names,
    where it runs float32 on the CPU's bound kernels (``fast``); else None."""
    positions = position_table(model)
    if fast and positions.dtype == torch.float32 and positions.device.type == "cpu":
        return fused.load(model.fused_step)
    return None


def bound(module: Linear) -> BoundLinear:
    return bind(module.kernel, module.weight, module.bias)


def through(kernel: LinearKernel, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
    """The modules' own path (``model.network.linear.linear``: autograd and autocast aware)."""

    def run(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        return linear(x, weight, bias, kernel, relu)

    return run


def through_linear(module: Linear) -> BoundLinear:
    return through(module.kernel, module.weight, module.bias)


@dataclass(frozen=True)
class Norm:
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float

    @classmethod
    def of(cls, norm: nn.LayerNorm) -> Norm:
        return cls(norm.weight, norm.bias, norm.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


@dataclass(frozen=True)
class FewRows:
    """Products of at most ``limit`` rows on the fused kernels' own matrix product (``linear``:
    the weights streamed with a prefetch, bias and ReLU in the same pass: faster than MKL there),
    and of up to ``panel_limit`` rows on a copy of the weight packed into panels (``panel_columns``,
    packed at the layer's first such call: faster than MKL up to a few hundred rows;
    docs/benchmarks/README.md#linear-kernels);
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
        ``panels`` (not for the output projection of a model that kept its float weights: a second
        vocabulary-wide copy; ``loading.load`` gives it its panels alone as well)."""
        kernels = self.kernels
        if kernels is None:
            return bound
        if not reads_float_weight(kernel):
            return self._int8(bound, kernel, weight, bias)
        few = self.limit if fused.streamable(weight, bias) else 0
        on_mkl = panels and kernel is kernel_aten
        panel_limit = self.panel_limit if on_mkl and fused.packable(weight, bias) else 0
        if few <= 0 and panel_limit <= few:
            return bound
        linear, panel_columns, b = kernels.linear, kernels.panel_columns, NO_BIAS if bias is None else bias
        n = weight.shape[0]
        packed: list[torch.Tensor] = []  # the panels, made at the first product that takes them

        def run(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
            rows = x.shape[0]
            if rows <= few and few and x.is_contiguous():
                return linear(x, weight, b, relu)
            if rows <= panel_limit and panel_limit and x.is_contiguous():
                if not packed:
                    packed.append(kernels.pack_panels(weight))
                return panel_columns(x, packed[0], b, relu, n)
            return bound(x, relu)

        return run

    def _int8(
        self, bound: BoundLinear, kernel: LinearKernel, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> BoundLinear:
        """``bound`` for an int8 layer (fbgemm's), its products of up to ``int8_limit`` rows on the
        kernels' ``int8_linear`` (fbgemm's quantized weight, packed into their panels now; each
        row's activations quantized apart: docs/benchmarks/README.md#linear-kernels)."""
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
            return kernels.linear(x, weight, NO_BIAS, False)
        if panels is not None and rows <= self.panel_limit:
            return kernels.panel_product(x, panels(kernels), weight.shape[0])
        return F.linear(x, weight)


NO_BIAS = torch.empty(0)


def few_rows_of(model: Transformer, kernels: ModuleType | None) -> FewRows:
    """The small-product kernels of ``model``'s passes: the fused kernels' limits for its variant."""
    if kernels is None:
        return FewRows(None, 0)
    variant = model.fused_step
    return FewRows(
        kernels, fused.few_rows_limit(variant), fused.panel_rows_limit(variant), fused.int8_rows_limit(variant)
    )


def bind_layer(module: Linear, fast: bool, few: FewRows) -> BoundLinear:
    """``module`` bound to its kernel, its small products on the fused kernels (``FewRows``);
    where the kernels do not run (``fast`` false), the module's own path."""
    return few.wrap(bound(module), module.kernel, module.weight, module.bias) if fast else through_linear(module)


@dataclass(frozen=True)
class BoundDecoderLayer:
    """One decoder layer's weights, bound: self-attention (fused QKV, output), cross-attention
    (query, output; its K/V come projected in the cache), feed-forward, and the three norms."""

    qkv: BoundLinear
    self_out: BoundLinear
    cross_q: BoundLinear
    cross_out: BoundLinear
    fc1: BoundLinear
    fc2: BoundLinear
    self_norm: Norm
    cross_norm: Norm
    ff_norm: Norm
    after: Callable[[torch.Tensor], torch.Tensor] | None  # the activation after fc1 (None: ReLU, fused)

    def ff(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward sub-layer (``feed_forward``) on x (R, D) -> (R, D)."""
        return feed_forward(self.fc1, self.fc2, self.after, x)

    @classmethod
    def of(cls, layer: DecoderLayer, fast: bool, few: FewRows) -> BoundDecoderLayer:
        def b(module: Linear) -> BoundLinear:
            return bind_layer(module, fast, few)

        sa, ca, ff = layer.self_attn, layer.cross_attn, layer.ff
        return cls(
            b(sa.qkv), b(sa.out), b(ca.q), b(ca.out), b(ff.fc1), b(ff.fc2),
            Norm.of(layer.self_block.norm), Norm.of(layer.cross_block.norm), Norm.of(layer.ff_block.norm), ff.after,
        )  # fmt: skip


def stack_runs(config: ModelConfig) -> bool:
    """Whether the fused kernels' whole-stack calls (``decoder_layers``, ``encoder_layers``) compute
    this network exactly: post-LN layers with ReLU, the one layout they implement. Every other
    configuration (pre-LN, swish, GELU) runs layer by layer (``DecoderStep._layers``,
    ``EncoderPass._layers``), where each operation is the configuration's own; the one place the
    choice is made."""
    return not config.norm_first and activation_after(config.activation) is None


def panel_stack(
    kernels: ModuleType | None,
    weights: str,
    layers: list[tuple[dict[str, Linear], dict[str, nn.LayerNorm]]],
    config: ModelConfig,
) -> tuple[list[object], float] | None:
    """The layers of the fused kernels' ``decoder_layers`` or ``encoder_layers`` (every layer of a
    pass in one call: at one row the Python between the kernels is a large share of a decoder
    step), each the kernels' class ``weights`` (``DecoderLayerWeights``, ``EncoderLayerWeights``)
    made from its linear layers and norms by the kernels' names, and the norms' epsilon, where they
    can run: post-LN layers whose products all run on these kernels' packed panels
    (``PackedPanels``: float32 weights released on a plan on ``panels``, ``loading.load``) and whose
    norms share one epsilon, in a network the stack computes (``stack_runs``); else None."""
    if kernels is None or not stack_runs(config):
        return None
    stack: list[object] = []
    eps = set()
    for linears, norms in layers:
        named: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, module in linears.items():
            kernel = module.kernel
            if not isinstance(kernel, PackedPanels) or kernel.product != kernels.panel_columns:
                return None
            if not kernel.whole_panels:  # (the stack reads whole panels: none padded)
                return None
            named[name] = (kernel.panels, kernel.bias)
        for name, norm in norms.items():
            named[name] = (norm.weight, norm.bias)
            eps.add(norm.eps)
        stack.append(getattr(kernels, weights)(**named))
    return (stack, eps.pop()) if len(eps) == 1 else None


@dataclass(frozen=True)
class BoundEncoderLayer:
    """One encoder layer's weights, bound: fused QKV, attention output, feed-forward, two norms."""

    qkv: BoundLinear
    out: BoundLinear
    fc1: BoundLinear
    fc2: BoundLinear
    attn_norm: Norm
    ff_norm: Norm
    after: Callable[[torch.Tensor], torch.Tensor] | None  # the activation after fc1 (None: ReLU, fused)

    def ff(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward sub-layer (``feed_forward``) on x (B*S, D) -> (B*S, D)."""
        return feed_forward(self.fc1, self.fc2, self.after, x)

    @classmethod
    def of(cls, layer: EncoderLayer, fast: bool, few: FewRows) -> BoundEncoderLayer:
        def b(module: Linear) -> BoundLinear:
            return bind_layer(module, fast, few)

        sa, ff = layer.self_attn, layer.ff
        return cls(
            b(sa.qkv), b(sa.out), b(ff.fc1), b(ff.fc2),
            Norm.of(layer.attn_block.norm), Norm.of(layer.ff_block.norm), ff.after,
        )  # fmt: skip
