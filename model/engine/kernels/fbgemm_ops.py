"""fbgemm's dynamic int8 linear (torch's quantized engine): weights int8 per output channel,
activations quantized per call. ``Int8Kernel`` packs a parameter on first use; ``PackedInt8``
is the packed copy alone, once the float weight is released."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import torch

from model.engine.kernels.base import BoundLinear, Int8Weight, Kernel, PackedCopies


def _pack_int8(weight: torch.Tensor, bias: torch.Tensor | None) -> object:
    """(out, in) float weight -> fbgemm's packed int8 weight, symmetric per output channel."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch deprecates quantized tensors; fbgemm's packing still takes them
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        with quantized_engine("fbgemm"):
            return torch.ops.quantized.linear_prepack(q, None if bias is None else bias.float())


_int8_packed = PackedCopies(_pack_int8)


@contextmanager
def quantized_engine(name: str) -> Iterator[None]:
    """Select torch's quantized engine for a block (packing and running must agree)."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def _run_int8(x: torch.Tensor, packed: object, reduce_range: bool, relu: bool) -> torch.Tensor:
    op = torch.ops.quantized.linear_relu_dynamic if relu else torch.ops.quantized.linear_dynamic
    ready = x.dtype == torch.float32 and x.is_contiguous()  # (no conversion calls: each is a dispatch)
    out: torch.Tensor = op(x if ready else x.float().contiguous(), packed, reduce_range)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _unpacked(packed: object) -> Int8Weight:
    """fbgemm's packed weight as (N, K) int8, its scales (N,) and its bias (N,) or None."""
    with quantized_engine("fbgemm"):
        q, b = torch.ops.quantized.linear_unpack(packed)
    scales = q.q_per_channel_scales().to(torch.float32).contiguous()
    return q.int_repr().contiguous(), scales, None if b is None else b.detach().to(torch.float32).contiguous()


@dataclass(frozen=True)
class Int8Kernel(Kernel):
    """fbgemm's dynamic int8 linear: the input is quantized per call (one scale per tensor);
    ``reduce_range``: 7-bit activations, so AVX2's 16-bit accumulation cannot saturate."""

    name = "fbgemm-int8"

    reduce_range: bool

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        return _run_int8(x, _int8_packed.get(weight, bias), self.reduce_range, relu)

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
        return PackedInt8(_int8_packed.get(weight, bias), self.reduce_range).bind(weight, bias)

    def packed(
        self, weight: torch.Tensor, bias: torch.Tensor | None, panels: ModuleType | None = None
    ) -> Kernel | None:
        b = None if bias is None else bias.detach()
        return PackedInt8(_pack_int8(weight.detach(), b), self.reduce_range)

    def int8_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Weight | None:
        return _unpacked(_int8_packed.get(weight, bias))


@dataclass(frozen=True, eq=False)
class PackedInt8(Kernel):
    """One layer's kernel once its float weight is released (``release_float_weights``): its
    fbgemm-packed int8 weight and bias, run as ``Int8Kernel`` runs them; the ``weight`` and
    ``bias`` it is called with are placeholders and are not read."""

    name = "fbgemm-int8"
    packed_copy = True

    packed_weight: object
    reduce_range: bool

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        return _run_int8(x, self.packed_weight, self.reduce_range, relu)

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
        packed, reduce_range = self.packed_weight, self.reduce_range

        def run_int8(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
            return _run_int8(x, packed, reduce_range, relu)

        return run_int8

    def int8_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Weight | None:
        return _unpacked(self.packed_weight)
