"""The kernel plan: which backend runs the linear layers of one model, decided once from the
device, the precision and the CPU's features (``choose``; the table is in the package's
docstring, the measurements behind it in docs/benchmarks/README.md#linear-kernels)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from model.engine.features import CpuFeatures, detected, fused_variant
from model.engine.fused import EVERY_ROW_COUNT, buildable, int8_rows_limit, panel_rows_limit
from model.engine.fused import enabled as fused_enabled
from model.network.precision import PRECISIONS, Precision

FLOAT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedPrecision(ValueError):
    """The requested precision cannot run on this device or CPU."""


KernelName = Literal["onednn", "aten", "fbgemm-int8", "wx", "panels"]


@dataclass(frozen=True)
class KernelPlan:
    """What runs the linear layers of one model: ``kernel`` on ``dtype`` parameters."""

    device: str
    precision: Precision
    dtype: torch.dtype  # of the parameters (int8: float32, packed to int8 and then released: release_float_weights)
    kernel: KernelName
    isa: str
    reduce_range: bool = False  # int8: 7-bit activations, so AVX2's 16-bit accumulation cannot saturate
    warning: str | None = None  # logged once when the plan is installed
    step_kernel: KernelName | None = None  # the decoder step's layers, where not ``kernel``
    fused: str | None = None  # the fused decoder-step kernels' variant (``model.engine.fused``); None: not used
    # the decoder's K/V cache where not in the activations' dtype: float16 on int8 plans whose fused
    # kernels convert with F16C (``kv_dtype``); None: the activations' dtype
    kv_dtype: torch.dtype | None = None

    @property
    def step(self) -> KernelName:
        """The kernel of the decoder step's layers (``Transformer.step_linears``)."""
        return self.step_kernel or self.kernel

    def describe(self) -> str:
        step = f", decoder steps via {self.step_kernel}" if self.step_kernel else ""
        fused = f", fused step kernels ({self.fused})" if self.fused else ""
        kv = f", {str(self.kv_dtype).removeprefix('torch.')} KV cache" if self.kv_dtype is not None else ""
        return f"{self.precision} on {self.device} via {self.kernel}{step}{fused}{self._int8_rows()}{kv} ({self.isa})"

    def _int8_rows(self) -> str:
        """Where the decoding passes' int8 products run on the fused kernels' own (``fused.INT8_ROWS``)."""
        where = int8_products(self.precision, self.fused)
        return f", int8 products on the {where}" if where is not None and where != "fbgemm" else ""


def int8_products(precision: str, fused_step: str | None) -> str | None:
    """What computes an int8 model's matrix products in decoding, given the fused kernels it runs
    (``Transformer.fused_step``; None: none): "fused kernels (every row count)", "fused kernels (up
    to N rows, fbgemm beyond)" (``fused.INT8_ROWS``) or "fbgemm"; None for another precision."""
    if precision != "int8":
        return None
    limit = int8_rows_limit(fused_step)
    if limit <= 0:
        return "fbgemm"
    return (
        "fused kernels ("
        + ("every row count" if limit >= EVERY_ROW_COUNT else f"up to {limit} rows, fbgemm beyond")
        + ")"
    )


def choose(
    device: str | torch.device,
    precision: str,
    features: CpuFeatures | None = None,
    engines: Iterable[str] | None = None,
    fused: bool | None = None,
) -> KernelPlan:
    """The kernel plan for ``precision`` on ``device`` (see the module's table).

    ``features`` and ``engines`` (torch's quantized engines) default to this machine's;
    ``fused`` (default: ``TRANSLATOR_FUSED_STEP``, on) whether CPU plans whose activations are
    float32 (float32 and int8) name the fused decoder-step kernels for this CPU (``fused_variant``).
    Raises ``UnsupportedPrecision`` naming ``TRANSLATOR_DTYPE`` when it cannot run at all.
    """
    use = fused_enabled() if fused is None else fused
    on_cpu = torch.device(device).type == "cpu"
    f = features if features is not None else detected()
    variant = fused_variant(f) if use and on_cpu else None
    panels = variant is not None and precision == "float32" and panel_rows_limit(variant) > 0 and buildable(variant)
    plan = _choose(device, precision, f, engines, panels)
    if variant is not None and plan.dtype == torch.float32:
        plan = replace(plan, fused=variant, kv_dtype=kv_cache_dtype(plan.precision, variant, f))
    return plan


def kv_cache_dtype(precision: str, variant: str, features: CpuFeatures) -> torch.dtype | None:
    """The decoder's K/V cache storage where not the activations' float32: float16 for int8 on
    the AVX2 and AVX-512 builds of the fused kernels where the CPU converts with F16C (the
    products are int8 already; the cache, the largest part of a batch's working memory, then
    takes half of it: docs/benchmarks/README.md#kv-cache). float32 stays float32
    throughout; the baseline build would convert one element at a time."""
    if precision == "int8" and variant in ("avx2", "avx512", "avx512vnni") and features.f16c:
        return torch.float16
    return None


def _choose(
    device: str | torch.device,
    precision: str,
    features: CpuFeatures | None,
    engines: Iterable[str] | None,
    panels: bool = False,
) -> KernelPlan:
    dev = torch.device(device).type
    if precision not in PRECISIONS:
        raise UnsupportedPrecision(f"TRANSLATOR_DTYPE={precision} is not one of {', '.join(PRECISIONS)}")
    if dev != "cpu":
        if precision == "int8":
            raise UnsupportedPrecision(
                "TRANSLATOR_DTYPE=int8 runs on the CPU only (fbgemm); on CUDA use float16 or bfloat16"
            )
        return KernelPlan(dev, precision, FLOAT_DTYPES[precision], "aten", dev)
    f = features if features is not None else detected()
    onednn = torch.backends.mkldnn.is_available() and f.avx2
    if precision == "int8":
        engines = tuple(torch.backends.quantized.supported_engines if engines is None else engines)
        if not f.avx2 or "fbgemm" not in engines:
            raise UnsupportedPrecision(
                f"TRANSLATOR_DTYPE=int8 needs an x86 CPU with AVX2 and torch's fbgemm engine "
                f"(this CPU: {f.isa}; engines: {', '.join(engines) or 'none'}); use float32"
            )
        return KernelPlan("cpu", "int8", torch.float32, "fbgemm-int8", f.isa, reduce_range=not f.avx512_vnni)
    if precision == "float32":
        # Where the fused kernels build with packed panels (AVX2 + FMA and a C++ compiler), every
        # layer but the output projection runs on its panels, the passes' layers in one call each:
        # faster than MKL's sgemm and oneDNN wherever compared (docs/benchmarks/README.md#linear-kernels).
        if panels:
            return KernelPlan("cpu", "float32", torch.float32, "panels", f.isa)
        # Without them: on Intel CPUs MKL's sgemm behind ``F.linear`` beats oneDNN and ``wx``, with no
        # oneDNN primitives kept; elsewhere oneDNN, the decoder step's layers on ``wx`` on AVX2
        # without AVX-512, as fast in less memory (docs/benchmarks/README.md#linear-kernels).
        if not onednn or f.intel:
            return KernelPlan("cpu", "float32", torch.float32, "aten", f.isa)
        step: KernelName | None = None if f.avx512 else "wx"
        return KernelPlan("cpu", "float32", torch.float32, "onednn", f.isa, step_kernel=step)
    if precision == "bfloat16":
        if onednn and (f.avx512 or f.avx_ne_convert):
            slow = None if f.avx512_bf16 or f.avx_ne_convert else "bfloat16 is emulated on this CPU (no AVX512_BF16)"
            return KernelPlan("cpu", "bfloat16", torch.bfloat16, "onednn", f.isa, warning=slow)
        return KernelPlan(
            "cpu", "bfloat16", torch.bfloat16, "aten", f.isa,
            warning=f"TRANSLATOR_DTYPE=bfloat16 on a CPU without AVX-512 ({f.isa}) runs on a slow path; "
            "float32 is faster here",
        )  # fmt: skip
    return KernelPlan(
        "cpu", "float16", torch.float16, "aten", f.isa,
        warning="TRANSLATOR_DTYPE=float16 on the CPU runs on a slow path (several times slower than float32); "
        "use float32 or int8",
    )  # fmt: skip


def bf16_autocast(device: str | torch.device, features: CpuFeatures | None = None) -> str | None:
    """Why bf16 autocast (training) should not run on ``device``, or None when it runs natively.

    On a CPU without AVX512_BF16 (or AMX / AVX-NE-CONVERT) torch emulates bf16 matmuls: a
    training step runs many times slower than in float32 (docs/training.md).
    """
    dev = torch.device(device).type
    if dev == "cuda":
        return None if torch.cuda.is_bf16_supported() else "this GPU has no native bfloat16"
    if dev != "cpu":
        return None
    f = features if features is not None else detected()
    if f.avx512_bf16 or f.avx_ne_convert:
        return None
    return f"bfloat16 is emulated on this CPU ({f.isa}, no AVX512_BF16), many times slower than float32"
