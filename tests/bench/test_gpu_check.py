"""bench/gpu_check.sh on the CPU (docs/gpu.md): every stage of the GPU check runs and writes its
lines and the summary lists them, so the command that waits for a lent GPU cannot rot. One run of
the kit (two sentences, the two decode cells of ``QUICK``, the tiny training), shared by the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import gpu_check
from tests.helpers import ROOT

pytestmark = [pytest.mark.server, pytest.mark.train, pytest.mark.usefixtures("fused_kernels")]

KINDS = {  # the result lines each stage writes
    "environment": {"environment"},
    "tests": {"pytest"},
    "serve": {"info", "metric", "translate", "attention"},
    "decode": {"decode"},
    "train": {"train"},
}


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("gpu-check")
    args = ["--device", "cpu", "--sentences", "2", "--languages", "de,en", "--repeat", "1", "--quick"]
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), str(out), *args, "--data", str(data_dir)],
        env={**os.environ, "PYTHON": sys.executable},
        check=False,
    )
    return out, proc.returncode


def results(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_every_stage_runs_and_writes_its_lines(kit: tuple[Path, int]) -> None:
    out, returncode = kit
    lines = results(out)
    stages = [line for line in lines if line["kind"] == "stage"]
    assert [s["stage"] for s in stages] == list(gpu_check.SHARES)
    assert [s["status"] for s in stages] == ["ok"] * len(stages), (out / "log.txt").read_text()[-4000:]
    assert returncode == 0
    for stage, kinds in KINDS.items():
        assert {line["kind"] for line in lines if line["stage"] == stage} == kinds | {"stage"}, stage
    assert all(line["ok"] for line in lines if "ok" in line)


def test_each_stage_says_what_it_found_on_the_cpu(kit: tuple[Path, int]) -> None:
    by_kind = {line["kind"]: line for line in results(kit[0])}
    tests = by_kind["pytest"]
    assert tests["skipped"] > 0 and tests["passed"] == tests["failed"] == tests["errors"] == 0  # no CUDA here
    assert by_kind["info"]["devices"] == by_kind["metric"]["devices"] == ["cpu"]
    assert by_kind["translate"]["sentences"] == 2 and by_kind["translate"]["bleu"] > 0
    assert by_kind["attention"]["shape"][2:] and by_kind["train"]["epochs"] == 1
    decoded = [line for line in results(kit[0]) if line["kind"] == "decode"]
    assert sorted(line["system"] for line in decoded) == ["marian", "marian", "ours", "ours"]
    for field, values in (("dtype", {"float32", "bfloat16"}), ("beam_size", {1, 4}), ("batch_size", {64, 1})):
        assert {line[field] for line in decoded} == values


def test_the_summary_lists_every_stage_in_four_files(kit: tuple[Path, int]) -> None:
    out = kit[0]
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "results.jsonl", "summary.json", "summary.md"]
    summary = json.loads((out / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == list(gpu_check.SHARES) and summary["failed"] == []
    markdown, log = (out / "summary.md").read_text(), (out / "log.txt").read_text()
    for stage in gpu_check.SHARES:
        assert f"| {stage} | ok |" in markdown and f"===== {stage} (" in log
    assert "| ours | bfloat16 | 1 | 64 |" in markdown


def test_a_stage_with_a_result_not_ok_fails_and_one_past_its_deadline_is_stopped(tmp_path: Path) -> None:
    missing = gpu_check.Kit(tmp_path, "cpu", "cpu", tmp_path / "no-data", 2, "", 1, "tiny", 60.0, True)
    argv = ["--out", str(tmp_path), "--device", "cpu", "--data", str(missing.data)]
    with (tmp_path / "log.txt").open("w") as log:
        run, lines = gpu_check.run_child("environment", missing, argv, 60.0, log)
        assert run.status == "failed" and lines[0]["ok"] is False  # no test_2016 files in that folder
        run, lines = gpu_check.run_child("tests", missing, argv, 0.5, log)
    assert (run.status, run.returncode, lines) == ("timeout", None, [])
