"""The CPU features the kernel choice depends on: read once from /proc/cpuinfo, narrowed by the
ISA caps users set for the libraries (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``), so a
capped run also takes the capped path. Tests build ``CpuFeatures`` by hand (or from the named
feature sets below) to drive every choice on any machine.

A leaf module: ``model.engine.kernels`` (the plan) and ``model.engine.fused`` (the builds) both
read it, and neither imports the other for it.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from dataclasses import astuple, dataclass, replace
from functools import cache
from pathlib import Path

import torch


@dataclass(frozen=True)
class CpuFeatures:
    """The x86 features the kernel choice depends on (all False off x86)."""

    avx2: bool = False
    fma: bool = False
    avx512: bool = False  # AVX-512 F, BW, VL and DQ: oneDNN's "avx512_core"
    avx512_bf16: bool = False
    avx_ne_convert: bool = False
    avx512_vnni: bool = False
    intel: bool = False  # vendor_id GenuineIntel: where MKL runs its own fast paths
    f16c: bool = False  # float16 <-> float32 conversions in 8 lanes: the fused kernels' float16 KV cache

    @classmethod
    def from_flags(cls, flags: Iterable[str], vendor: str = "") -> CpuFeatures:
        """From /proc/cpuinfo's flag names (and its ``vendor_id``)."""
        f = set(flags)
        return cls(
            avx2="avx2" in f,
            fma="fma" in f,
            avx512={"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f,
            avx512_bf16="avx512_bf16" in f,
            avx_ne_convert="avx_ne_convert" in f,
            avx512_vnni="avx512_vnni" in f,
            intel=vendor == "GenuineIntel",
            f16c="f16c" in f,
        )

    @classmethod
    def detect(cls, cpuinfo: Path = Path("/proc/cpuinfo"), env: dict[str, str] | None = None) -> CpuFeatures:
        """This machine's features, narrowed by the libraries' ISA caps in ``env``."""
        try:
            text = cpuinfo.read_text()
        except OSError:
            text = ""
        lines = text.splitlines()
        line = next((ln for ln in lines if ln.startswith("flags")), None)
        vendor = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("vendor_id")), "")
        if line is not None:
            features = cls.from_flags(line.split(":", 1)[1].split(), vendor)
        else:  # no /proc (macOS) or no x86 flags: ask torch, which reads cpuinfo itself
            x86 = platform.machine().lower() in ("x86_64", "amd64")
            features = cls(avx2=x86 and torch.cpu._is_avx2_supported(), fma=x86 and torch.cpu._is_avx2_supported())
        return features.capped(os.environ if env is None else env)

    def capped(self, env: dict[str, str] | os._Environ[str]) -> CpuFeatures:
        """Drop what ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` forbid the libraries to use."""
        onednn = env.get("ONEDNN_MAX_CPU_ISA", env.get("DNNL_MAX_CPU_ISA", "")).upper()
        aten = env.get("ATEN_CPU_CAPABILITY", "").lower()
        out = self
        if onednn.startswith(("SSE", "AVX2", "AVX_")) or onednn == "AVX" or aten in ("avx2", "default"):
            out = replace(out, avx512=False, avx512_bf16=False, avx512_vnni=False)
            if not onednn.startswith("AVX2"):  # AVX2_VNNI_2 keeps AVX-NE-CONVERT
                out = replace(out, avx_ne_convert=False)
        if onednn.startswith("SSE") or onednn == "AVX" or aten == "default":
            out = replace(out, avx2=False, fma=False, f16c=False)
        return out

    def __and__(self, other: CpuFeatures) -> CpuFeatures:
        """What both have (a simulated CPU no larger than this one, say)."""
        return CpuFeatures(*(a and b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @property
    def isa(self) -> str:
        """A short name for reports: avx512-bf16, avx512, avx2 or baseline."""
        if self.avx512:
            return "avx512-bf16" if self.avx512_bf16 else "avx512"
        return "avx2" if self.avx2 else "baseline"


AVX512_BF16 = CpuFeatures(True, True, True, True, False, True, f16c=True)  # AVX-512 with VNNI and BF16
AVX512_NO_VNNI = CpuFeatures(True, True, True, f16c=True)  # AVX-512 without VNNI or BF16
AVX2_ONLY = CpuFeatures(avx2=True, fma=True, f16c=True)  # AVX2 and FMA, no AVX-512
BASELINE = CpuFeatures()  # no AVX2: old x86, or another architecture


@cache
def detected() -> CpuFeatures:
    """This process's CPU features (read once)."""
    return CpuFeatures.detect()


def fused_variant(features: CpuFeatures) -> str:
    """The build of the fused decoder-step kernels (``model.engine.fused``) this CPU runs: AVX-512 with
    VNNI (its int8 products on vpdpbusd), AVX-512, AVX2 + FMA, or the compiler's default instructions."""
    if features.avx512 and features.fma:
        return "avx512vnni" if features.avx512_vnni else "avx512"
    return "avx2" if features.avx2 and features.fma else "baseline"


def runnable_variants(features: CpuFeatures) -> list[str]:
    """Every build of the fused kernels a CPU with ``features`` runs: its own (``fused_variant``)
    and the narrower ones, sorted."""
    narrower = (features, features & AVX512_NO_VNNI, features & AVX2_ONLY, BASELINE)
    return sorted({fused_variant(f) for f in narrower})
