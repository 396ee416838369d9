"""Process-wide tuning of glibc's malloc for CPU inference (called by entry points only).

torch's CPU allocator has no cache: every tensor is a fresh ``malloc``. glibc serves blocks
above ``M_MMAP_THRESHOLD`` (128 KiB at first) with a new ``mmap`` and unmaps them on free, so
each decoding step's logits and beam buffers (megabytes) are faulted in and zeroed page by
page, again and again. Keeping such blocks in the heap (and not trimming it) saves most of
those page faults and a good part of decoding time (docs/benchmarks.md "Numbers behind the
code"). The cost is that the
process keeps its peak heap resident instead of returning it to the OS between batches.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's upper limit for the dynamic threshold on 64-bit
TRIM_THRESHOLD = 256 * 2**20


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Serve blocks up to ``mmap_threshold`` bytes from the heap and keep up to ``trim_threshold``
    bytes of free heap; True when applied (glibc), False elsewhere (musl, macOS)."""
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
    """Hand the free parts of every malloc arena back to the OS (glibc's ``malloc_trim(0)``);
    False where that does not exist. The service calls it whenever its model runs out of work,
    so a replica's RSS falls back after a burst of large batches instead of keeping their
    high-water mark (docs/reliability.md "Memory"); decoding keeps its fast heap in between."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


# torch's CPU kernels keep two caches keyed by matrix shape, and the decoder's row counts change
# every step, so a server fills both with shapes it may never see again: oneDNN's primitive cache
# (process-wide, 1,024 primitives by default, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and the
# primitive-descriptor cache of ideep, torch's oneDNN wrapper (one per thread, 1,024 by default,
# ``LRU_CACHE_CAPACITY``). An entry of either holds a brgemm matmul descriptor, ~0.27 MiB on
# AVX2: with the defaults the model thread's descriptors alone kept ~270 MiB resident after a
# soak. 64 entries each bound that memory; the cost is rebuilding the entries of shapes that come back
# (docs/benchmarks.md "Numbers behind the code", docs/reliability.md "Memory").
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
