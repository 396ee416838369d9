"""torch's own matrix products: ``aten`` (``F.linear``), ``upcast`` (``F.linear`` on a narrower
stored weight) and ``wx`` (MKL's sgemm as W·xᵀ). They read the float weight they are called
with; a plan on the fused kernels' panels packs ``aten`` layers into panels at load."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from model.engine.fused import packable
from model.engine.kernels.base import BoundLinear, Kernel
from model.engine.kernels.panel_ops import pack_panels


class Aten(Kernel):
    """``F.linear``, then ReLU in place."""

    name = "aten"
    reads_float_weight = True

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        out = F.linear(x, weight, bias)
        return out.relu_() if relu else out

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
        if weight.dtype in (torch.float32, torch.float64) and weight.device.type == "cpu":
            return _bound_aten(weight, bias)
        return super().bind(weight, bias)

    def packed(
        self, weight: torch.Tensor, bias: torch.Tensor | None, panels: ModuleType | None = None
    ) -> Kernel | None:
        """With the fused kernels (a plan on ``panels``), the layer's weight in their panels."""
        if panels is not None and packable(weight, bias):
            return pack_panels(weight, bias, panels)
        return None


def _bound_aten(weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
    """``aten`` for 2-d inputs, calling what ``F.linear`` calls (``addmm(bias, x, Wᵀ)``, or ``mm``
    without a bias) on a transposed view made once: the same numbers without ``F.linear``'s and
    ``t``'s dispatch, which a decoder step would pay on every layer
    (docs/benchmarks/README.md#numbers-behind-the-code)."""
    transposed = weight.t()

    if bias is None:

        def run_mm(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
            out = torch.mm(x, transposed)
            return out.relu_() if relu else out

        return run_mm

    def run_addmm(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        out = torch.addmm(bias, x, transposed)
        return out.relu_() if relu else out

    return run_addmm


class Upcast(Kernel):
    """``aten`` on a weight (and bias) kept in a narrower float dtype than ``x``, converted per
    call: for a layer that seldom runs and whose rows are stored once for another reader (the
    output projection when a shortlist gathers its rows from the float16 token table:
    ``loading.shortlist_output``)."""

    name = "upcast"

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        return aten(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), relu)


class Wx(Kernel):
    """MKL's sgemm (``torch.mm``) as W·xᵀ, transposed back with the bias added in the same pass:
    x (..., in) -> (..., out), contiguous. The same product as ``F.linear``'s x·Wᵀ, but on this
    operand order MKL's small-row kernels run faster on AVX2, and unlike oneDNN it builds and
    caches nothing per row count, so the decoder step's layers save the primitives oneDNN would
    keep for each of their shapes (docs/benchmarks/README.md#linear-kernels). Reads the float
    weight as it is: one copy, no packing."""

    name = "wx"
    reads_float_weight = True

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        if x.dtype != weight.dtype:
            return aten(x, weight, bias, relu)  # F.linear's error
        rows = x.numel() // max(x.shape[-1], 1)
        yt = torch.mm(weight, x.reshape(rows, x.shape[-1]).t())  # (out, rows)
        out = torch.empty((rows, weight.shape[0]), dtype=yt.dtype, device=yt.device)
        if bias is None:
            out.copy_(yt.t())
        else:
            torch.add(yt.t(), bias, out=out)
        if relu:
            out.relu_()
        return out.view(*x.shape[:-1], weight.shape[0])


aten = Aten()
upcast = Upcast()
wx = Wx()
