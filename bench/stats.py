"""The statistics the benchmarks report, defined once so every table means the same thing.

- ``median``: the middle of repeated timings (the mean of the middle two for an even count):
  a round disturbed by the machine moves it less than it moves the mean.
- ``median_row``: of several rounds, the one whose figure is the median (the upper of the
  middle two for an even count), so every number printed beside it comes from the same round.
- ``percentile``: nearest rank, so a p99 is a latency some request really had.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def median_row(rows: Sequence[T], key: Callable[[T], float]) -> T:
    return sorted(rows, key=key)[len(rows) // 2]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))
    return ordered[index]
