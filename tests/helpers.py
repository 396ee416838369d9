"""Helpers for tests that run the real service as a process (the launcher is the benchmarks')."""

from __future__ import annotations

from bench.server import ROOT, free_port, running_server, stop, wait_ready

__all__ = ["ROOT", "free_port", "running_server", "stop", "wait_ready"]
