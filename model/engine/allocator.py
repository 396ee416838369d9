"""Process-wide choice and tuning of the memory allocator for CPU inference (entry points only).

Which allocator: mimalloc where the system has it (Debian/Ubuntu ``libmimalloc2.0``), loaded by
``exec_with_malloc`` before anything else (``LD_PRELOAD``, the way PyTorch's own CPU launcher
``torch.backends.xeon.run_cpu`` preloads tcmalloc or jemalloc), else glibc's malloc tuned as below.
glibc keeps each arena's free blocks where they are, so the transients of batches of growing
lengths (encoder activations, cross-attention K/V, fbgemm's int32 accumulators) leave holes the
next batch's do not fit, and the heap stays resident far above the live peak. mimalloc's
size-segregated pages reuse them: lower batch peaks at the same speed
(docs/benchmarks/README.md#allocator); loading, whose temporaries mimalloc would
keep, runs with them handed back as they are freed (``freeing_at_once``). Under glibc (``TRANSLATOR_MALLOC=glibc``,
or no mimalloc installed):

torch's CPU allocator has no cache: every tensor is a fresh ``malloc``. glibc serves blocks
above ``M_MMAP_THRESHOLD`` (128 KiB at first) with a new ``mmap`` and unmaps them on free, so
each decoding step's logits and beam buffers (megabytes) are faulted in and zeroed page by
page, again and again. Keeping such blocks in the heap (and not trimming it) saves most of
those page faults and a good part of decoding time (docs/benchmarks/README.md#allocator).
The cost is that the
process keeps its peak heap resident instead of returning it to the OS between batches.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's upper limit for the dynamic threshold on 64-bit
TRIM_THRESHOLD = 256 * 2**20


MallocChoice = Literal["auto", "mimalloc", "glibc"]
MIMALLOC = "mimalloc"
_PRELOADABLE = ("mimalloc", "jemalloc", "tcmalloc")  # what active_malloc recognizes in the process
REEXEC_MARK = "TRANSLATOR_MALLOC_REEXEC"  # set in the re-executed process: never exec twice


class MallocUnavailable(RuntimeError):
    """The allocator asked for is not installed, or did not load."""


@functools.cache
def active_malloc() -> str:
    """The allocator serving this process's ``malloc``: ``mimalloc``, ``jemalloc`` or ``tcmalloc``
    when one is loaded (``LD_PRELOAD``), else ``glibc`` (``system`` off Linux). Fixed for the
    process's life (the dynamic loader binds ``malloc`` once)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    for name in _PRELOADABLE:
        if f"/lib{name}" in maps:
            return name
    return "glibc"


def mimalloc_library() -> str | None:
    """The name to preload mimalloc by (e.g. ``libmimalloc.so.2``), or None where it is not installed."""
    return ctypes.util.find_library(MIMALLOC) if sys.platform.startswith("linux") else None


def wanted_malloc(choice: MallocChoice) -> str:
    """The allocator ``choice`` means here: ``auto`` is mimalloc where installed, else glibc;
    raises ``MallocUnavailable`` for ``mimalloc`` where it is not installed."""
    if choice == "glibc":
        return "glibc"
    if mimalloc_library() is not None:
        return MIMALLOC
    if choice == MIMALLOC:
        raise MallocUnavailable(
            "TRANSLATOR_MALLOC=mimalloc, but mimalloc is not installed (Debian/Ubuntu: apt install libmimalloc2.0)"
        )
    return "glibc"


def malloc_env(choice: MallocChoice, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a new process that runs on the allocator ``choice`` means: mimalloc's library
    added to ``LD_PRELOAD`` where wanted; for glibc, any preloaded allocator in ``LD_PRELOAD`` removed."""
    out = dict(env)
    kept = [p for p in out.get("LD_PRELOAD", "").split() if not any(f"lib{n}" in p for n in _PRELOADABLE)]
    if wanted_malloc(choice) == MIMALLOC:
        kept.insert(0, str(mimalloc_library()))
    if kept:
        out["LD_PRELOAD"] = " ".join(kept)
    else:
        out.pop("LD_PRELOAD", None)
    return out


def exec_with_malloc(choice: MallocChoice) -> None:
    """Make this process run on the allocator ``choice`` means: return at once where it does,
    else re-execute the same command line (``sys.orig_argv``) with ``malloc_env`` (never twice).
    Call first thing in a command's entry point: the process is replaced. Raises
    ``MallocUnavailable`` where the allocator is missing, or did not load after the re-execution
    when it was asked for by name (``auto`` then goes on, on what it has, with a warning)."""
    wanted, active = wanted_malloc(choice), active_malloc()
    if wanted == active or active == "system":
        return
    if os.environ.get(REEXEC_MARK):  # re-executed already, and the preload did not take
        if choice == "auto":
            log.warning("%s did not load (LD_PRELOAD=%s): running on %s", wanted, os.environ.get("LD_PRELOAD"), active)
            return
        raise MallocUnavailable(f"{wanted} was wanted (TRANSLATOR_MALLOC={choice}) but {active} serves malloc")
    log.info("re-executing on %s (TRANSLATOR_MALLOC=%s; this process has %s)", wanted, choice, active)
    env = malloc_env(choice, os.environ) | {REEXEC_MARK: "1"}
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Serve blocks up to ``mmap_threshold`` bytes from the heap and keep up to ``trim_threshold``
    bytes of free heap; True when applied (glibc serving malloc), False elsewhere (mimalloc or
    another allocator preloaded, musl, macOS)."""
    if active_malloc() != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)
        )
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.info("malloc tuning not applied (not glibc)")
    return ok


def release_free_memory() -> bool:
    """Hand the allocator's free memory back to the OS: glibc's ``malloc_trim(0)`` (the free
    parts of every arena), mimalloc's ``mi_collect(true)``; False where neither exists. The
    service calls it whenever its model runs out of work, so a replica's RSS falls back after a
    burst of large batches instead of keeping their high-water mark (docs/reliability.md
    "Memory"); decoding keeps its fast heap in between."""
    try:
        if active_malloc() == MIMALLOC:
            ctypes.CDLL(None).mi_collect(ctypes.c_bool(True))
            return True
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


# mimalloc hands a freed span back to the OS only after a delay (25 ms in 2.0), and only when the
# segment that holds it is allocated from again; ``mi_collect`` does not hurry it. Loading a model
# frees most of what it allocates (the float32 model that packed copies replace, the conversions'
# temporaries), in segments decoding may never touch again: they stayed resident
# (docs/benchmarks/README.md#allocator). With the delay at 0 they go back as they are freed;
# decoding cannot run so (every step's freed buffers would be faulted in again), so the delay
# is 0 only while loading. The option is set by its number: ``mi_option_decommit_delay``
# in mimalloc 2.0, ``mi_option_purge_delay`` in the same slot in 2.1; other versions are left alone.
_MI_DECOMMIT_DELAY = 15
_MI_VERSIONS = range(200, 300)  # mi_version(): 209 for 2.0.9, 212 for 2.1.2


@contextlib.contextmanager
def freeing_at_once() -> Iterator[bool]:
    """Within the block, memory the process frees goes back to the OS at once (model loading:
    see above), then the allocator's own delay again and its free memory handed back
    (``release_free_memory``). Yields whether it applies: mimalloc 2.x; elsewhere the block runs
    as it is (glibc's tuned heap gives back its free top with ``malloc_trim``)."""
    lib = _mimalloc() if active_malloc() == MIMALLOC else None
    if lib is None:
        yield False
        return
    delay = lib.mi_option_get(_MI_DECOMMIT_DELAY)
    lib.mi_option_set(_MI_DECOMMIT_DELAY, 0)
    try:
        yield True
    finally:
        lib.mi_option_set(_MI_DECOMMIT_DELAY, delay)
        release_free_memory()


def _mimalloc() -> ctypes.CDLL | None:
    """The process's mimalloc, where it is a version whose option numbers are known."""
    try:
        lib = ctypes.CDLL(None)
        version = int(lib.mi_version())
    except (OSError, AttributeError):
        return None
    if version not in _MI_VERSIONS:
        log.info("mimalloc %d: option numbers unknown, loading keeps its freed memory", version)
        return None
    lib.mi_option_get.argtypes, lib.mi_option_get.restype = (ctypes.c_int,), ctypes.c_long
    lib.mi_option_set.argtypes = (ctypes.c_int, ctypes.c_long)
    return lib


# The decoder's KV cache is the one large long-lived allocation of decoding, reallocated (bigger
# or smaller) every few steps as the batch's rows and lengths change. Served from the tuned heap
# above, each size change left the old buffers behind as free but resident heap between live
# blocks until a ``malloc_trim``. Buffers from pages of their own (an anonymous mmap, zeroed by
# the kernel) go back to the OS the moment the cache drops them; a fresh buffer costs its page faults once per
# reallocation (every ``cache.SPARE_SLOTS`` steps), not every step like the per-step tensors
# the heap keeps for (docs/benchmarks/README.md#kv-cache).
#
# The mapping is private: Python's ``mmap.mmap(-1, size)`` maps shared anonymous memory, which the
# kernel backs with a shmem file, so each page fault allocated a shmem folio and each unmap closed
# the file; private pages fault in cheaper. Huge pages on top (MADV_HUGEPAGE) are not advised:
# they make whole 2 MiB pages resident where a buffer's spare positions are not touched yet
# (docs/benchmarks/README.md#numbers-behind-the-code).
OWN_PAGES_MIN_BYTES = 1 << 20
_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def zeroed_pages(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor of ``numel`` zeros on pages of its own when it is at least
    ``OWN_PAGES_MIN_BYTES``, returned to the OS as soon as the tensor is freed (smaller ones:
    ``torch.zeros``, from the heap)."""
    import torch  # only here: this module is imported before torch on purpose

    size = numel * dtype.itemsize
    if size < OWN_PAGES_MIN_BYTES:
        return torch.zeros(numel, dtype=dtype)
    # anonymous, zero-filled; unmapped when the tensor lets it go (no flags off POSIX: Windows' mmap)
    pages = mmap.mmap(-1, size, flags=_PRIVATE) if _PRIVATE else mmap.mmap(-1, size)
    return torch.frombuffer(pages, dtype=dtype, count=numel)


# torch's CPU kernels keep two caches keyed by matrix shape, and the decoder's row counts change
# every step, so a server fills both with shapes it may never see again: oneDNN's primitive cache
# (process-wide, 1,024 primitives by default, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and the
# primitive-descriptor cache of ideep, torch's oneDNN wrapper (one per thread, 1,024 by default,
# ``LRU_CACHE_CAPACITY``). An entry of either holds a brgemm matmul descriptor, so with the
# defaults a server's descriptors grew into a large share of its memory. 64 entries each bound
# that memory; the cost is rebuilding the entries of shapes that come back
# (docs/benchmarks/README.md#numbers-behind-the-code, docs/reliability.md "Memory").
ONEDNN_PRIMITIVE_CACHE = 64
IDEEP_DESCRIPTOR_CACHE = 64


def bound_onednn_cache(capacity: int = ONEDNN_PRIMITIVE_CACHE, descriptors: int = IDEEP_DESCRIPTOR_CACHE) -> int:
    """Bound oneDNN's primitive cache and ideep's descriptor caches unless
    ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` / ``LRU_CACHE_CAPACITY`` are set already. oneDNN reads
    its variable when it builds its first primitive, ideep in each thread the first time that
    thread runs a linear layer, so call this before any model work. -> the primitive cache's
    capacity in force."""
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(descriptors))
    return int(os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity)))


# MKL (torch's BLAS on x86: every float32 layer on Intel CPUs, kernels.choose) has a memory
# manager of its own, "fast MM", that keeps every scratch buffer its GEMMs allocate for reuse and
# never returns them. Batches of varied shapes grow that pool with memory no tensor uses. With
# it off MKL allocates through malloc, whose tuned heap (above) reuses the blocks: lower batch
# peaks at no speed cost (docs/benchmarks/README.md#allocator). MKL reads the
# variable once, while torch is being imported, so ``model/__init__.py`` sets it before anything
# imports torch (app and bench import ``model`` first for that reason).
MKL_FAST_MM = "MKL_DISABLE_FAST_MM"


def disable_mkl_buffer_pool() -> None:
    """Turn MKL's buffer pool off for this process unless ``MKL_DISABLE_FAST_MM`` is set
    already; takes effect only before torch is imported."""
    os.environ.setdefault(MKL_FAST_MM, "1")


def mkl_buffer_pool() -> tuple[bool, int] | None:
    """(whether MKL's buffer pool is on, bytes it holds now) from the MKL that torch links, or
    None where torch has no MKL (ARM builds, macOS) or does not export its service calls."""
    import torch  # only here: this module is imported before torch on purpose

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        status, stat = lib.mkl_serv_get_fast_mm_status, lib.mkl_serv_mem_stat
    except (OSError, AttributeError):
        return None
    stat.restype = ctypes.c_int64
    buffers = ctypes.c_int(0)
    held = int(stat(ctypes.byref(buffers)))
    return status() == 0, held
