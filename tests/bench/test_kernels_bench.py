"""bench.kernels prints per-call times of every kernel this CPU can run, for every decoder shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from model.engine import fused, kernels
from model.engine.features import detected, fused_variant
from tests.helpers import ROOT, require

pytestmark = pytest.mark.compile


def runnable() -> set[str]:
    """The kernels this CPU runs: F.linear and W·xᵀ everywhere; with AVX2 oneDNN (where torch has
    it), fbgemm's int8 and, with FMA, the fused kernels' panels and int8 product (where they build: a failure
    in CI)."""
    names = {"aten", "wx"}
    if detected().avx2:
        names |= {"fbgemm-int8"} | ({"onednn"} if torch.backends.mkldnn.is_available() else set())
        if detected().fma:
            require(fused.load(fused_variant(detected())) is not None, "the fused kernels do not build")
            names.add("panels")
            names.add("int8-panels")
    return names


def test_one_line_per_shape_and_row_count_with_each_runnable_kernel() -> None:
    cmd = [sys.executable, "-m", "bench.kernels", "--rows", "1,4", "--calls", "3", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["out"], r["in"], r["rows"]) for r in rows] == [(o, i, n) for o, i in
                                                                ((768, 256), (256, 256), (1024, 256), (256, 1024),
                                                                 (8000, 256)) for n in (1, 4)]  # fmt: skip
    expected = {f"{name}_us" for name in runnable()}
    for row in rows:
        assert {k for k in row if k.endswith("_us")} == expected and all(row[k] > 0 for k in expected)
        assert row["isa"] == detected().isa


def test_step_mode_times_a_decoder_steps_matrices_per_kernel() -> None:
    cmd = [sys.executable, "-m", "bench.kernels", "--step", "--rows", "1,4", "--calls", "2", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["matrices"], r["rows"]) for r in rows] == [(19, 1), (19, 4)]
    expected = {"planned_ms"} | {f"{name}_ms" for name in runnable()}
    for row in rows:
        assert {k for k in row if k.endswith("_ms")} == expected and all(row[k] > 0 for k in expected)
        assert row["planned"] == kernels.choose("cpu", "float32").describe()
