"""bench.opus_shape: an OPUS-MT-shaped random checkpoint (a widened vocabulary, swish or ReLU)
runs through bench.decode on our engine and CTranslate2 with the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.opus_shape import opus_shaped, widened
from model.network.tokenizer import Tokenizer
from tests.helpers import ROOT, SHIPPED


def test_widened_tokenizer_cuts_text_as_before() -> None:
    shipped = Tokenizer.load(SHIPPED / "spm.model")
    wide = widened(shipped, 9000)
    assert wide.vocab_size == 9000
    text = ["Ein Mann fährt mit dem Fahrrad über eine Brücke."]
    assert wide.encode(text) == shipped.encode(text)


@pytest.mark.parametrize("activation", ["swish"])
def test_bench_decode_runs_an_opus_shaped_model(tmp_path: Path, data_dir: Path, activation: str) -> None:
    folder = opus_shaped(tmp_path / "opus", vocab=9000, activation=activation, d_model=32, n_heads=4,
                         encoder_layers=1, decoder_layers=1, d_ff=64)  # fmt: skip
    cmd = [sys.executable, "-m", "bench.decode", "--weights", str(folder), "--systems", "ours,ctranslate2",
           "--limit", "4", "--repeat", "1", "--warmup", "0", "--no-isolate", "--data-dir", str(data_dir)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["system"] for r in rows] == ["ours", "ctranslate2"]
    assert len({r["bleu"] for r in rows}) == 1  # greedy, the same weights: the same translations
