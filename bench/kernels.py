"""Per-call time of each linear kernel of ``model.kernels`` at the shipped model's shapes.

    python -m bench.kernels [--threads 2] [--rows 1,4,16,64,256] [--calls 200]

One JSON line per (layer shape, rows): microseconds per call of ``aten`` (``F.linear``),
``onednn`` (packed weights; its one-row fallback off, to show what it replaces) and
``fbgemm-int8``, where this CPU can run them (``model.kernels.choose``). The shapes are the
decoder's: fused QKV (768 x 256), attention output (256 x 256), feed-forward (1024 x 256,
256 x 1024) and the tied output projection (8000 x 256). ``isa`` names the kernel path the
CPU features (and the ISA caps in the environment) select.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from model import kernels

SHAPES = ((768, 256), (256, 256), (1024, 256), (256, 1024), (8000, 256))


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return round((time.perf_counter() - start) / calls * 1e6, 1)


def packed_onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
    """``kernels.onednn`` without its one-row ``F.linear`` fallback."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, kernels._onednn_packed.get(w, None), b, "none", [], "")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    runnable: dict[str, kernels.LinearKernel] = {"aten": kernels.aten}
    if kernels.choose("cpu", "float32").kernel == "onednn":
        runnable["onednn"] = packed_onednn
    with contextlib.suppress(kernels.UnsupportedPrecision):  # no AVX2: no int8 row
        runnable["fbgemm-int8"] = kernels.kernel_for(kernels.choose("cpu", "int8"))
    torch.manual_seed(0)
    with torch.no_grad():  # (parameters made in inference mode would have no version counter)
        for out_features, in_features in SHAPES:
            weight = nn.Parameter(torch.randn(out_features, in_features), requires_grad=False)
            bias = torch.randn(out_features)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_features)
                row = {"out": out_features, "in": in_features, "rows": rows, "isa": kernels.detected().isa}
                for name, kernel in runnable.items():
                    call = partial(kernel, x, weight, bias, False)
                    row[f"{name}_us"] = per_call_us(call, args.calls)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
