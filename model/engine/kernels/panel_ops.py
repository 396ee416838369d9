"""The fused kernels' float32 product on weights packed into panels (``panel_columns``): one
layer's kernel once its float weight is released, at every row count, its bias added in the
same pass. The model keeps one copy of the weight, the panels
(docs/benchmarks/README.md#linear-kernels); for a tied output projection they are the token
table too (``tables.TokenTable``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.engine.kernels.base import OnRows


@dataclass(frozen=True, eq=False)
class PackedPanels(OnRows):
    """``panel_columns`` on ``panels`` (ceil(out / width), in, width: a vocabulary's last panel
    padded) and its own ``bias`` (out,) (empty: none); the ``weight`` and ``bias`` it is called
    with are placeholders and are not read."""

    name = "panels"

    panels: torch.Tensor
    bias: torch.Tensor
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, int], torch.Tensor]  # ``panel_columns``
    out_features: int

    @property
    def whole_panels(self) -> bool:
        """Whether every panel is the weight's (no padding): what the kernels' layer stacks read."""
        return self.panels.shape[0] * self.panels.shape[2] == self.out_features

    def run(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        """x: (R, in) float32 -> (R, out) (another dtype is refused, as ``F.linear`` does)."""
        if x.dtype != torch.float32:
            raise RuntimeError(f"expected float32 input for a float32 layer, got {x.dtype}")
        return self.product(x if x.is_contiguous() else x.contiguous(), self.panels, self.bias, relu, self.out_features)


def pack_panels(weight: torch.Tensor, bias: torch.Tensor | None, fused: object) -> PackedPanels:
    """A float32 layer's weight (out, in) packed into ``fused``'s panels (the fused kernels' module)."""
    no_bias = weight.new_empty(0)
    packed = fused.pack_panels(weight.detach())  # type: ignore[attr-defined]
    b = None if bias is None else bias.detach()
    return PackedPanels(packed, no_bias if b is None else b, fused.panel_columns, weight.shape[0])  # type: ignore[attr-defined]
