"""model.training.distill: a shipped model's translations of a training file, one per line, in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.engine import loading
from model.engine.translator import Translator
from model.training import distill
from model.training.data import read_lines


def test_distill_writes_the_models_translations_line_by_line(
    tmp_path: Path, shipped: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "nested" / "train.de-en.en.gz"
    distill.main(["--weights", str(shipped), "--src", str(data_dir / "val.de.gz"), "--out", str(out),
                  "--limit", "6", "--beam-size", "2"])  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert summary["direction"] == "de-en" and summary["sentences"] == 6 and summary["beam_size"] == 2
    lines = read_lines(out)
    ckpt = loading.load(shipped)
    options = loading.decoding_options(ckpt.meta, 2)
    expected = Translator(ckpt.model, ckpt.tokenizer).translate(read_lines(data_dir / "val.de.gz")[:6], options)
    assert lines == [t.text for t in expected]
    assert all(lines) and not list(out.parent.glob("*.tmp"))
