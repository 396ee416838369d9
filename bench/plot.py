"""Charts of the benchmarks' JSON lines (the pictures docs/benchmarks/ shows).

    python -m bench.plot [load] load.jsonl --out docs/load.png     # latency against throughput
    python -m bench.plot decode decode.jsonl --out docs/decode.png  # sentences/s per system (bars)
    python -m bench.plot serving load.jsonl --out docs/serving.png  # requests/s per client count (bars)

``load``: one line per batching mode, x = requests per second, y = p50 (solid) and p95 (dashed)
latency in ms, each point labelled with its concurrency. ``decode``: ``bench.decode`` rows,
grouped by precision and beam, one bar per system, labelled with its sentences/s and its ratio to
CTranslate2 at the same precision. ``serving``: ``bench.load`` rows, grouped by client count,
one bar per server (batching mode), labelled with requests/s and p99. Lines that are not JSON
objects are ignored, so a log with other output in it works too.
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
    return json_rows(lines, {"concurrency", "batching", "rps", "p50_ms", "p95_ms"})


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


def json_rows(lines: Iterable[str], keys: set[str]) -> list[dict[str, Any]]:
    """The JSON objects among ``lines`` that have every one of ``keys``."""
    rows = []
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            row = json.loads(line)
            if keys <= set(row):
                rows.append(row)
    return rows


def bars(
    groups: list[str], series: dict[str, list[float | None]], labels: dict[str, list[str]], ylabel: str, title: str
) -> Any:
    """A grouped bar chart: one group per x label, one bar per series (None: no bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) * max(1, len(series)) / 2 + 2), 4.5), dpi=120)
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        shown = [(x, v, t) for x, v, t in zip(xs, values, labels[name], strict=True) if v is not None]
        drawn = ax.bar([x for x, _, _ in shown], [v for _, v, _ in shown], width, label=name)
        ax.bar_label(drawn, [t for _, _, t in shown], fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_decode(rows: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    return _save(decode_figure(rows, title), out)


def decode_figure(rows: list[dict[str, Any]], title: str = "") -> Any:
    """Sentences/s of every system, grouped by precision and beam (``bench.decode`` rows)."""
    if not rows:
        raise ValueError("no bench.decode rows to plot")
    groups = sorted({(r["dtype"], r["beam_size"]) for r in rows}, key=lambda g: (g[0] != "float32", g))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    by = {(r["system"], r["dtype"], r["beam_size"]): r for r in rows}
    series: dict[str, list[float | None]] = {}
    labels: dict[str, list[str]] = {}
    for system in systems:
        values: list[float | None] = []
        texts = []
        for dtype, beam in groups:
            row = by.get((system, dtype, beam))
            peer = by.get(("ctranslate2", dtype, beam)) or by.get(("ctranslate2-int8", dtype, beam))
            values.append(None if row is None else row["sentences_per_s"])
            mine = row is not None and peer is not None and not system.startswith("ctranslate2")
            ratio = f"\n{row['sentences_per_s'] / peer['sentences_per_s']:.2f}x" if mine else ""  # type: ignore[index]
            texts.append("" if row is None else f"{row['sentences_per_s']:.0f}{ratio}")
        series[system], labels[system] = values, texts
    first = rows[0]
    title = title or f"Decoding, {first['cpu']} ({first.get('isa') or first['device']}), {first['threads']} threads"
    return bars([f"{d} beam {b}" for d, b in groups], series, labels, "sentences/s (x: ÷ CTranslate2)", title)


MODES = {"on": "batching on", "off": "batching off", "external": "--url server"}


def plot_serving(runs: dict[str, list[dict[str, Any]]], out: Path, title: str = "") -> Path:
    return _save(serving_figure(runs, title), out)


def serving_figure(runs: dict[str, list[dict[str, Any]]], title: str = "") -> Any:
    """Requests/s per client count, one bar per server: ``runs`` maps a name (a machine, a
    server) to its ``bench.load`` rows; a run with several batching modes gets a bar for each."""
    rows = [r for run in runs.values() for r in run]
    if not rows:
        raise ValueError("no bench.load rows to plot")
    levels = sorted({r["concurrency"] for r in rows})
    series: dict[str, list[float | None]] = {}
    labels: dict[str, list[str]] = {}
    for name, run in runs.items():
        modes = list(dict.fromkeys(r["batching"] for r in run))
        for mode in modes:
            by = {r["concurrency"]: r for r in run if r["batching"] == mode}
            key = " ".join(p for p in (name, MODES.get(mode, mode) if len(modes) > 1 or not name else "") if p)
            picked = [by.get(c) for c in levels]
            series[key] = [None if r is None else r["rps"] for r in picked]
            labels[key] = ["" if r is None else f"{r['rps']:.0f}\np99 {r['p99_ms']:.0f}" for r in picked]
    return bars([f"{c} clients" for c in levels], series, labels, "requests/s (p99 in ms)", title or "Serving")


def _save(fig: Any, out: Path) -> Path:
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    kind = argv.pop(0) if argv[:1] and argv[0] in ("load", "decode", "serving") else "load"
    command = sys.argv[0] if sys.argv[0].startswith("translator") else "python -m bench.plot"
    parser = argparse.ArgumentParser(
        prog=f"{command} {kind}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = "bench.decode" if kind == "decode" else "bench.load"
    parser.add_argument("results", type=Path, nargs="+", help=f"{source} output (JSON lines)")
    parser.add_argument("--labels", default="", help="serving: comma-separated names of the results files' bars")
    parser.add_argument("--out", type=Path, default=Path(f"docs/{kind}.png"))
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    lines = [line for file in args.results for line in file.read_text().splitlines()]
    if kind == "decode":
        path = plot_decode(json_rows(lines, {"system", "dtype", "beam_size", "sentences_per_s"}), args.out, args.title)
    elif kind == "serving":
        names = args.labels.split(",") if args.labels else [""] * len(args.results)
        if len(names) != len(args.results):
            parser.error(f"--labels names {len(names)} files, but {len(args.results)} were given")
        keys = {"concurrency", "batching", "rps", "p99_ms"}
        runs = {n: json_rows(f.read_text().splitlines(), keys) for n, f in zip(names, args.results, strict=True)}
        path = plot_serving(runs, args.out, args.title)
    else:
        path = plot(read_rows(lines), args.out, args.title or "Server latency against throughput")
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
