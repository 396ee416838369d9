"""Plot latency against throughput from ``bench.load``'s JSON lines.

    python -m bench.load --concurrency 1,4,16,64 --requests 512 > load.jsonl
    python -m bench.plot load.jsonl --out docs/load.png

One line per batching mode: x = requests per second, y = p50 (solid) and p95 (dashed) latency
in ms, each point labelled with its concurrency. Lines that are not JSON objects are ignored,
so a log with other output in it works too.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def read_rows(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The load-benchmark rows (JSON objects with rps and latency keys) among ``lines``."""
    rows = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if {"concurrency", "batching", "rps", "p50_ms", "p95_ms"} <= set(row):
            rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], out: Path, title: str = "Server latency against throughput") -> Path:
    """Write the PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("no load-benchmark rows to plot")
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for mode in sorted({r["batching"] for r in rows}):
        series = sorted((r for r in rows if r["batching"] == mode), key=lambda r: r["concurrency"])
        x = [r["rps"] for r in series]
        (line,) = ax.plot(x, [r["p50_ms"] for r in series], marker="o", label=f"batching {mode}: p50")
        ax.plot(
            x, [r["p95_ms"] for r in series], marker="x", ls="--", color=line.get_color(), label=f"batching {mode}: p95"
        )
        for r in series:
            ax.annotate(f"c={r['concurrency']}", (r["rps"], r["p50_ms"]), textcoords="offset points", xytext=(4, -10))
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="bench.load output (JSON lines)")
    parser.add_argument("--out", type=Path, default=Path("docs/load.png"))
    parser.add_argument("--title", default="Server latency against throughput")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    path = plot(read_rows(args.results.read_text().splitlines()), args.out, args.title)
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
