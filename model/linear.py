"""``nn.Linear`` whose inference runs through the kernel ``model.kernels`` chose.

Training, autocast regions (the trainer's bf16 validation), other devices and anything that
needs gradients keep ``F.linear``: the packed kernels have no autograd formula and no
autocast rule. At inference on the CPU the call goes to the layer's ``kernel`` (oneDNN on
prepacked weights, fbgemm int8, or ``F.linear``), which ``model.kernels.install`` sets from
the CPU's features; until then ``kernels.auto`` picks this machine's kernel for the input's
dtype. Results agree with ``F.linear`` to the kernel's rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import kernels
from model.kernels import LinearKernel


def uses_kernels(device: torch.device) -> bool:
    """Whether linear layers on ``device`` run through their kernel now: on the CPU, at
    inference (no gradients), outside autocast; the rest is ``F.linear``'s."""
    return device.type == "cpu" and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernel: LinearKernel = kernels.auto,
    relu: bool = False,
) -> torch.Tensor:
    """x: (..., in), weight: (out, in), bias: (out,) | None -> (..., out), like ``F.linear``
    (followed by ReLU when ``relu``: the packed kernels fuse it)."""
    if uses_kernels(x.device):
        return kernel(x, weight, bias, relu)
    if (weight.is_meta or kernels.is_packed(kernel)) and not x.is_meta:
        raise RuntimeError(
            "this layer's float weights were released for inference on packed copies "
            "(model.kernels.release_float_weights): it runs on the CPU in inference mode only; "
            "load the checkpoint with keep_float_weights=True for anything else"
        )
    out = F.linear(x, weight, bias)
    return F.relu(out) if relu else out


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) whose forward is ``linear``."""

    kernel: LinearKernel = staticmethod(kernels.auto)

    def forward(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernel, relu)
