"""The fused kernels' int8 product (``int8_linear``) on fbgemm's quantization of a weight packed
into their int8 panels: one int8 layer's kernel once its float weight is released, where the
fused kernels take the int8 products of every row count, so the model keeps this copy alone,
not fbgemm's beside it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from model.engine.fused import int8_packable
from model.engine.kernels.base import Kernel, OnRows


@dataclass(frozen=True, eq=False)
class PackedInt8Panels(OnRows):
    """``int8_linear`` (each row's activations quantized apart) on ``panels`` (out / 16, in / 4,
    16, 4) int8 with their ``colsums`` (out,) int32 and ``scales`` (out,) float32, its own
    ``bias`` (out,) float32 (empty: none) added in the same pass; the ``weight`` and ``bias`` it
    is called with are placeholders and are not read."""

    name = "int8-panels"

    panels: torch.Tensor
    colsums: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor
    product: Callable[..., torch.Tensor]  # the kernels' ``int8_columns``
    out_features: int

    def run(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        """x: (R, in) -> (R, out) in x's dtype (computed from float32, as fbgemm's kernels do)."""
        ready = x.dtype == torch.float32 and x.is_contiguous()
        out = self.product(
            x if ready else x.float().contiguous(),
            self.panels,
            self.colsums,
            self.scales,
            self.bias,
            relu,
            self.out_features,
        )
        return out if out.dtype == x.dtype else out.to(x.dtype)


def int8_panels(
    kernel: object, weight: torch.Tensor, bias: torch.Tensor | None, fused: ModuleType
) -> PackedInt8Panels | None:
    """An int8 layer of fbgemm's (``Int8Kernel``, ``PackedInt8``) as the fused kernels' int8 panels:
    its quantized weight (``Kernel.int8_weight``) packed by their ``pack_int8``; None for a layer
    of another kernel, or a shape ``pack_int8`` cannot take (fbgemm's then stays)."""
    found = kernel.int8_weight(weight, bias) if isinstance(kernel, Kernel) else None
    if found is None or not int8_packable(found[0]):
        return None
    quantized, scales, b = found
    panels, colsums = fused.pack_int8(quantized)
    scales = F.pad(scales, (0, colsums.shape[0] - scales.shape[0]))  # (a padded last panel's outputs: unread)
    no_bias = scales.new_empty(0)
    out = quantized.shape[0]
    return PackedInt8Panels(panels, colsums, scales, no_bias if b is None else b, fused.int8_columns, out)
