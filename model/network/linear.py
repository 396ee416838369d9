"""``nn.Linear`` whose inference runs through a ``LinearKernel`` the inference engine gives it.

The network defines the kernel's signature and knows nothing of the kernels themselves: the
engine (``model.engine.kernels``) installs one per layer from the CPU's features, and registers
what ``auto`` runs until then (``use_machine_kernel``: this machine's kernel for the input's
dtype); with no engine loaded ``auto`` is ``F.linear``. Training, autocast regions (the trainer's
bf16 validation), other devices and anything that needs gradients keep ``F.linear``: the packed
kernels have no autograd formula and no autocast rule. Results agree with ``F.linear`` to the
kernel's rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# (x, weight, bias, relu) -> relu(x @ weight.T + bias) if relu else x @ weight.T + bias
LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
    """``F.linear`` (then ReLU): what ``auto`` runs until an engine registers its choice."""
    out = F.linear(x, weight, bias)
    return F.relu(out) if relu else out


_machine_kernel: LinearKernel = reference


def use_machine_kernel(kernel: LinearKernel) -> None:
    """Make ``auto`` run ``kernel`` (the engine registers its per-dtype choice when imported)."""
    global _machine_kernel
    _machine_kernel = kernel


def auto(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
    """What layers use before a kernel is installed: the registered machine kernel."""
    return _machine_kernel(x, weight, bias, relu)


def is_packed(kernel: object) -> bool:
    """Whether ``kernel`` runs from a packed copy of its own, so the float weight it is called with
    is a placeholder (the engine's packed kernels say so with ``packed_copy``)."""
    return bool(getattr(kernel, "packed_copy", False))


def uses_kernels(device: torch.device) -> bool:
    """Whether linear layers on ``device`` run through their kernel now: on the CPU, at
    inference (no gradients), outside autocast; the rest is ``F.linear``'s."""
    return device.type == "cpu" and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernel: LinearKernel = auto,
    relu: bool = False,
) -> torch.Tensor:
    """x: (..., in), weight: (out, in), bias: (out,) | None -> (..., out), like ``F.linear``
    (followed by ReLU when ``relu``: the packed kernels fuse it)."""
    if uses_kernels(x.device):
        return kernel(x, weight, bias, relu)
    if (weight.is_meta or is_packed(kernel)) and not x.is_meta:
        raise RuntimeError(
            "this layer's float weights were released for inference on packed copies "
            "(model.engine.kernels.release_float_weights): it runs on the CPU in inference mode only; "
            "load the checkpoint with keep_float_weights=True for anything else"
        )
    out = F.linear(x, weight, bias)
    return F.relu(out) if relu else out


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) whose forward is ``linear``."""

    kernel: LinearKernel = staticmethod(auto)

    def forward(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernel, relu)
