"""Per-call time of each linear kernel of ``model.engine.kernels`` at the shipped model's shapes.

    python -m bench.kernels [--threads 2] [--rows 1,4,16,64,256] [--calls 200] [--step]

One JSON line per (layer shape, rows): microseconds per call of ``aten`` (``F.linear``),
``wx`` (MKL as W·xᵀ), ``onednn`` (packed weights; its one-row fallback off, to show what it
replaces), ``panels`` (the fused kernels' ``panel_linear`` on weights packed into panels),
``fbgemm-int8`` and ``int8-panels`` (the fused kernels' ``int8_linear`` on fbgemm's quantized
weights: ``kernels.PackedInt8Panels``), where this CPU can run them (``model.engine.kernels.choose``).
The shapes are the decoder's: fused QKV (768 x 256), attention output (256 x 256), feed-forward (1024 x 256,
256 x 1024) and the tied output projection (8000 x 256). ``isa`` names the kernel path the
CPU features (and the ISA caps in the environment) select.

``--step`` times what a decoder step does instead: the 19 matrices of the shipped model's step
(3 layers x QKV, self-attention output, cross-attention query and output, two feed-forward;
then the output projection), each used once in turn, so their weights stream from memory as in
decoding rather than staying hot in cache. One JSON line per row count: milliseconds per step
of each kernel, and ``planned_ms``: float32 as ``kernels.choose`` plans it here (the 18 layer
matrices on the plan's ``step`` kernel, the output projection on its ``kernel``).
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

from model.engine import fused, kernels
from model.engine.features import detected, fused_variant
from model.engine.kernels import onednn_ops

SHAPES = ((768, 256), (256, 256), (1024, 256), (256, 1024), (8000, 256))
LAYER = ((768, 256), (256, 256), (256, 256), (256, 256), (1024, 256), (256, 1024))  # one decoder layer, in order
STEP = (*LAYER, *LAYER, *LAYER, (8000, 256))


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return round((time.perf_counter() - start) / calls * 1e6, 1)


def packed_onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
    """``kernels.onednn`` without its one-row ``F.linear`` fallback."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, onednn_ops._onednn_packed.get(w, None), b, "none", [], "")
    return out


def panels_kernel() -> kernels.LinearKernel | None:
    """The fused kernels' product on packed panels as a ``LinearKernel`` (each weight packed once),
    where this CPU's variant builds and has panels; else None."""
    variant = fused_variant(detected())
    module = fused.load(variant) if fused.panel_rows_limit(variant) > 0 else None
    if module is None:
        return None
    cache = kernels.PackedCopies(lambda w, b: module.pack_panels(w))
    none = torch.empty(0)

    def panels(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
        out: torch.Tensor = module.panel_linear(x, cache.get(w, None), none if b is None else b, relu)
        return out

    return panels


def int8_panels_kernel() -> kernels.LinearKernel | None:
    """The fused kernels' int8 product (``int8_linear``) as a ``LinearKernel``: each weight
    quantized by fbgemm and packed into their int8 panels once, as ``kernels.PackedInt8Panels``
    holds it; where this CPU's variant builds and runs int8 products (``fused.INT8_ROWS``); else None."""
    variant = fused_variant(detected())
    module = fused.load(variant) if fused.int8_rows_limit(variant) > 0 else None
    if module is None:
        return None

    def pack(w: torch.Tensor, b: torch.Tensor | None) -> kernels.PackedInt8Panels:
        packed = kernels.int8_panels(kernels.Int8Kernel(True), w, b, module)
        assert packed is not None, "the shapes are multiples of the panels' width"
        return packed

    cache = kernels.PackedCopies(pack)

    def int8_panels(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
        packed = cache.get(w, b)
        assert isinstance(packed, kernels.PackedInt8Panels)
        return packed.run(x, relu)

    return int8_panels


def runnable_kernels() -> dict[str, kernels.LinearKernel]:
    """Every float32 kernel this CPU runs (and int8's, with AVX2), by name."""
    found: dict[str, kernels.LinearKernel] = {"aten": kernels.aten, "wx": kernels.wx}
    if torch.backends.mkldnn.is_available() and detected().avx2:
        found["onednn"] = packed_onednn
    panels = panels_kernel()
    if panels is not None:
        found["panels"] = panels
    with contextlib.suppress(kernels.UnsupportedPrecision):  # no AVX2: no int8 row
        found["fbgemm-int8"] = kernels.kernel_for(kernels.choose("cpu", "int8"))
        int8_panels = int8_panels_kernel()
        if int8_panels is not None:
            found["int8-panels"] = int8_panels
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--step", action="store_true", help="a decoder step's 19 matrices in turn, per step")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    runnable = runnable_kernels()
    torch.manual_seed(0)
    with torch.no_grad():  # (parameters made in inference mode would have no version counter)
        if args.step:
            step_rows(runnable, [int(r) for r in args.rows.split(",")], args.calls)
            return
        for out_features, in_features in SHAPES:
            weight = nn.Parameter(torch.randn(out_features, in_features), requires_grad=False)
            bias = torch.randn(out_features)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_features)
                row = {"out": out_features, "in": in_features, "rows": rows, "isa": detected().isa}
                for name, kernel in runnable.items():
                    call = partial(kernel, x, weight, bias, False)
                    row[f"{name}_us"] = per_call_us(call, args.calls)
                print(json.dumps(row), flush=True)


def step_rows(runnable: dict[str, kernels.LinearKernel], row_counts: list[int], steps: int) -> None:
    """Per row count, ms per decoder step of each kernel over ``STEP``'s matrices in turn."""
    layers = [
        (nn.Parameter(torch.randn(o, i), requires_grad=False), torch.randn(o) if o != 8000 else None) for o, i in STEP
    ]
    for rows in row_counts:
        inputs = {i: torch.randn(rows, i) for _, i in STEP}
        row: dict[str, object] = {"matrices": len(STEP), "rows": rows, "isa": detected().isa}
        for name, kernel in runnable.items():

            def step(kernel: kernels.LinearKernel = kernel, inputs: dict[int, torch.Tensor] = inputs) -> None:
                for weight, bias in layers:
                    kernel(inputs[weight.shape[1]], weight, bias, False)

            row[f"{name}_ms"] = round(per_call_us(step, steps) / 1000, 3)
        plan = kernels.choose("cpu", "float32")
        # each of the plan's kernels as timed above (the output projection of a plan on panels runs
        # ``aten``: ``kernels.release_float_weights`` keeps its float rows)
        output = "aten" if plan.kernel == "panels" else plan.kernel
        planned = [runnable[plan.step], runnable[output]]

        def planned_step(
            inputs: dict[int, torch.Tensor] = inputs, planned: list[kernels.LinearKernel] = planned
        ) -> None:
            for i, (weight, bias) in enumerate(layers):
                planned[i == len(layers) - 1](inputs[weight.shape[1]], weight, bias, False)

        row["planned_ms"] = round(per_call_us(planned_step, steps) / 1000, 3)
        row["planned"] = plan.describe()
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
