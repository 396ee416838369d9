"""The load benchmark against a real server process, and its latency/throughput plot."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bench.load import Connection, served_folder, server_timing
from bench.plot import decode_figure, plot, plot_decode, plot_serving, read_rows
from bench.plot import main as plot_main
from bench.stats import percentile
from bench.threads import listening_pid, sample
from tests.helpers import ROOT, free_port, running_server

pytestmark = pytest.mark.usefixtures("fused_kernels")

KEYS = {"concurrency", "batching", "requests", "rps", "p50_ms", "p95_ms", "p99_ms", "errors"}


def test_percentile_is_nearest_rank() -> None:
    values = [float(x) for x in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile(values, 99) == 99.0
    assert percentile([7.0], 99) == 7.0


def test_offline_decodes_with_the_model_that_serves_the_requests() -> None:
    """``--offline`` times the checkpoint the server answers de→en from, whatever folder sorts
    first (cs-en in the shipped weights, which it once took), and refuses a direction only a
    many-to-many model serves (``bench.decode`` gives no target tag: cs-en is one)."""
    assert served_folder(ROOT / "weights", "de", "en") == ROOT / "weights" / "de-en"
    assert served_folder(ROOT / "weights", "fr", "en") == ROOT / "weights" / "fr-en"
    for source, target in (("cs", "en"), ("cs", "fr")):
        with pytest.raises(SystemExit, match=f"{source}-{target}"):
            served_folder(ROOT / "weights", source, target)


def test_server_timing_header_parses() -> None:
    assert server_timing('parse;dur=0.31, decode;desc="x";dur=24.9, miss, bad;dur=x') == {"parse": 0.31, "decode": 24.9}
    assert server_timing("") == {}


@pytest.mark.slow
@pytest.mark.server
def test_url_measures_a_running_server_with_its_phases(tiny_weights_dir: Path, data_dir: Path) -> None:
    """--url drives a server that is already up (any LibreTranslate-compatible one); ours sends
    Server-Timing, so its rows carry each phase's median."""
    with running_server({"TRANSLATOR_WEIGHTS_DIR": str(tiny_weights_dir), "TRANSLATOR_CACHE_SIZE": "0"}) as url:
        cmd = [sys.executable, "-m", "bench.load", "--url", url, "--concurrency", "1,4", "--requests", "16"]
        cmd += ["--beam-size", "1", "--data", str(data_dir)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
        # bench.threads sees the server where /proc shows who listens and the kernel keeps schedstat
        pid = listening_pid(int(url.rsplit(":", 1)[1]))
        visible = pid is not None and sample(pid) is not None
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["batching"], r["concurrency"]) for r in rows] == [("external", 1), ("external", 4)]
    for row in rows:
        assert row["errors"] == 0 and row["rps"] > 0
        phases = row["phases_ms"]
        assert {"parse", "prepare", "queue", "encode", "decode", "handoff", "total"} <= set(phases)
        assert phases["decode"] > 0 and phases["total"] >= phases["decode"]
        # where the machine's CPU went: the clients here, the server from its own /metrics
        assert 0 < row["client_cores"] < 4 and 0 < row["server_cores"] < 4, row
        # and where each server thread's time went
        if not visible:
            assert row["server_threads"] is None
            continue
        threads = {t["thread"]: t for t in row["server_threads"]}
        assert len(threads) == len(row["server_threads"])  # one label a thread
        assert {"event loop", "model"} <= set(threads), threads
        assert threads["model"]["run"] > 0 and threads["model"]["cpu_ms_per_request"] > 0
        for t in threads.values():
            assert min(t["run"], t["runqueue"], t["sleep"]) >= 0
            assert t["run"] + t["runqueue"] + t["sleep"] == pytest.approx(1, abs=0.002), t


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.slow
@pytest.mark.server
def test_cli_prints_one_line_per_run_and_plots(tiny_weights_dir: Path, data_dir: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench.load", "--concurrency", "1,8", "--requests", "24", "--batching", "on,off"]
    cmd += ["--weights", str(tiny_weights_dir), "--beam-size", "1", "--port", str(free_port()), "--data", str(data_dir)]
    cmd += ["--offline"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["batching"], r["concurrency"]) for r in rows] == [("on", 1), ("on", 8), ("off", 1), ("off", 8)]
    for row in rows:
        assert set(row) >= KEYS, row
        assert row["requests"] == 24 and row["errors"] == 0
        assert row["rps"] > 0 and 0 < row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"]
        assert row["offline_sps"] > 0 and row["of_offline"] == round(row["rps"] / row["offline_sps"], 3)
        # timed on both sides of the round, the same two figures for every row of it
        before, after = row["offline_around"]
        assert row["offline_sps"] == round((before + after) / 2, 2)
        assert row["offline_around"] == rows[0]["offline_around"]

    log = tmp_path / "load.jsonl"
    log.write_text("some log line\n" + proc.stdout)
    assert read_rows(log.read_text().splitlines()) == rows
    out = plot(rows, tmp_path / "load.png")
    width, height = png_size(out)
    assert width > 400 and height > 300
    with pytest.raises(ValueError):
        plot([], tmp_path / "empty.png")


@pytest.mark.server
def test_connection_keeps_alive_and_reads_errors(tiny_weights_dir: Path) -> None:
    """The load generator's HTTP/1.1 client against a real server: replies, 4xx, reuse."""
    env = {"TRANSLATOR_WEIGHTS_DIR": str(tiny_weights_dir)}

    async def scenario(url: str) -> None:
        connection = Connection(url, timeout=60)
        status, reply = await connection.post_json("/translate", {"q": "Ein Hund.", "source": "de", "target": "en"})
        assert status == 200 and isinstance(json.loads(reply)["translatedText"], str)
        first = connection.writer
        status, reply = await connection.post_json("/translate", {"q": "", "source": "de", "target": "en"})
        assert status == 400 and "error" in json.loads(reply)
        status, _ = await connection.post_json("/translate", {"q": ["a", "b"], "source": "de", "target": "en"})
        assert status == 200
        assert connection.writer is first  # one connection for all three
        connection.close()

    with running_server(env) as url:
        asyncio.run(scenario(url))


@pytest.mark.slow
@pytest.mark.server
def test_rounds_report_each_rows_median_round(tiny_weights_dir: Path, data_dir: Path) -> None:
    cmd = [sys.executable, "-m", "bench.load", "--concurrency", "1,4", "--requests", "12", "--batching", "on"]
    cmd += ["--weights", str(tiny_weights_dir), "--beam-size", "1", "--port", str(free_port()), "--data", str(data_dir)]
    cmd += ["--rounds", "3", "--offline"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["batching"], r["concurrency"]) for r in rows] == [("on", 1), ("on", 4)]
    for row in rows:
        assert len(row["rounds_rps"]) == 3 and row["rps"] == sorted(row["rounds_rps"])[1]
        # each round set against the offline figures measured around it: the median round's own
        assert len(row["rounds_of_offline"]) == 3 and row["of_offline"] in row["rounds_of_offline"]
        assert row["of_offline"] == round(row["rps"] / row["offline_sps"], 3)
        assert len(row["rounds_offline_sps"]) == 3 and row["offline_sps"] in row["rounds_offline_sps"]
    # measured again each round, not once for all: three timings never agree to the last digit
    assert len(set(rows[0]["rounds_offline_sps"])) > 1


@pytest.mark.slow
@pytest.mark.server
def test_overload_bench_counts_rejections_and_retries_until_served(tiny_weights_dir: Path, data_dir: Path) -> None:
    """bench.overload: a queue of 2 against 16 clients rejects some requests (429), both kinds
    of client retry until all 48 are served, and the goodput ratio is printed."""
    cmd = [sys.executable, "-m", "bench.overload", "--clients", "16", "--queue-size", "2", "--requests", "48"]
    cmd += ["--weights", str(tiny_weights_dir), "--beam-size", "4", "--port", str(free_port()), "--data", str(data_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    polite, impatient, ratio = [json.loads(line) for line in proc.stdout.splitlines()]
    assert (polite["behaviour"], impatient["behaviour"]) == ("polite", "impatient")
    for row in (polite, impatient):
        assert row["errors"] == 0 and row["requests"] == 48 and row["goodput_rps"] > 0
    assert impatient["rejected"] > 0 and impatient["reject_p50_ms"] <= impatient["reject_p99_ms"]
    assert ratio["impatient_over_polite"] == round(impatient["goodput_rps"] / polite["goodput_rps"], 3)


DECODE_ROWS = [
    {"system": s, "dtype": d, "beam_size": b, "sentences_per_s": v, "cpu": "AMD EPYC", "isa": "avx2", "threads": 2,
     "device": "cpu"}
    for s, d, b, v in [("ours", "float32", 1, 150.0), ("ctranslate2", "float32", 1, 300.0),
                       ("ours", "int8", 4, 120.0), ("ctranslate2", "int8", 4, 100.0)]
]  # fmt: skip


def test_decode_chart_has_a_bar_per_system_and_setting_with_its_ratio(tmp_path: Path) -> None:
    assert plot_decode(DECODE_ROWS, tmp_path / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = decode_figure(DECODE_ROWS).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["float32 beam 1", "int8 beam 4"]
    heights = {c.get_label(): [round(b.get_height()) for b in c] for c in ax.containers}
    assert heights == {"ours": [150, 120], "ctranslate2": [300, 100]}
    texts = [t.get_text() for t in ax.texts]
    assert "150\n0.50x" in texts and "120\n1.20x" in texts and "300" in texts  # the peer has no ratio


def test_serving_chart_from_several_runs_and_the_command_line(tmp_path: Path) -> None:
    row = {"batching": "on", "requests": 10, "p50_ms": 10.0, "p95_ms": 20.0, "p99_ms": 30.0}
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("log line\n" + "\n".join(json.dumps({**row, "concurrency": c, "rps": c * 2.0}) for c in (1, 4)))
    second.write_text(json.dumps({**row, "batching": "external", "concurrency": 4, "rps": 5.0}))
    runs = {"A": read_rows(first.read_text().splitlines()), "B": read_rows(second.read_text().splitlines())}
    assert plot_serving(runs, tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "cli.png"
    plot_main(["serving", str(first), str(second), "--labels", "A,B", "--out", str(out)])
    assert out.is_file()
    with pytest.raises(SystemExit):
        plot_main(["serving", str(first), str(second), "--labels", "A", "--out", str(out)])
