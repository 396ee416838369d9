"""bench.compile_step times a functional twin of the decoder step, eager and under torch.compile:
the twin computes the network's own logits, and the compiled twin the eager one's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.compile_step import StaticCache, functional_step
from tests.factories import random_model
from tests.helpers import ROOT, require


@pytest.mark.parametrize(
    "overrides",
    [{}, {"norm_first": True}, {"positions": "learned"}],
    ids=["post-LN", "pre-LN", "learned-positions"],
)
def test_the_twin_step_computes_the_networks_teacher_forced_logits(overrides: dict[str, object]) -> None:
    model = random_model(60, **overrides)
    src = torch.tensor([[5, 9, 17, 23, 3]])  # EOS-ended
    tokens = torch.tensor([[2, 7, 11, 30, 41, 12]])  # BOS first
    with torch.inference_mode():
        memory, mask, _ = model.encode(src)
        reference, _, _ = model.decode(tokens, memory, mask)
        twin = StaticCache(model, memory, 1, slots=8).run(functional_step(model), tokens)
        assert twin.shape == reference.shape
        torch.testing.assert_close(twin, reference, atol=1e-4, rtol=1e-4)
        # rows are independent: the same tokens in 3 rows give the same logits in each
        rows = StaticCache(model, memory, 3, slots=8).run(functional_step(model), tokens.expand(3, -1))
        torch.testing.assert_close(rows, reference.expand(3, -1, -1), atol=1e-4, rtol=1e-4)


@pytest.mark.compile
def test_cli_reports_eager_compiled_and_engine_times_per_row_count(tiny_weights_dir: Path) -> None:
    require(shutil.which("c++") is not None or shutil.which("g++") is not None, "torch.compile needs a C++ compiler")
    cmd = [sys.executable, "-m", "bench.compile_step", "--weights", str(tiny_weights_dir / "de-en")]
    cmd += ["--rows", "1,2", "--steps", "3", "--reps", "1", "--threads", "1", "--slots", "8"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["rows"] for r in rows] == [1, 2]
    for row in rows:
        assert all(row[k] > 0 for k in ("eager_ms", "compiled_ms", "eager_again_ms", "engine_ms"))
        assert row["eager_vs_model_max_diff"] < 1e-4 and row["compiled_vs_eager_max_diff"] < 1e-4
