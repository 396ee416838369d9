"""Quality regression: every shipped direction, scored by the evaluate command on test_2016."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu

from model.evaluate import score_translations
from tests.helpers import ROOT

# Lowercased BLEU of each shipped model on the first 100 sentences of test_2016 (greedy, then beam 5
# at the model card's length penalty), measured when it was shipped; a drop of 2.5 points fails.
# Full-test scores: weights/<direction>/metrics.json and README.md.
FIRST_100 = {
    "de-en": (39.52, 39.92),
    "en-de": (37.78, 39.25),
    "fr-en": (53.27, 53.61),
    "en-fr": (59.83, 60.11),
    "cs-en": (38.36, 40.13),
    "en-cs": (32.99, 33.53),
}
ALLOWED_DROP = 2.5


def test_scores_are_sacrebleu_corpus_scores() -> None:
    refs = ["A man rides a bike.", "Two dogs play in the snow."]
    perfect = score_translations(refs, refs)
    signatures = perfect.pop("signatures")
    assert perfect == {"bleu": 100.0, "bleu_lc": 100.0, "chrf": 100.0}
    version = f"version:{sacrebleu.__version__}"
    assert signatures["bleu"] == f"nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|{version}"
    assert "case:lc" in signatures["bleu_lc"] and signatures["chrf"].startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0")
    lower = score_translations([r.lower() for r in refs], refs)
    assert lower["bleu_lc"] == 100.0 and lower["bleu"] < 100.0
    with pytest.raises(ValueError):
        score_translations(refs[:1], refs)


def test_every_shipped_direction_has_a_floor() -> None:
    shipped = {p.name for p in (ROOT / "weights").iterdir() if (p / "config.json").is_file()}
    assert shipped == set(FIRST_100)


@pytest.mark.slow
@pytest.mark.parametrize("beam", [1, 5])
@pytest.mark.parametrize("direction", sorted(FIRST_100))
def test_shipped_weights_score_above_the_floor(direction: str, data_dir: Path, beam: int) -> None:
    source, target = direction.split("-")
    cmd = [sys.executable, "-m", "model.evaluate", "--weights", str(ROOT / "weights" / direction), "--limit", "100"]
    cmd += ["--src", str(data_dir / f"test_2016_flickr.{source}.gz")]
    cmd += ["--ref", str(data_dir / f"test_2016_flickr.{target}.gz")]
    cmd += ["--beam-size", str(beam), "--threads", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout  # exactly one JSON line
    result = json.loads(lines[0])
    assert set(result) >= {"bleu", "bleu_lc", "chrf", "sentences", "seconds"}
    assert result["sentences"] == 100 and result["seconds"] > 0
    assert result["bleu_lc"] >= FIRST_100[direction][beam > 1] - ALLOWED_DROP, result
    assert result["bleu"] <= result["bleu_lc"] and result["chrf"] > 40


@pytest.mark.slow
def test_int8_scores_within_0_3_bleu_of_float32(shipped: Path, data_dir: Path) -> None:
    """int8 (fbgemm, per-channel weights, dynamic activations) against float32 on all of test_2016, greedy."""
    from model import kernels

    if not kernels.detected().avx2:
        pytest.skip("int8 needs AVX2 (this CPU refuses it, as tests/model/test_kernels.py checks)")
    scores = {}
    for dtype in ("float32", "int8"):
        cmd = [sys.executable, "-m", "model.evaluate", "--weights", str(shipped), "--beam-size", "1"]
        cmd += ["--src", str(data_dir / "test_2016_flickr.de.gz"), "--ref", str(data_dir / "test_2016_flickr.en.gz")]
        cmd += ["--threads", "2", "--dtype", dtype]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        scores[dtype] = json.loads(proc.stdout.splitlines()[-1])
    assert scores["int8"]["kernel"] == "fbgemm-int8" and scores["float32"]["kernel"] in ("onednn", "aten")
    assert abs(scores["int8"]["bleu"] - scores["float32"]["bleu"]) <= 0.3, scores
    assert scores["int8"]["sentences"] == 1000
