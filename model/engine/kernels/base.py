"""What every linear kernel is: ``Kernel``, the interface each backend implements once (a call
on a layer's weights, the same call with the weights bound once for a caller that runs the layer
many times, and the packed copy that can replace the float weight), and the helpers backends
share: a cache of packed copies per parameter and the row flattening of packed kernels."""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import ModuleType
from typing import ClassVar

import torch

# (x (R, in), relu) -> (R, out): one layer's weights bound to its kernel (``Kernel.bind``)
BoundLinear = Callable[[torch.Tensor, bool], torch.Tensor]
# An int8 layer's weight as quantized: (N, K) int8, its scale per output channel (N,) float32,
# its bias (N,) float32 or None
Int8Weight = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class Kernel(ABC):
    """One backend's matrix product for a linear layer: ``kernel(x, weight, bias, relu)`` is
    ``relu(x @ weight.T + bias)`` (the network's ``LinearKernel`` call), to the backend's rounding.

    A backend says what it reads (``reads_float_weight``: the float weight it is called with;
    ``packed_copy``: a copy of its own, the weight a placeholder), binds a layer's weights once
    for the decoder step (``bind``), and names the packed kernel that can run the layer without
    its float weight (``packed``)."""

    name: ClassVar[str]
    reads_float_weight: ClassVar[bool] = False
    packed_copy: ClassVar[bool] = False

    @abstractmethod
    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        """x: (..., in), weight: (out, in), bias: (out,) | None -> (..., out)."""

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
        """This kernel with one layer's weights looked up (and packed) once, for 2-d inputs at
        inference: a decoder step runs many linears, and at a few rows the per-call lookups cost
        as much as the arithmetic. Only for weights that stay unchanged while it is used."""

        def run_kernel(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
            return self(x, weight, bias, relu)

        return run_kernel

    def packed(
        self, weight: torch.Tensor, bias: torch.Tensor | None, panels: ModuleType | None = None
    ) -> Kernel | None:
        """The kernel that runs this layer from a packed copy of ``weight`` (and ``bias``) alone,
        without reading them again (``panels``: the fused kernels, where a plan packs float32
        layers into their panels); None where the layer keeps reading its weight."""
        return None

    def int8_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Weight | None:
        """An int8 layer's weight as its backend quantized it; None for a float kernel."""
        return None


class PackedCopies:
    """Packed copies of parameters, made once per version of their values and dropped when
    the parameter is freed (a WeakKeyDictionary would compare tensors with ==). An in-place
    update (an optimizer step) bumps the version, and the copy is rebuilt."""

    def __init__(self, pack: Callable[[torch.Tensor, torch.Tensor | None], object]) -> None:
        self.pack = pack
        self.entries: dict[int, tuple[weakref.ref[torch.Tensor], tuple[int, int], object]] = {}
        self.lock = threading.Lock()

    def get(self, weight: torch.Tensor, bias: torch.Tensor | None) -> object:
        key, version = id(weight), (weight._version, -1 if bias is None else bias._version)
        with self.lock:
            entry = self.entries.get(key)
            if entry is None or entry[0]() is not weight or entry[1] != version:
                ref = weakref.ref(weight, lambda _: self.entries.pop(key, None))
                entry = (ref, version, self.pack(weight.detach(), None if bias is None else bias.detach()))
                self.entries[key] = entry
            return entry[2]


class OnRows(Kernel):
    """A packed kernel called as a ``LinearKernel``: inputs of any leading dimensions, flattened
    to the rows its ``run`` takes (R, in) -> (R, out_features); the ``weight`` and ``bias`` it is
    called with are placeholders and are not read."""

    packed_copy = True
    out_features: int

    @abstractmethod
    def run(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        """x: (R, in) -> (R, out_features)."""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        """x: (..., in) -> (..., out)."""
        return self.run(x.reshape(-1, x.shape[-1]), relu).view(*x.shape[:-1], self.out_features)

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
        return self.run
