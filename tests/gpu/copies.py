"""Counting the copies between host and device that a piece of code makes: torch's profiler
records each as a device activity named "Memcpy HtoD (...)" or "Memcpy DtoH (...)" (copies on
the device, "Memcpy DtoD", are not counted). On the CPU there is no device and the count is zero,
so the same test code runs on both (tests/gpu/test_cuda_decoding.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class Copies:
    """Host-device copies seen, and the profiler's table of the operations that ran (for a
    failure's message: which operation made them)."""

    to_host: int  # "Memcpy DtoH": a read back (``.item()``, ``.tolist()``, ``nonzero``'s size, ...)
    to_device: int  # "Memcpy HtoD": a host tensor or list sent to the device
    table: str


def direction(name: str) -> str | None:
    """A profiler event's name -> "DtoH", "HtoD", or None for anything else."""
    for kind in ("DtoH", "HtoD"):
        if name.startswith(f"Memcpy {kind}"):
            return kind
    return None


def count_copies(fn: Callable[[], object], device: torch.device) -> Copies:
    """Run ``fn`` under the profiler (with the device's activities where it is CUDA) -> the copies."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()  # copies of earlier work do not land in the window
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    kinds = [direction(event.name) for event in prof.events()]
    table = prof.key_averages().table(sort_by="count", row_limit=25)
    return Copies(kinds.count("DtoH"), kinds.count("HtoD"), table)
