"""``nn.Linear`` that runs through oneDNN, with prepacked weights, on the CPU at inference.

torch's CPU ``F.linear`` goes to MKL's sgemm, which on this project's AMD EPYC machine ran
1.2-2x slower than oneDNN's matmul (also bundled with torch) for the decoder's shapes. oneDNN
is faster still when the weight is stored in its own blocked layout instead of being
reordered on every call: the 8,000-way output projection at 256 rows took 8.1 ms with
``F.linear``, 6.2 ms with oneDNN on the plain weight and 5.4 ms on the packed one; at 5 rows
(one sentence, beam 5) 456, 353 and 130 us (docs/benchmarks.md).

Packed copies are made on first use of each ``nn.Parameter`` and kept beside it (not in the
module or its state dict) until the parameter is freed; an in-place update of the parameter
(an optimizer step) bumps its version counter and the copy is rebuilt. oneDNN's op has no
autograd formula and no autocast rule, so training, autocast regions (the trainer's bf16
validation) and anything else that needs gradients keep ``F.linear``; results agree to float32
rounding.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN = torch.backends.mkldnn.is_available()
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)

# id(parameter) -> (weak reference to it, its version when packed, packed copy); an entry
# leaves when its parameter is freed. (A WeakKeyDictionary would compare tensors with ==.)
_packed: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}
_lock = threading.Lock()


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of a parameter (out, in), made once per version of its values."""
    key = id(weight)
    with _lock:
        entry = _packed.get(key)
        if entry is None or entry[0]() is not weight or entry[1] != weight._version:
            ref = weakref.ref(weight, lambda _: _packed.pop(key, None))
            entry = (ref, weight._version, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
            _packed[key] = entry
        return entry[2]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: (..., in), weight: (out, in), bias: (out,) | None -> (..., out), like ``F.linear``."""
    if (
        ONEDNN
        and x.device.type == "cpu"
        and x.dtype in ONEDNN_DTYPES
        and x.dtype == weight.dtype
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")  # autocast casts F.linear's inputs; oneDNN's op would not
    ):
        w = packed_weight(weight) if isinstance(weight, nn.Parameter) else weight
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) whose forward is ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
