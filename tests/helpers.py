"""Helpers for tests (a plain module: test modules import it, never each other or conftest): the
real service as a process (the launcher is the benchmarks'), this process's resident memory
(``bench.memory``, the benchmarks' reader), the shipped weights' folder, and ``require``."""

from __future__ import annotations

import os

import pytest

from bench.memory import rss_mib
from bench.server import ROOT, free_port, running_server, stop, wait_ready

__all__ = ["IN_CI", "ROOT", "SHIPPED", "free_port", "require", "rss_mib", "running_server", "stop", "wait_ready"]

SHIPPED = ROOT / "weights" / "de-en"
IN_CI = os.environ.get("CI", "").lower() == "true"


def require(condition: bool, reason: str) -> None:
    """Skip on a user's machine, fail under CI=true: CI must never skip silently."""
    if not condition:
        if IN_CI:
            pytest.fail(f"CI: {reason}")
        pytest.skip(reason)
