"""Which kernels run the linear layers: one interface, one module per backend, one selector.

Every backend implements ``Kernel`` (``base``): ``aten``, ``upcast`` and ``wx`` (torch's own
products, ``torch_ops``), ``onednn`` and ``PackedOneDNN`` (``onednn_ops``), ``Int8Kernel`` and
``PackedInt8`` (fbgemm, ``fbgemm_ops``), ``PackedPanels`` (the fused kernels' float32 panels,
``panel_ops``) and ``PackedInt8Panels`` (their int8 panels, ``int8_panel_ops``). The selector is
``choose`` (``plan``): it maps (device, precision, CPU features) to a ``KernelPlan`` once, and
``install`` gives every layer the kernel the plan names; callers then ask the kernel, never its
type (``bind``, ``packed_kernel``).

Every linear layer of the network (and the output projection) calls ``model.network.linear.linear``
with the ``LinearKernel`` that ``install`` gave the model; the network modules never look at
CPU flags. ``choose`` maps (device, precision, CPU features) to a ``KernelPlan``:

| precision | CPU has | kernel | why |
| --- | --- | --- | --- |
| float32 | AVX2 + FMA, a C++ compiler | ``panels`` | the fused kernels' products on packed panels, a pass in one call |
| float32, no compiler | Intel, AVX2 | ``aten`` | MKL's sgemm (``F.linear``): beats oneDNN and ``wx`` there |
| float32, no compiler | other AVX2 (x86) | ``onednn`` | oneDNN on packed weights: faster than MKL at 4-256 rows |
| float32, no compiler, step | other AVX2, no AVX-512 | ``wx`` | MKL as W·xᵀ: as fast, no oneDNN shapes to cache |
| float32 | no AVX2 | ``aten`` | ``F.linear``; torch's oneDNN weight packing is only trusted on x86 |
| bfloat16 | AVX-512 BW/VL/DQ or AVX-NE-CONVERT | ``onednn`` | what torch's oneDNN bf16 reorder requires |
| bfloat16 | less | ``aten`` | works, slowly; logged once at load |
| float16 | any | ``aten`` | torch has no fast fp16 CPU GEMM (several times slower than fp32); logged |
| int8 | AVX2 and fbgemm | ``fbgemm-int8`` | weights int8 per output channel, activations quantized per call |
| int8 + fused kernels | AVX2 build | theirs, all rows | fbgemm's weights, faster than fbgemm at every row count |
| int8 + fused kernels | AVX-512 VNNI build | theirs, all rows | vpdpbusd: faster than the AVX2 code |
| int8 + fused kernels | AVX-512 build, no VNNI | theirs to 16 rows | fbgemm's AVX-512 beyond (not compared yet) |
| int8 | no AVX2 | refused | fbgemm needs AVX2; ``UnsupportedPrecision`` names the setting |

On CUDA every precision but int8 uses ``F.linear`` (cuBLAS); int8 there is refused.

Between its matrix products the decoder step runs the fused kernels of ``model.engine.fused`` where the
plan names them (``KernelPlan.fused``: CPU plans with float32 activations, i.e. float32 and int8),
built for AVX-512 with VNNI, AVX-512, AVX2 + FMA or the compiler's default instructions
(``fused_variant``). On int8
plans they run the int8 products too (``fused.INT8_ROWS``: fbgemm's quantized weight in panels of
their own, ``PackedInt8Panels`` where they take every row count, so the model keeps that copy
alone), and keep the decoder's K/V cache in float16 where the CPU converts with F16C
(``KernelPlan.kv_dtype``, ``kv_cache_dtype``): half the cache's memory; float32 keeps float32.

Features come from /proc/cpuinfo (the hardware, which is what torch's own checks read),
and the vendor (``vendor_id``: MKL, Intel's library, runs its fast paths on Intel CPUs only),
narrowed by the ISA caps users set for the libraries (``ONEDNN_MAX_CPU_ISA``,
``ATEN_CPU_CAPABILITY``), so a capped run also takes the capped path. Tests build
``CpuFeatures`` by hand to drive every row of the table on any machine.

The decoder step's layers (``Transformer.step_linears``: every layer a decoder step runs but
the output projection) take the plan's ``step_kernel`` where it differs. A float32 model loaded
for inference then keeps one copy of each weight: the packed copy where oneDNN runs it
(``PackedOneDNN``, ``release_float_weights``), the fused kernels' panels where the plan names
``panels`` (``PackedPanels``: faster than MKL's sgemm and oneDNN from 2 to a few hundred rows; the
layers run ``aten`` until they are packed), the float weight where ``wx`` or ``aten`` reads it.
The output projection runs on its panels too (the last one padded where the vocabulary is no
multiple of their width), and a tied model's token lookups read those panels (``tables``), so
the vocabulary is held once; int8 plans' lookups read its int8 panels where the table is not
exact in float16.
The per-call times behind the choices: docs/benchmarks/README.md#linear-kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import cache
from types import ModuleType

import torch
from torch import nn

from model.engine.fused import EVERY_ROW_COUNT, int8_rows_limit, panel_rows_limit
from model.engine.fused import load as load_fused
from model.engine.kernels.base import BoundLinear, Int8Weight, Kernel, PackedCopies
from model.engine.kernels.fbgemm_ops import Int8Kernel, PackedInt8, quantized_engine
from model.engine.kernels.int8_panel_ops import PackedInt8Panels, int8_panels
from model.engine.kernels.onednn_ops import ONEDNN_MAX_ROWS, OneDNN, PackedOneDNN, bucket_rows, onednn
from model.engine.kernels.panel_ops import PackedPanels
from model.engine.kernels.plan import (
    FLOAT_DTYPES,
    KernelName,
    KernelPlan,
    UnsupportedPrecision,
    bf16_autocast,
    choose,
    int8_products,
    kv_cache_dtype,
)
from model.engine.kernels.tables import TokenTable, packed_table, token_table, unpacked_rows
from model.engine.kernels.torch_ops import Aten, Upcast, Wx, aten, upcast, wx
from model.network.linear import LinearKernel, auto, use_machine_kernel
from model.network.linear import is_packed as is_packed

__all__ = [
    "FLOAT_DTYPES",
    "ONEDNN_MAX_ROWS",
    "Aten",
    "BoundLinear",
    "Int8Kernel",
    "Int8Weight",
    "Kernel",
    "KernelName",
    "KernelPlan",
    "LinearKernel",
    "OneDNN",
    "PackedCopies",
    "PackedInt8",
    "PackedInt8Panels",
    "PackedOneDNN",
    "PackedPanels",
    "TokenTable",
    "UnsupportedPrecision",
    "Upcast",
    "Wx",
    "aten",
    "bf16_autocast",
    "bind",
    "bucket_rows",
    "choose",
    "install",
    "int8",
    "int8_kernels",
    "int8_panels",
    "int8_products",
    "int8_weight",
    "is_packed",
    "kernel_for",
    "kv_cache_dtype",
    "onednn",
    "packed_kernel",
    "packed_table",
    "panel_kernels",
    "quantized_engine",
    "reads_float_weight",
    "release_float_weights",
    "token_table",
    "unpacked_rows",
    "upcast",
    "wx",
]

log = logging.getLogger(__name__)

_BY_NAME: dict[str, Kernel] = {"onednn": onednn, "wx": wx, "aten": aten, "panels": aten}


def int8(reduce_range: bool) -> Int8Kernel:
    return Int8Kernel(reduce_range)


def kernel_for(plan: KernelPlan, name: KernelName | None = None) -> Kernel:
    """The kernel the plan names (``name``: one of its names, default ``plan.kernel``); a plan on
    ``panels`` runs ``aten`` until ``release_float_weights`` packs the layers into panels."""
    name = name or plan.kernel
    if name == "fbgemm-int8":
        torch.backends.quantized.engine = "fbgemm"  # linear_dynamic runs on the engine it was packed for
        return int8(plan.reduce_range)
    return _BY_NAME[name]


def install(model: nn.Module, plan: KernelPlan, step_layers: Iterable[nn.Module] = ()) -> nn.Module:
    """Give every layer of ``model`` that takes a kernel the plan's kernel, and the layers in
    ``step_layers`` (the decoder step's: ``Transformer.step_linears``) its ``step``; a
    ``Transformer`` also gets the fused decoder-step kernels the plan names
    (``model.engine.fused``: built on first use, None where they cannot be)."""
    kernel = kernel_for(plan)
    step = kernel if plan.step == plan.kernel else kernel_for(plan, plan.step)
    in_step = {id(m) for m in step_layers}
    for module in model.modules():
        if hasattr(module, "kernel"):
            setattr(module, "kernel", step if id(module) in in_step else kernel)  # noqa: B010 (nn.Module's __setattr__ types say Tensor | Module)
    if hasattr(model, "fused_step"):  # a Transformer: the decoder step's fused kernels, built now if need be
        setattr(model, "fused_step", plan.fused if load_fused(plan.fused) is not None else None)  # noqa: B010
        # the cache's dtype is the fused kernels' to read: the tensor operations keep the activations'
        setattr(model, "kv_dtype", plan.kv_dtype if model.fused_step is not None else None)  # noqa: B010
    if plan.warning:
        log.warning("%s", plan.warning)
    log.info("linear kernels: %s", plan.describe())
    return model


def panel_kernels(plan: KernelPlan) -> ModuleType | None:
    """The fused kernels whose packed panels replace the float weights in a float32 plan on
    ``panels`` (where the fused kernels build and have panels: ``fused.PANEL_ROWS``); None for
    every other plan, and where they fail to build after all (the layers then run ``aten``)."""
    if plan.device != "cpu" or plan.precision != "float32" or plan.kernel != "panels" or plan.fused is None:
        return None
    return load_fused(plan.fused) if panel_rows_limit(plan.fused) > 0 else None


def int8_kernels(plan: KernelPlan) -> ModuleType | None:
    """The fused kernels whose int8 panels replace fbgemm's packed weights in an int8 plan: where
    they take the int8 products of every row count (``fused.INT8_ROWS``); None for every other plan
    (fbgemm's copy stays, and the decoding passes pack the kernels' own for the rows they take)."""
    if plan.device != "cpu" or plan.precision != "int8" or plan.fused is None:
        return None
    return load_fused(plan.fused) if int8_rows_limit(plan.fused) >= EVERY_ROW_COUNT else None


def packed_kernel(
    kernel: object,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    panels: ModuleType | None = None,
    int8: ModuleType | None = None,
) -> Kernel | None:
    """The kernel that runs a layer of ``kernel`` from a packed copy of ``weight`` (and ``bias``)
    alone, without reading them again (``Kernel.packed``: ``PackedInt8`` for fbgemm,
    ``PackedOneDNN`` for float32 on ``onednn``, ``PackedPanels`` for float32 on ``aten`` given the
    fused kernels, ``panels``), an int8 layer on the fused kernels' int8 panels where they take
    its products (``int8``: ``int8_kernels``); None where the layer keeps reading its weight."""
    if not isinstance(kernel, Kernel):
        return None
    packed = kernel.packed(weight, bias, panels)
    if packed is not None and int8 is not None:
        ours = int8_panels(packed, weight, None if bias is None else bias.detach(), int8)
        packed = packed if ours is None else ours
    return packed


def release_float_weights(
    model: nn.Module,
    keep: Iterable[torch.Tensor] = (),
    panels: ModuleType | None = None,
    int8: ModuleType | None = None,
) -> int:
    """For inference: every layer whose kernel has a packed replacement (``packed_kernel``) gets
    it now, and its float weight (and, for the int8 kernels, which hold their own bias, its bias)
    is replaced by a placeholder on the meta device (same shapes, no memory). So the model holds
    one copy of those weights, the packed one, instead of two. Weights in ``keep`` (read
    elsewhere: the output projection, which the model runs through its own kernel and which may
    be the embeddings) stay. The model is then for inference only:
    ``model.network.linear.linear`` refuses to run a released layer on any other path.
    -> bytes released."""
    kept = {id(t) for t in keep}
    released = 0
    for module in model.modules():
        kernel, weight = getattr(module, "kernel", None), getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or id(weight) in kept:
            continue
        bias = getattr(module, "bias", None)
        packed = packed_kernel(kernel, weight, bias, panels, int8)
        if packed is None:
            continue
        setattr(module, "kernel", packed)  # noqa: B010 (see install)
        names = ("weight", "bias") if isinstance(packed, PackedInt8 | PackedInt8Panels) else ("weight",)
        for name in names:
            tensor = getattr(module, name)
            if tensor is not None:
                released += tensor.numel() * tensor.element_size()
                setattr(module, name, nn.Parameter(torch.empty_like(tensor, device="meta"), requires_grad=False))
    return released


def reads_float_weight(kernel: object) -> bool:
    """Whether ``kernel`` computes a layer in float from the float weight it is called with (``aten``,
    ``wx``, ``onednn``, ``auto``), so another float product of that weight gives its results to
    rounding; not int8 (quantized) nor a packed kernel (its own copy; the weight a placeholder)."""
    return kernel is auto or (isinstance(kernel, Kernel) and kernel.reads_float_weight)


def int8_weight(kernel: object, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Weight | None:
    """An int8 layer's weight as fbgemm quantized it: (N, K) int8, its scale per output channel
    (N,) float32 and its bias (N,) float32 or None; None for a layer of another kernel."""
    return kernel.int8_weight(weight, bias) if isinstance(kernel, Kernel) else None


def bind(kernel: LinearKernel, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
    """``kernel`` with one layer's weights looked up (and packed) once (``Kernel.bind``), for a
    caller that runs the layer many times on 2-d inputs at inference (``model.engine.step``)."""
    resolved = _float_kernel(weight.dtype) if kernel is auto else kernel
    if isinstance(resolved, Kernel):
        return resolved.bind(weight, bias)

    def run_kernel(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        return resolved(x, weight, bias, relu)

    return run_kernel


@cache
def _float_kernel(dtype: torch.dtype) -> Kernel:
    name = next((n for n, d in FLOAT_DTYPES.items() if d == dtype), None)
    return aten if name is None else kernel_for(choose("cpu", name))


def _machine_kernel(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
) -> torch.Tensor:
    """What layers run before a plan is installed (``linear.auto``): this CPU's kernel for the
    input's float dtype."""
    return _float_kernel(x.dtype)(x, weight, bias, relu)


use_machine_kernel(_machine_kernel)
