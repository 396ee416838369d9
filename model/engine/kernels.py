"""Which kernels run the linear layers: decided once, here, from the CPU's reported features.

Every linear layer of the network (and the output projection) calls ``model.network.linear.linear``
with the ``LinearKernel`` that ``install`` gave the model; the network modules never look at
CPU flags. ``choose`` maps (device, precision, CPU features) to a ``KernelPlan``:

| precision | CPU has | kernel | why |
| --- | --- | --- | --- |
| float32 | AVX2 + FMA, a C++ compiler | ``panels`` | the fused kernels' products on packed panels, a pass in one call |
| float32, no compiler | Intel, AVX2 | ``aten`` | MKL's sgemm (``F.linear``): beats oneDNN and ``wx`` there |
| float32, no compiler | other AVX2 (x86) | ``onednn`` | oneDNN on weights packed once: 2-3x MKL's sgemm, 4-256 rows |
| float32, no compiler, step | other AVX2, no AVX-512 | ``wx`` | MKL as W·xᵀ: as fast, no oneDNN shapes to cache |
| float32 | no AVX2 | ``aten`` | ``F.linear``; torch's oneDNN weight packing is only trusted on x86 |
| bfloat16 | AVX-512 BW/VL/DQ or AVX-NE-CONVERT | ``onednn`` | what torch's oneDNN bf16 reorder requires |
| bfloat16 | less | ``aten`` | works, slowly; logged once at load |
| float16 | any | ``aten`` | torch has no fast fp16 CPU GEMM (several times slower than fp32); logged |
| int8 | AVX2 and fbgemm | ``fbgemm-int8`` | weights int8 per output channel, activations quantized per call |
| int8 + fused kernels | AVX2 build | theirs, all rows | fbgemm's weights; ~4x fbgemm at 1 row, 1.2-2x at 64+ |
| int8 + fused kernels | AVX-512 VNNI build | theirs, all rows | vpdpbusd; 1.2-1.4x the AVX2 code's decoding (Zen 5) |
| int8 + fused kernels | AVX-512 build, no VNNI | theirs to 16 rows | fbgemm's AVX-512 beyond: not measured against |
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
Measured per-call times behind the choices: docs/benchmarks.md "Linear kernels" and "The
decoder step's layers through MKL".
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cache
from types import ModuleType
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from model.engine.features import (
    CpuFeatures,
    detected,
    fused_variant,
)
from model.engine.fused import EVERY_ROW_COUNT, buildable, int8_packable, int8_rows_limit, packable, panel_rows_limit
from model.engine.fused import enabled as fused_enabled
from model.engine.fused import load as load_fused
from model.network.linear import LinearKernel, auto, use_machine_kernel
from model.network.linear import is_packed as is_packed_copy
from model.network.precision import PRECISIONS, Precision

log = logging.getLogger(__name__)

FLOAT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# At one row (greedy search of one sentence) ``F.linear`` beats the packed oneDNN call for the
# model's inner layers and loses for the vocabulary-wide output projection, per call with the
# weights hot in cache; in a decoder step, weights streaming, the gain is 0.1-0.2 ms a step on Zen 3
# (docs/benchmarks.md "Numbers behind the code"). A model whose float weights were released
# (``PackedOneDNN``, the served float32 models) runs every row count packed.
ATEN_MAX_ROWS = 1
ATEN_MAX_OUT = 4096


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
    takes half of it: docs/benchmarks.md "A float16 KV cache for int8"). float32 stays float32
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
        # faster than MKL's sgemm on an Intel Xeon (AVX-512, and capped to AVX2: "Packed panels")
        # and than oneDNN / ``wx`` on an AMD EPYC Zen 3 (AVX2: 1.14-1.53x, "The panels on a real
        # AVX2 CPU"); AMD's AVX-512 CPUs (Zen 4/5) take them too, not measured there.
        if panels:
            return KernelPlan("cpu", "float32", torch.float32, "panels", f.isa)
        # Without them: on Intel CPUs every layer runs MKL's sgemm behind ``F.linear``: faster than oneDNN and
        # ``wx`` for the decoder step's layers at every batch shape measured, and for the encoder's
        # at 1-64 sentences, natively and capped to AVX2, with no oneDNN primitives kept
        # (docs/benchmarks.md "The decoder step's layers on an Intel CPU", "Every float32 layer on
        # MKL"). Elsewhere oneDNN, its decoder step's layers on ``wx`` where measured as fast in
        # less memory (AVX2 without AVX-512: "The decoder step's layers through MKL"); other
        # AVX-512 CPUs keep oneDNN throughout, which is what was measured there.
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
    training step on an AMD EPYC Naples (AVX2) took 53 s in bf16 against 2.9 s in float32.
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


# --- kernels -------------------------------------------------------------------------------


class _Packed:
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


def aten(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
    out = F.linear(x, weight, bias)
    return out.relu_() if relu else out


def upcast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
    """``aten`` on a weight (and bias) kept in a narrower float dtype than ``x``, converted per
    call: for a layer that seldom runs and whose rows are stored once for another reader (the
    output projection when a shortlist gathers its rows from the float16 token table:
    ``loading.shortlist_output``)."""
    return aten(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), relu)


def wx(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
    """MKL's sgemm (``torch.mm``) as W·xᵀ, transposed back with the bias added in the same pass:
    x (..., in) -> (..., out), contiguous. The same product as ``F.linear``'s x·Wᵀ, but on this
    operand order MKL's small-row kernels run 1.3-2x faster on AVX2 (``F.linear`` is 2x slower
    than the packed oneDNN call at 4 rows), and unlike oneDNN it builds and caches nothing per
    row count. In decoding, on the decoder step's 256-1024 wide layers (not the vocabulary-wide
    output projection, where oneDNN stays), it runs as fast as the packed oneDNN call and saves
    the primitives oneDNN keeps for each of their shapes (~20 MiB of working memory at batch 64).
    Reads the float weight as it is: one copy, no packing."""
    if x.dtype != weight.dtype:
        return aten(x, weight, bias, relu)  # F.linear's error
    rows = x.numel() // max(x.shape[-1], 1)
    yt = torch.mm(weight, x.reshape(rows, x.shape[-1]).t())  # (out, rows)
    out = torch.empty((rows, weight.shape[0]), dtype=yt.dtype, device=yt.device)
    if bias is None:
        out.copy_(yt.t())
    else:
        torch.add(yt.t(), bias, out=out)
    if relu:
        out.relu_()
    return out.view(*x.shape[:-1], weight.shape[0])


def _pack_onednn(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(out, in) float weight -> oneDNN's packed copy (the bias is added by the call itself)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


_onednn_packed = _Packed(_pack_onednn)


# oneDNN builds (JIT-compiles) a matmul primitive for every row count it sees, ~1-5 ms each on
# an AVX2 Zen 3, and keeps the last ``ONEDNN_PRIMITIVE_CACHE`` of them (model/engine/allocator.py), each
# with its descriptor (~0.3 MiB on AVX2). The decoder's row count changes whenever a sentence
# finishes or joins, so rows are padded up to one of ``ROW_BUCKETS_PER_OCTAVE`` sizes per power
# of two (exact up to ``EXACT_ROWS``): at most half again the rows, usually much less, and 16
# sizes up to 256 rows. Above ``ONEDNN_MAX_ROWS`` rows (the encoder's sentences x tokens, a
# different count every batch; the first steps of 64 sentences at beam 5) the rows run in
# chunks of ``ONEDNN_MAX_ROWS`` through that size's primitive (the rest in one bucket), as fast
# as MKL's sgemm on the whole matrix there, and no new shape reaches the caches. Fewer sizes and
# no encoder shapes: float32 decoding's peak memory fell by a quarter, speed within the
# machine's drift (docs/benchmarks.md "Numbers behind the code"). With every row count on the
# packed copy, an inference model needs no float copy of these weights (``PackedOneDNN``).
# bfloat16 chunks the same way (before: one padded call), which was not measured (AVX-512 only).
EXACT_ROWS = 4
ROW_BUCKETS_PER_OCTAVE = 2
ONEDNN_MAX_ROWS = 256


def bucket_rows(rows: int) -> int:
    """The row count oneDNN runs for ``rows`` rows: rows itself up to ``EXACT_ROWS``, else
    rows rounded up to a multiple of 1/``ROW_BUCKETS_PER_OCTAVE`` of the power of two below."""
    if rows <= EXACT_ROWS:
        return rows
    step = max(1, (1 << ((rows - 1).bit_length() - 1)) // ROW_BUCKETS_PER_OCTAVE)
    return -(-rows // step) * step


def onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
    """oneDNN matmul on a packed copy of a parameter, ReLU fused as a post-op, rows padded to
    ``bucket_rows`` (in chunks above ``ONEDNN_MAX_ROWS``); ``F.linear`` for one row of a small
    layer (and for mixed dtypes, to raise ``F.linear``'s error)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if _aten_instead(x, weight, rows):
        return aten(x, weight, bias, relu)
    w = _onednn_weight(weight)
    out = _onednn_rows(x.reshape(rows, x.shape[-1]), w, bias, relu, rows)
    return out.view(*x.shape[:-1], out.shape[-1])


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


def _pack_int8(weight: torch.Tensor, bias: torch.Tensor | None) -> object:
    """(out, in) float weight -> fbgemm's packed int8 weight, symmetric per output channel."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch deprecates quantized tensors; fbgemm's packing still takes them
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        with quantized_engine("fbgemm"):
            return torch.ops.quantized.linear_prepack(q, None if bias is None else bias.float())


_int8_packed = _Packed(_pack_int8)


@contextmanager
def quantized_engine(name: str) -> Iterator[None]:
    """Select torch's quantized engine for a block (packing and running must agree)."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


@dataclass(frozen=True)
class Int8Kernel:
    """fbgemm's dynamic int8 linear: the input is quantized per call (one scale per tensor)."""

    reduce_range: bool

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        return _run_int8(x, _int8_packed.get(weight, bias), self.reduce_range, relu)


def _run_int8(x: torch.Tensor, packed: object, reduce_range: bool, relu: bool) -> torch.Tensor:
    op = torch.ops.quantized.linear_relu_dynamic if relu else torch.ops.quantized.linear_dynamic
    ready = x.dtype == torch.float32 and x.is_contiguous()  # (no conversion calls: each is a dispatch)
    out: torch.Tensor = op(x if ready else x.float().contiguous(), packed, reduce_range)
    return out if out.dtype == x.dtype else out.to(x.dtype)


@dataclass(frozen=True, eq=False)
class PackedInt8:
    """One layer's kernel once its float weight is released (``release_float_weights``): its
    fbgemm-packed int8 weight and bias, run as ``Int8Kernel`` runs them; the ``weight`` and
    ``bias`` it is called with are placeholders and are not read."""

    packed_copy = True  # the weight it is called with is a placeholder (linear.is_packed)

    packed: object
    reduce_range: bool

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        return _run_int8(x, self.packed, self.reduce_range, relu)


def int8_weight(
    kernel: object, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """An int8 layer's weight as fbgemm quantized it: (N, K) int8, its scale per output channel
    (N,) float32 and its bias (N,) float32 or None; from ``PackedInt8``'s packed copy, or the one
    ``Int8Kernel`` packs for ``weight``. None for a layer of another kernel."""
    if isinstance(kernel, PackedInt8):
        packed = kernel.packed
    elif isinstance(kernel, Int8Kernel):
        packed = _int8_packed.get(weight, bias)
    else:
        return None
    with quantized_engine("fbgemm"):
        q, b = torch.ops.quantized.linear_unpack(packed)
    scales = q.q_per_channel_scales().to(torch.float32).contiguous()
    return q.int_repr().contiguous(), scales, None if b is None else b.detach().to(torch.float32).contiguous()


class _OnRows:
    """A packed kernel called as a ``LinearKernel``: inputs of any leading dimensions, flattened
    to the rows its ``run`` takes (R, in) -> (R, out_features); the ``weight`` and ``bias`` it is
    called with are placeholders and are not read."""

    out_features: int

    def run(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        """x: (..., in) -> (..., out)."""
        return self.run(x.reshape(-1, x.shape[-1]), relu).view(*x.shape[:-1], self.out_features)


@dataclass(frozen=True, eq=False)
class PackedInt8Panels(_OnRows):
    """One int8 layer's kernel once its float weight is released, where the fused kernels take
    the int8 products of every row count (``int8_kernels``: AVX2): fbgemm's quantization of the
    weight (per output channel) packed into the kernels' int8 panels (``pack_int8``), run by their
    ``int8_linear`` (each row's activations quantized apart), its own bias added in the same pass;
    the model keeps this copy alone, not fbgemm's beside it. The ``weight`` and ``bias`` it is
    called with are placeholders and are not read."""

    packed_copy = True  # the weight it is called with is a placeholder (linear.is_packed)

    panels: torch.Tensor  # (out / 16, in / 4, 16, 4) int8
    colsums: torch.Tensor  # (out,) int32
    scales: torch.Tensor  # (out,) float32
    bias: torch.Tensor  # (out,) float32, or empty: none
    product: Callable[..., torch.Tensor]  # the kernels' ``int8_linear``
    out_features: int

    def run(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        """x: (R, in) -> (R, out) in x's dtype (computed from float32, as fbgemm's ``_run_int8``)."""
        ready = x.dtype == torch.float32 and x.is_contiguous()
        out = self.product(
            x if ready else x.float().contiguous(), self.panels, self.colsums, self.scales, self.bias, relu
        )
        return out if out.dtype == x.dtype else out.to(x.dtype)


def int8_kernels(plan: KernelPlan) -> ModuleType | None:
    """The fused kernels whose int8 panels replace fbgemm's packed weights in an int8 plan: where
    they take the int8 products of every row count (``fused.INT8_ROWS``); None for every other plan
    (fbgemm's copy stays, and the decoding passes pack the kernels' own for the rows they take)."""
    if plan.device != "cpu" or plan.precision != "int8" or plan.fused is None:
        return None
    return load_fused(plan.fused) if int8_rows_limit(plan.fused) >= EVERY_ROW_COUNT else None


def int8_panels(
    kernel: object, weight: torch.Tensor, bias: torch.Tensor | None, fused: ModuleType
) -> PackedInt8Panels | None:
    """An int8 layer of fbgemm's (``Int8Kernel``, ``PackedInt8``) as the fused kernels' int8 panels:
    its quantized weight (``int8_weight``) packed by their ``pack_int8``; None for a layer of another
    kernel, or a shape ``pack_int8`` cannot take (fbgemm's then stays)."""
    found = int8_weight(kernel, weight, bias)
    if found is None or not int8_packable(found[0], fused.int8_panel_width()):
        return None
    quantized, scales, b = found
    panels, colsums = fused.pack_int8(quantized)
    no_bias = scales.new_empty(0)
    return PackedInt8Panels(panels, colsums, scales, no_bias if b is None else b, fused.int8_linear, quantized.shape[0])


@dataclass(frozen=True, eq=False)
class PackedOneDNN:
    """One float layer's kernel once its weight is released (``release_float_weights``): oneDNN
    on the packed copy (out, in) and its own bias, at every row count (more than
    ``ONEDNN_MAX_ROWS`` rows in chunks of that many, so no new shapes reach oneDNN's caches);
    the ``weight`` and ``bias`` it is called with are placeholders and are not read."""

    packed_copy = True  # the weight it is called with is a placeholder (linear.is_packed)

    packed: torch.Tensor
    bias: torch.Tensor | None

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
    ) -> torch.Tensor:
        """x: (..., in) -> (..., out)."""
        return self.run(x.reshape(-1, x.shape[-1]), relu).view(*x.shape[:-1], self.packed.shape[0])

    def run(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        """x: (R, in) -> (R, out), in the weight's dtype (another dtype is refused, as ``F.linear`` does)."""
        if x.dtype != self.packed.dtype:
            raise RuntimeError(f"expected {self.packed.dtype} input for a {self.packed.dtype} layer, got {x.dtype}")
        return _onednn_rows(x, self.packed, self.bias, relu, x.shape[0])


@dataclass(frozen=True, eq=False)
class PackedPanels(_OnRows):
    """One float32 layer's kernel once its weight is released (``release_float_weights`` with
    the fused kernels): the fused kernels' product on the weight packed into panels
    (``panel_linear``) at every row count, its own bias added in the same pass; the ``weight`` and
    ``bias`` it is called with are placeholders and are not read. Faster than MKL's sgemm (Intel
    CPUs) from 2 to a few hundred rows and as fast at one row (docs/benchmarks.md "Packed panels"),
    faster than oneDNN on an AMD Zen 3 ("The panels on a real AVX2 CPU"); the model keeps one copy
    of the weight, not two."""

    packed_copy = True  # the weight it is called with is a placeholder (linear.is_packed)

    panels: torch.Tensor  # (out / width, in, width)
    bias: torch.Tensor  # (out,), or empty: none
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]  # ``panel_linear``
    out_features: int

    def run(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        """x: (R, in) float32 -> (R, out) (another dtype is refused, as ``F.linear`` does)."""
        if x.dtype != torch.float32:
            raise RuntimeError(f"expected float32 input for a float32 layer, got {x.dtype}")
        return self.product(x if x.is_contiguous() else x.contiguous(), self.panels, self.bias, relu)


def panel_kernels(plan: KernelPlan) -> ModuleType | None:
    """The fused kernels whose packed panels replace the float weights in a float32 plan on
    ``panels`` (where the fused kernels build and have panels: ``fused.PANEL_ROWS``); None for
    every other plan, and where they fail to build after all (the layers then run ``aten``)."""
    if plan.device != "cpu" or plan.precision != "float32" or plan.kernel != "panels" or plan.fused is None:
        return None
    return load_fused(plan.fused) if panel_rows_limit(plan.fused) > 0 else None


def release_float_weights(
    model: nn.Module,
    keep: Iterable[torch.Tensor] = (),
    panels: ModuleType | None = None,
    int8: ModuleType | None = None,
) -> int:
    """For inference: every layer whose kernel is ``Int8Kernel`` gets its weight packed now into a
    ``PackedInt8`` kernel (``PackedInt8Panels`` with ``int8``, the fused kernels that take every
    int8 product: ``int8_kernels``), and its float weight and bias are replaced by placeholders on the meta
    device (same shapes, no memory); every float32 layer on ``onednn`` likewise gets a
    ``PackedOneDNN`` kernel and a placeholder weight (its small bias stays, the kernel adds it),
    and with ``panels`` (the fused kernels: ``panel_kernels``) every float32 layer on ``aten`` (a
    plan on ``panels``) whose weight they can pack a ``PackedPanels`` kernel.
    So the model holds one copy of those weights (the packed one) instead of two. (bfloat16
    keeps both: its oneDNN path runs on AVX-512 CPUs only, where this was not measured.)
    Weights in ``keep`` (read elsewhere: the output projection, which the model runs through
    its own kernel and which may be the embeddings) stay. The model is then for inference
    only: ``model.network.linear.linear`` refuses to run a released layer on any other path.
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
        names: tuple[str, ...] = (
            ("weight", "bias") if isinstance(packed, PackedInt8 | PackedInt8Panels) else ("weight",)
        )
        for name in names:
            tensor = getattr(module, name)
            if tensor is not None:
                released += tensor.numel() * tensor.element_size()
                setattr(module, name, nn.Parameter(torch.empty_like(tensor, device="meta"), requires_grad=False))
    return released


def packed_kernel(
    kernel: object,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    panels: ModuleType | None = None,
    int8: ModuleType | None = None,
) -> PackedInt8 | PackedInt8Panels | PackedOneDNN | PackedPanels | None:
    """The kernel that runs a layer of ``kernel`` from a packed copy of ``weight`` (and ``bias``)
    alone, without reading them again: ``PackedInt8`` for ``Int8Kernel`` (``PackedInt8Panels``
    given the fused kernels that take its products, ``int8``: ``int8_kernels``), ``PackedOneDNN`` for
    float32 on ``onednn``, ``PackedPanels`` for float32 on ``aten`` given the fused kernels
    (``panels``) and a weight they can pack; None where the layer has no such kernel (it keeps
    reading its weight)."""
    b = None if bias is None else bias.detach()
    if isinstance(kernel, Int8Kernel):
        fbgemm = PackedInt8(_pack_int8(weight.detach(), b), kernel.reduce_range)
        ours = None if int8 is None else int8_panels(fbgemm, weight, b, int8)
        return fbgemm if ours is None else ours
    if kernel is onednn and weight.dtype == torch.float32:
        return PackedOneDNN(_pack_onednn(weight.detach()), b)
    if panels is not None and kernel is aten and packable(weight, bias, panels.panel_width()):
        no_bias = weight.new_empty(0)
        packed = panels.pack_panels(weight.detach())
        return PackedPanels(packed, no_bias if b is None else b, panels.panel_linear, weight.shape[0])
    return None


def reads_float_weight(kernel: object) -> bool:
    """Whether ``kernel`` computes a layer in float from the float weight it is called with (``aten``,
    ``wx``, ``onednn``, ``auto``), so another float product of that weight gives its results to
    rounding; not int8 (quantized) nor a packed kernel (its own copy; the weight a placeholder)."""
    return kernel is aten or kernel is wx or kernel is onednn or kernel is auto


def is_packed(kernel: object) -> bool:
    """Whether ``kernel`` runs from its own packed copy (the weight it is called with is a placeholder)."""
    return is_packed_copy(kernel)


def int8(reduce_range: bool) -> LinearKernel:
    return Int8Kernel(reduce_range)


def kernel_for(plan: KernelPlan, name: KernelName | None = None) -> LinearKernel:
    """The kernel the plan names (``name``: one of its names, default ``plan.kernel``)."""
    name = name or plan.kernel
    if name == "onednn":
        return onednn
    if name == "wx":
        return wx
    if name == "fbgemm-int8":
        torch.backends.quantized.engine = "fbgemm"  # linear_dynamic runs on the engine it was packed for
        return int8(plan.reduce_range)
    return aten


def install(model: nn.Module, plan: KernelPlan, step_layers: Iterable[nn.Module] = ()) -> nn.Module:
    """Give every layer of ``model`` that takes a kernel (``uses_kernel``) the plan's kernel, and
    the layers in ``step_layers`` (the decoder step's: ``Transformer.step_linears``) its ``step``;
    a ``Transformer`` also gets the fused decoder-step kernels the plan names (``model.engine.fused``:
    built on first use, None where they cannot be)."""
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


# (x (R, in), relu) -> (R, out): one layer's weights bound to its kernel (see ``bind``)
BoundLinear = Callable[[torch.Tensor, bool], torch.Tensor]


def bind(kernel: LinearKernel, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
    """``kernel`` with one layer's weights looked up (and packed) once, for a caller that runs
    the layer many times on 2-d inputs at inference (``model.engine.step``: a decoder step runs 19
    linears, and at a few rows the per-call lookups cost as much as the arithmetic). Only for
    weights that stay unchanged while the bound function is used."""
    kernel = _float_kernel(weight.dtype) if kernel is auto else kernel
    if isinstance(kernel, Int8Kernel | PackedInt8):
        int8_packed = kernel.packed if isinstance(kernel, PackedInt8) else _int8_packed.get(weight, bias)
        reduce_range = kernel.reduce_range

        def run_int8(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
            return _run_int8(x, int8_packed, reduce_range, relu)

        return run_int8
    if isinstance(kernel, PackedOneDNN | PackedPanels | PackedInt8Panels):
        return kernel.run
    if kernel is onednn:
        packed = _onednn_weight(weight)

        def run(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
            rows = x.shape[0]
            if _aten_instead(x, weight, rows):
                return aten(x, weight, bias, relu)
            return _onednn_rows(x, packed, bias, relu, rows)

        return run
    if kernel is aten and weight.dtype in (torch.float32, torch.float64) and weight.device.type == "cpu":
        return _bound_aten(weight, bias)

    def run_kernel(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        return kernel(x, weight, bias, relu)

    return run_kernel


def _bound_aten(weight: torch.Tensor, bias: torch.Tensor | None) -> BoundLinear:
    """``aten`` for 2-d inputs, calling what ``F.linear`` calls (``addmm(bias, x, Wᵀ)``, or ``mm``
    without a bias) on a transposed view made once: the same numbers without ``F.linear``'s and
    ``t``'s dispatch (18 calls a decoder step: ~1.2 µs a call, docs/benchmarks.md "Numbers behind the code")."""
    transposed = weight.t()

    if bias is None:

        def run_mm(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
            out = torch.mm(x, transposed)
            return out.relu_() if relu else out

        return run_mm

    def run_addmm(x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        out = torch.addmm(bias, x, transposed)
        return out.relu_() if relu else out

    return run_addmm


@cache
def _float_kernel(dtype: torch.dtype) -> LinearKernel:
    name = next((n for n, d in FLOAT_DTYPES.items() if d == dtype), None)
    return aten if name is None else kernel_for(choose("cpu", name))


def _machine_kernel(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False
) -> torch.Tensor:
    """What layers run before a plan is installed (``linear.auto``): this CPU's kernel for the
    input's float dtype."""
    return _float_kernel(x.dtype)(x, weight, bias, relu)


use_machine_kernel(_machine_kernel)
