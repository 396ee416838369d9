"""oneDNN's matmul on a packed copy of the weight: ``onednn`` (packs a parameter on first use,
keeps reading it) and ``PackedOneDNN`` (the packed copy alone, once the float weight is
released). ReLU runs as oneDNN's post-op."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import cast

import torch
from torch import nn

from model.engine.kernels.base import BoundLinear, Kernel, PackedCopies
from model.engine.kernels.torch_ops import aten

# ``F.linear`` beats the packed oneDNN call at one row for the model's inner layers, not for the
# vocabulary-wide output projection (docs/benchmarks/README.md#numbers-behind-the-code). A model
# whose float weights were released (``PackedOneDNN``) runs every row count packed.
ATEN_MAX_ROWS = 1
ATEN_MAX_OUT = 4096

# oneDNN builds a matmul primitive for every row count it sees and keeps the last
# ``ONEDNN_PRIMITIVE_CACHE`` of them (model/engine/allocator.py), each with its descriptor. The
# decoder's row count changes whenever a sentence finishes or joins, so rows are padded up to
# one of ``ROW_BUCKETS_PER_OCTAVE`` sizes per power of two (exact up to ``EXACT_ROWS``); above
# ``ONEDNN_MAX_ROWS`` rows (the encoder's sentences x tokens) they run in chunks of that size, so
# no new shape reaches the caches and peak memory stays bounded
# (docs/benchmarks/README.md#numbers-behind-the-code).
EXACT_ROWS = 4
ROW_BUCKETS_PER_OCTAVE = 2
ONEDNN_MAX_ROWS = 256


def _pack_onednn(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(out, in) float weight -> oneDNN's packed copy (the bias is added by the call itself)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


_onednn_packed = PackedCopies(_pack_onednn)


def bucket_rows(rows: int) -> int:
    """The row count oneDNN runs for ``rows`` rows: rows itself up to ``EXACT_ROWS``, else
    rows rounded up to a multiple of 1/``ROW_BUCKETS_PER_OCTAVE`` of the power of two below."""
    if rows <= EXACT_ROWS:
        return rows
    step = max(1, (1 << ((rows - 1).bit_length() - 1)) // ROW_BUCKETS_PER_OCTAVE)
    return -(-rows // step) * step


class OneDNN(Kernel):
    """oneDNN matmul on a packed copy of a parameter, ReLU fused as a post-op, rows padded to
    ``bucket_rows`` (in chunks above ``ONEDNN_MAX_ROWS``); ``F.linear`` for one row of a small
    layer (and for mixed dtypes, to raise ``F.linear``'s error)."""

    name = "onednn"
    reads_float_weight = True

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if _aten_instead(x, weight, rows):
            return aten(x, weight, bias, relu)
        w = _onednn_weight(weight)
        out = _onednn_rows(x.reshape(rows, x.shape[-1]), w, bias, relu, rows)
        return out.view(*x.shape[:-1], out.shape[-1])

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
        packed = _onednn_weight(weight)

        def run(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
            rows = x.shape[0]
            if _aten_instead(x, weight, rows):
                return aten(x, weight, bias, relu)
            return _onednn_rows(x, packed, bias, relu, rows)

        return run

    def packed(
        self, weight: torch.Tensor, bias: torch.Tensor | None, panels: ModuleType | None = None
    ) -> Kernel | None:
        """float32: the packed copy alone (bfloat16 keeps both: its oneDNN path is AVX-512's only)."""
        if weight.dtype != torch.float32:
            return None
        return PackedOneDNN(_pack_onednn(weight.detach()), None if bias is None else bias.detach())


def _aten_instead(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    """Where ``onednn`` hands a call to ``F.linear``: one row of a small layer, or mixed dtypes."""
    return x.dtype != weight.dtype or (rows <= ATEN_MAX_ROWS and weight.shape[0] <= ATEN_MAX_OUT)


def _onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """A parameter's packed copy (made once per version of its values); other tensors as they are."""
    return cast(torch.Tensor, _onednn_packed.get(weight, None)) if isinstance(weight, nn.Parameter) else weight


def _onednn_rows(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, relu: bool, rows: int
) -> torch.Tensor:
    """x: (rows, in) -> (rows, out) through the packed weight, rows padded to ``bucket_rows``;
    more than ``ONEDNN_MAX_ROWS`` (itself a bucket) in chunks of that many and one bucket."""
    post = "relu" if relu else "none"
    if rows == 0:
        return x.new_empty(0, packed.shape[0])
    if rows > ONEDNN_MAX_ROWS:
        full = rows - rows % ONEDNN_MAX_ROWS
        parts = [_matmul(x[i : i + ONEDNN_MAX_ROWS], packed, bias, post) for i in range(0, full, ONEDNN_MAX_ROWS)]
        if full < rows:
            parts.append(_onednn_rows(x[full:], packed, bias, relu, rows - full))
        return torch.cat(parts)
    padded = bucket_rows(rows)
    if padded == rows:
        return _matmul(x, packed, bias, post)
    staged = x.new_empty(padded, x.shape[-1])
    staged[:rows].copy_(x)
    staged[rows:].zero_()
    return _matmul(staged, packed, bias, post)[:rows]


def _matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, post: str) -> torch.Tensor:
    """The oneDNN call itself: x (R, in) with R a bucket -> (R, out)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, post, [], "")


@dataclass(frozen=True, eq=False)
class PackedOneDNN(Kernel):
    """One float layer's kernel once its weight is released (``release_float_weights``): oneDNN
    on the packed copy (out, in) and its own bias, at every row count (more than
    ``ONEDNN_MAX_ROWS`` rows in chunks of that many, so no new shapes reach oneDNN's caches);
    the ``weight`` and ``bias`` it is called with are placeholders and are not read."""

    name = "onednn"
    packed_copy = True

    packed_weight: torch.Tensor
    bias: torch.Tensor | None

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        """x: (..., in) -> (..., out)."""
        return self.run(x.reshape(-1, x.shape[-1]), relu).view(*x.shape[:-1], self.packed_weight.shape[0])

    def run(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        """x: (R, in) -> (R, out), in the weight's dtype (another dtype is refused, as ``F.linear`` does)."""
        if x.dtype != self.packed_weight.dtype:
            raise RuntimeError(
                f"expected {self.packed_weight.dtype} input for a {self.packed_weight.dtype} layer, got {x.dtype}"
            )
        return _onednn_rows(x, self.packed_weight, self.bias, relu, x.shape[0])

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
        return self.run


onednn = OneDNN()
