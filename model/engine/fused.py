"""The fused decoder-step kernels (``model/engine/csrc``: one C++ file a concern, a shared header):
built for this CPU on first use, loaded from torch's extension cache afterwards, and optional.

A decoder step at one sentence spends more time dispatching the small operations between its
matrix products than computing them (docs/benchmarks/README.md#fused-step). The C++ files do
each of them in one call: a step's input embedding, each attention sub-layer (cache write,
scores, softmax, weighted sum, heads merged), each post-LN residual join, a step of beam
search's bookkeeping (``model.engine.search_ops.SearchOps.advance``), the KV cache's reorder, and
for joining sentences the encoder's self-attention, the shortlist's candidates and the
cross-attention K/V split into heads, and each row's logits over its own sentence's shortlist
columns (``span_logits``). It also has a matrix product for a few rows (``linear``, up to
``FEW_ROWS``), which streams the weights faster than MKL's sgemm there, and one for up to a few
hundred rows on weights packed into panels (``panel_linear``, up to ``PANEL_ROWS``;
docs/benchmarks/README.md#linear-kernels). ``model.engine.step`` (``layer_ops``), ``DecodeSession``
(``search_ops``) and ``KVCache`` use them when the model names them (``Transformer.fused_step``), and
tensor operations otherwise, with the same results to float rounding (tests/model/test_fused.py, and
tests/model/test_decoding.py on both paths).

The variant is part of the kernel plan (``kernels.choose`` -> ``KernelPlan.fused``): compiled
for AVX-512 with VNNI, AVX-512, AVX2 + FMA or the compiler's default instructions, from the CPU's
reported features and the ISA caps, like every other kernel choice; cached under a name that
carries a hash of the sources (every ``.cpp`` and ``.h`` in ``csrc``). Building needs a C++
compiler (torch's ``cpp_extension``: g++, and ninja, a dependency, which compiles the files side
by side): a few minutes of CPU time once per variant and source version. A build already in the
cache is imported as it is, without the compiler: ``python -m model.engine.fused --build``
compiles every variant ahead of time (the Docker image does, into ``TORCH_EXTENSIONS_DIR``, so its
runtime needs no compiler). Where the kernels can neither be found nor built, ``load`` logs why
once and returns None, and decoding runs on the tensor operations (``loading.load`` then plans
float32 without the panels). ``TRANSLATOR_FUSED_STEP=off`` turns the kernels off.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch

from model.engine.features import CpuFeatures, runnable_variants

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
ENV = "TRANSLATOR_FUSED_STEP"

Variant = Literal["avx512vnni", "avx512", "avx2", "baseline"]

# What each variant is compiled with (its name is part of the extension's, so each is cached apart).
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
FLAGS: dict[str, list[str]] = {
    "avx512vnni": [*_AVX512, "-mavx512vnni"],
    "avx512": _AVX512,
    "avx2": _AVX2,
    "baseline": [],
}
# Products of at most this many rows run on the kernels' own ``linear`` (the weights streamed with
# a prefetch) instead of MKL's sgemm, which it beats there; the default build (SSE, no FMA) does
# not (docs/benchmarks/README.md#linear-kernels).
FEW_ROWS: dict[str, int] = {"avx512vnni": 4, "avx512": 4, "avx2": 4, "baseline": 0}
# Products of more rows than that, up to this many, run on a copy of the weight packed into panels
# (``pack_panels`` / ``panel_linear``: the broadcast form, outputs held in registers across the
# whole reduction), where a layer keeps its float weight; a checkpoint loaded for inference on a
# plan that runs MKL keeps the panels alone and runs every row count on them
# (``kernels.PackedPanels``). They beat MKL's sgemm up to a few hundred rows; not in the default
# build, which has no FMA (docs/benchmarks/README.md#linear-kernels).
PANEL_ROWS: dict[str, int] = {"avx512vnni": 256, "avx512": 256, "avx2": 256, "baseline": 0}

# int8 products of at most this many rows run on the kernels' own int8 product (``pack_int8`` /
# ``int8_linear``: fbgemm's quantization, each row's activations quantized apart, the weights in
# panels read by AVX2's vpmaddubsw, or by AVX-512 VNNI's vpdpbusd in the avx512vnni build: the same
# exact int32 sums) instead of fbgemm's dynamic linear, whose call has a large fixed cost. The AVX2
# and VNNI builds are ahead of fbgemm at every row count, so they take them all; the AVX-512 build
# without VNNI runs the AVX2 code and keeps only the few rows where fbgemm's fixed cost dominates
# (beyond them it has not been compared on such a CPU). Not in the default build (int8 needs AVX2).
# (docs/benchmarks/README.md#linear-kernels)
EVERY_ROW_COUNT = 1 << 30
INT8_ROWS: dict[str, int] = {"avx512vnni": EVERY_ROW_COUNT, "avx512": 16, "avx2": EVERY_ROW_COUNT, "baseline": 0}

# -fopenmp: at::parallel_for's OpenMP and the `omp simd` loops; -fno-trapping-math: lets the
# compiler vectorize loops with float comparisons in them (the kernels never read FP exceptions)
COMMON_FLAGS = ["-O3", "-fopenmp", "-fno-trapping-math"]

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def enabled(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """False when ``TRANSLATOR_FUSED_STEP`` is off, 0, false or no."""
    value = (os.environ if env is None else env).get(ENV, "").strip().lower()
    return value not in ("0", "off", "false", "no")


def load(variant: str | None) -> ModuleType | None:
    """The compiled kernels of ``variant`` (built first if torch's cache has none for it), or
    None when ``variant`` is None or they cannot be built here (logged once). Thread-safe;
    every call after the first returns the same answer at once."""
    if variant is None:
        return None
    with _lock:
        if variant not in _loaded:
            _loaded[variant] = _build(variant)
        return _loaded[variant]


def buildable(variant: str | None) -> bool:
    """Whether ``variant``'s kernels are loaded or can be here: built already (``_prebuilt``), or
    a C++ compiler (``CXX``, else ``c++``) on PATH, unless an earlier attempt failed; cheap, builds
    nothing. (A build can still fail; ``load`` then logs why and the tensor operations run.)"""
    if variant is None:
        return False
    with _lock:
        if variant in _loaded:
            return _loaded[variant] is not None
    return _prebuilt(variant) is not None or shutil.which(os.environ.get("CXX", "c++")) is not None


def few_rows_limit(variant: str | None) -> int:
    """The most rows a matrix product of ``variant``'s kernels takes (``FEW_ROWS``; 0: none)."""
    return 0 if variant is None else FEW_ROWS.get(variant, 0)


def panel_rows_limit(variant: str | None) -> int:
    """The most rows a product on ``variant``'s packed panels takes (``PANEL_ROWS``; 0: none)."""
    return 0 if variant is None else PANEL_ROWS.get(variant, 0)


def int8_rows_limit(variant: str | None) -> int:
    """The most rows an int8 product of ``variant``'s kernels takes (``INT8_ROWS``; 0: none)."""
    return 0 if variant is None else INT8_ROWS.get(variant, 0)


def int8_packable(quantized: torch.Tensor) -> bool:
    """Whether the kernels' ``pack_int8`` takes this quantized weight (N, K): int8 on the CPU, K a
    multiple of 4 (any N: a vocabulary's last panel is padded, ``int8_columns``)."""
    q = quantized
    return q.device.type == "cpu" and q.dtype == torch.int8 and q.dim() == 2 and q.shape[1] % 4 == 0


def packable(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernels' ``pack_panels`` takes this weight (N, K) and ``panel_columns`` this
    bias (N): float32 CPU tensors with storage, contiguous (any N: a vocabulary's last panel is
    padded)."""
    return _plain(weight, 2) and (bias is None or _fits(bias, weight))


def _plain(t: torch.Tensor, dim: int) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == dim and t.is_contiguous()


def _fits(bias: torch.Tensor, weight: torch.Tensor) -> bool:
    return _plain(bias, 1) and bias.shape[0] == weight.shape[0]


def streamable(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernels' ``linear`` reads this weight (N, K) and bias (N) as they are: float32
    CPU tensors with storage (not placeholders of released weights), contiguous, K a multiple of 16."""
    return _plain(weight, 2) and weight.shape[1] % 16 == 0 and (bias is None or _fits(bias, weight))


def _find_ninja() -> None:
    """torch's builder runs ``ninja`` from PATH: put the ninja package's (a dependency) there when
    PATH has none, as when a virtual environment's programs run without it being activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


# A build takes well under a minute; a lock file older than this was left by a build that was
# killed, and torch's builder would wait for it forever (a service that never became ready).
STALE_LOCK_S = 600.0


def _clear_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return  # no lock: nobody is building
    if age > STALE_LOCK_S:
        log.warning("removing %s, left %.0f s ago by a build that did not finish", lock.name, age)
        lock.unlink(missing_ok=True)


def _cflags(variant: str) -> list[str]:
    """What ``variant`` is compiled with (``load``'s build and ``_compile``; hashed into ``_name``)."""
    return [*COMMON_FLAGS, *FLAGS[variant]]


UNITY = "unity.cpp"  # includes every other file of ``CSRC``: one translation unit


def _sources() -> list[Path]:
    """The C++ file compiled into the extension: ``UNITY``, which includes the others (compiled
    apart, each would parse the torch headers again); FileNotFoundError where it is missing (an
    install without the sources)."""
    unity = CSRC / UNITY
    if not unity.is_file():
        raise FileNotFoundError(f"no C++ sources in {CSRC}")
    return [unity]


def _name(variant: str) -> str:
    """The extension's name: the variant and a short hash of what its build depends on (every C++
    source and header, by name and content, the flags, torch's version, and the sources' folder),
    so two checkouts, an upgrade or another torch on one machine never load each other's build, a
    header's edit rebuilds, and a build found under it is the right one. The folder is in it
    because torch's builder rebuilds a folder whose sources moved: two checkouts sharing one name
    rebuilt it in turn, each build locking out the other's processes."""
    digest = hashlib.sha256(str(CSRC.resolve()).encode() + b"\0")
    for path in sorted([*_sources(), *CSRC.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join([*_cflags(variant), torch.__version__]).encode())
    return f"translator_step_{variant}_{digest.hexdigest()[:12]}"


def _build_directory(name: str) -> Path:
    """Where torch's builder keeps extension ``name`` (``TORCH_EXTENSIONS_DIR``, else a folder of
    torch's in the user's cache; created by torch where it can)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


def _prebuilt(variant: str, wait_s: float = 0.0) -> Path | None:
    """The compiled library of ``variant`` in the extension cache, where a build left one (not
    while a build holds the folder's lock: the library may be half written; ``load`` waits, and so
    does this up to ``wait_s``: torch's loader takes the lock briefly even where nothing is built)."""
    try:
        name = _name(variant)
        library = _build_directory(name) / f"{name}.so"
    except OSError:  # no source (an install without it), a cache folder that cannot be made: nothing to find
        return None
    deadline = time.monotonic() + wait_s
    while (library.parent / "lock").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return library if library.is_file() and not (library.parent / "lock").exists() else None


def _import_prebuilt(variant: str, wait_s: float = 0.0) -> ModuleType | None:
    """``variant``'s build from the cache, imported as it is (no compiler, no ninja), or None
    where there is none or it does not import (logged; then it is built again)."""
    library = _prebuilt(variant, wait_s)
    if library is None:
        return None
    try:
        spec = importlib.util.spec_from_file_location(library.stem, library)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError, AssertionError) as err:
        log.warning("fused decoder-step kernels (%s): %s does not load (%s); building again", variant, library, err)
        return None
    return module


def _build(variant: str) -> ModuleType | None:
    if variant not in FLAGS:
        raise ValueError(f"unknown fused-step variant {variant!r}; one of {', '.join(FLAGS)}")
    start = time.perf_counter()
    found = _import_prebuilt(variant)
    if found is not None:
        log.info("fused decoder-step kernels (%s) loaded from %s", variant, found.__file__)
        return found
    _find_ninja()
    try:
        from torch.utils import cpp_extension

        name = _name(variant)  # (no source in an install without it: logged)

        _clear_stale_lock(_build_directory(name) / "lock")
        module = cpp_extension.load(
            name=name,
            sources=[str(path) for path in _sources()],
            extra_cflags=_cflags(variant),
            verbose=False,
        )
    except Exception as err:  # no compiler, no ninja, a read-only cache: the tensor operations run instead
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        log.warning(
            "fused decoder-step kernels (%s) unavailable, decoding on tensor operations (slower at small "
            "batches): %s; set %s=off to skip the attempt",
            variant,
            first[:300],
            ENV,
        )
        return None
    log.info("fused decoder-step kernels (%s) ready in %.1f s", variant, time.perf_counter() - start)
    return module


def _compile(variant: str) -> Path:
    """Compile ``variant`` into the extension cache exactly as ``load`` does (torch's builder, the
    same name, flags and folder), without importing it: a build machine may not run the
    instructions of every variant it builds (AVX-512 on an AVX2 CPU). -> the library."""
    from torch.utils import cpp_extension

    _find_ninja()
    name = _name(variant)
    directory = _build_directory(name)
    _clear_stale_lock(directory / "lock")
    cpp_extension._write_ninja_file_and_build_library(
        name=name,
        sources=[str(path) for path in _sources()],
        extra_cflags=_cflags(variant),
        extra_cuda_cflags=[],
        extra_sycl_cflags=[],
        extra_ldflags=[],
        extra_include_paths=[],
        build_directory=str(directory),
        verbose=False,
        with_cuda=False,
        with_sycl=False,
    )
    return directory / f"{name}.so"


def main(argv: list[str] | None = None) -> None:
    """``python -m model.engine.fused --build [VARIANT ...]``: compile the kernels ahead of time into
    torch's extension cache (``TORCH_EXTENSIONS_DIR``), every variant by default (each in a
    process of its own, at the same time), so processes that use them later need no compiler;
    those this CPU can run are imported as a check. Exits non-zero when one does not build."""
    parser = argparse.ArgumentParser(description="Build the fused decoder-step kernels ahead of time.")
    parser.add_argument("--build", nargs="*", choices=list(FLAGS), metavar="VARIANT", required=True,
                        help=f"variants to build (default: all of {', '.join(FLAGS)})")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    variants = args.build or list(FLAGS)
    if len(variants) == 1:
        variant = variants[0]
        start = time.perf_counter()
        try:
            library = _compile(variant)
        except Exception as err:  # the compiler's message is in the log above
            sys.exit(f"fused decoder-step kernels did not build: {variant} ({str(err).strip()[:300]})")

        runs_here = variant in runnable_variants(CpuFeatures.detect(env={}))  # the hardware's, not capped
        # (another process loading this variant may hold the lock a moment, or building it a minute)
        if runs_here and _import_prebuilt(variant, wait_s=120.0) is None:
            sys.exit(f"fused decoder-step kernels did not load: {variant}")
        seconds, note = time.perf_counter() - start, "" if runs_here else " (not run here)"
        log.info("%s: %s in %.0f s%s", variant, library, seconds, note)
        return
    python = [sys.executable, *(["-P"] if sys.flags.safe_path else [])]  # (-P: as this process imports)
    builds = {v: subprocess.Popen([*python, "-m", "model.engine.fused", "--build", v]) for v in variants}
    failed = [variant for variant, build in builds.items() if build.wait() != 0]
    if failed:
        sys.exit(f"fused decoder-step kernels did not build: {', '.join(failed)}")


if __name__ == "__main__":
    main()
