"""This process's memory as Linux reports it: the one reader the benchmarks and the tests share
(``bench.decode``'s peak memory, the allocator and cache tests, and the code they run in fresh
interpreters). Imports nothing beyond the standard library, so a subprocess can use it cheaply."""

from __future__ import annotations

import re
import resource
from pathlib import Path


def status_kib(field: str) -> int | None:
    """A memory field of /proc/self/status (``VmRSS``, ``VmHWM``, ``RssShmem``, ...) in KiB (None off Linux)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def rss_mib() -> float:
    """This process's resident set size now, in MiB (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
