"""Helpers for tests: the real service as a process (the launcher is the benchmarks'), and this
process's resident memory."""

from __future__ import annotations

import resource

from bench.server import ROOT, free_port, running_server, stop, wait_ready

__all__ = ["ROOT", "free_port", "rss_mib", "running_server", "stop", "wait_ready"]


def rss_mib() -> float:
    """This process's resident set size now, in MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
