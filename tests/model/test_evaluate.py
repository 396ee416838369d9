"""Quality regression: every shipped direction, scored by the evaluate command on test_2016."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sacrebleu

from model.engine import loading
from model.engine.features import detected
from model.engine.translator import Translator
from model.training.data import read_lines
from model.training.evaluate import evaluate, score_translations, translate_all
from tests.helpers import ROOT

# Lowercased BLEU of each shipped model on the first 100 sentences of test_2016 (greedy, then beam 5
# at the model card's length penalty), measured when it was shipped; a drop of 2.5 points fails.
# Keyed by weights folder and direction: every per-direction model, and the many-to-many model in each
# direction it serves (where its val score beats the per-direction model's: app.serving.service.assign_directions).
# Full-test scores: weights/<folder>/metrics.json and README.md.
FIRST_100 = {
    ("de-en", "de-en"): (39.52, 39.92),
    ("en-de", "en-de"): (39.71, 40.45),
    ("fr-en", "fr-en"): (53.27, 53.61),
    ("en-fr", "en-fr"): (58.08, 58.20),
    ("cs-en", "cs-en"): (38.36, 40.13),
    ("en-cs", "en-cs"): (32.99, 33.53),
    ("many-to-many", "cs-en"): (42.23, 41.78),
    ("many-to-many", "en-cs"): (33.70, 32.82),
    ("many-to-many", "de-fr"): (44.73, 43.68),
    ("many-to-many", "fr-de"): (34.96, 38.21),
    ("many-to-many", "de-cs"): (27.45, 28.66),
    ("many-to-many", "cs-de"): (31.83, 32.24),
    ("many-to-many", "fr-cs"): (30.87, 30.65),
    ("many-to-many", "cs-fr"): (41.39, 42.81),
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


def test_every_served_direction_has_a_floor() -> None:
    from app.serving.service import assign_directions, discover

    paths = discover(ROOT / "weights")
    served = {(path.name, f"{s}-{t}") for path, pairs in assign_directions(paths).items() for s, t in pairs or []}
    single = {(path.name, path.name) for path in paths if path.name != "many-to-many"}
    assert served | single == set(FIRST_100)


@functools.cache
def _translator(folder: str, target: str) -> tuple[Translator, dict[str, Any]]:
    """A shipped folder loaded once for every direction and beam it is scored at, as the evaluate
    command loads it (the card's shortlist, a many-to-many model's target tag); its command line
    is tested below, where one subprocess a test costs less."""
    ckpt = loading.load(ROOT / "weights" / folder)
    translator = Translator(ckpt.model, ckpt.tokenizer, ckpt.source_prefix(target), loading.use_shortlist(ckpt))
    return translator, ckpt.meta


@pytest.mark.slow
@pytest.mark.usefixtures("fused_kernels")
@pytest.mark.parametrize("beam", [1, 5])
@pytest.mark.parametrize(("folder", "direction"), sorted(FIRST_100))
def test_shipped_weights_score_above_the_floor(folder: str, direction: str, data_dir: Path, beam: int) -> None:
    source, target = direction.split("-")
    translator, meta = _translator(folder, target)
    src = read_lines(data_dir / f"test_2016_flickr.{source}.gz")[:100]
    ref = read_lines(data_dir / f"test_2016_flickr.{target}.gz")[:100]
    result = evaluate(translator, src, ref, loading.decoding_options(meta, beam, direction=direction))
    assert result["sentences"] == 100 and result["beam_size"] == beam
    assert result["bleu_lc"] >= FIRST_100[folder, direction][beam > 1] - ALLOWED_DROP, result
    assert result["bleu"] <= result["bleu_lc"] and result["chrf"] > 40


@pytest.mark.slow
@pytest.mark.isa
def test_int8_scores_within_0_3_bleu_of_float32(shipped: Path, data_dir: Path) -> None:
    """int8 (fbgemm, per-channel weights, dynamic activations) against float32 on all of test_2016, greedy."""

    if not detected().avx2:
        pytest.skip("int8 needs AVX2 (this CPU refuses it, as tests/model/test_kernels.py checks)")
    scores = {}
    for dtype in ("float32", "int8"):
        cmd = [sys.executable, "-m", "model.training.evaluate", "--weights", str(shipped), "--beam-size", "1"]
        cmd += ["--src", str(data_dir / "test_2016_flickr.de.gz"), "--ref", str(data_dir / "test_2016_flickr.en.gz")]
        cmd += ["--threads", "2", "--dtype", dtype]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        scores[dtype] = json.loads(proc.stdout.splitlines()[-1])
    assert scores["int8"]["kernel"] == "fbgemm-int8" and scores["float32"]["kernel"] in ("panels", "onednn", "aten")
    assert abs(scores["int8"]["bleu"] - scores["float32"]["bleu"]) <= 0.3, scores
    assert scores["int8"]["sentences"] == 1000


@pytest.mark.slow
def test_then_scores_a_pivot_through_the_first_checkpoints_output(data_dir: Path) -> None:
    """--then: de-en's output is en-fr's input; the score is that of chaining the two translators,
    each with its own card's settings, against the French references."""

    cmd = [sys.executable, "-m", "model.training.evaluate", "--weights", str(ROOT / "weights/de-en")]
    cmd += ["--then", str(ROOT / "weights/en-fr"), "--split", "test_2016_flickr", "--data-dir", str(data_dir)]
    cmd += ["--limit", "20", "--beam-size", "1", "--threads", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    text = read_lines(data_dir / "test_2016_flickr.de.gz")[:20]
    for direction in ("de-en", "en-fr"):
        ckpt = loading.load(ROOT / "weights" / direction)
        text = translate_all(Translator(ckpt.model, ckpt.tokenizer), text, loading.decoding_options(ckpt.meta, 1))
    expected = score_translations(text, read_lines(data_dir / "test_2016_flickr.fr.gz")[:20])
    assert result["sentences"] == 20 and result["bleu"] == expected["bleu"] > 20
    # legs that do not meet (de-en, then fr-en) are refused, naming both languages
    cmd[cmd.index("--then") + 1] = str(ROOT / "weights/fr-en")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "from fr" in proc.stderr and "into en" in proc.stderr


@pytest.mark.slow
def test_length_penalty_and_hypotheses_options(tmp_path: Path, data_dir: Path) -> None:
    """--length-penalty replaces the card's alpha; --hypotheses keeps the scored translations,
    which are those of the same decoding in process and score as printed."""
    import dataclasses

    ckpt = loading.load(ROOT / "weights/de-en")
    src = read_lines(data_dir / "val.de.gz")[:12]
    ref = read_lines(data_dir / "val.en.gz")[:12]
    for alpha in (0.0, 3.0):
        out = tmp_path / f"hyps-{alpha}.txt"
        cmd = [sys.executable, "-m", "model.training.evaluate", "--weights", str(ROOT / "weights/de-en")]
        cmd += ["--split", "val"]
        cmd += ["--data-dir", str(data_dir), "--limit", "12", "--beam-size", "3", "--threads", "1", "--no-shortlist"]
        cmd += ["--length-penalty", str(alpha), "--hypotheses", str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.splitlines()[-1])
        options = dataclasses.replace(loading.decoding_options(ckpt.meta, 3), length_penalty=alpha)
        expected = translate_all(Translator(ckpt.model, ckpt.tokenizer), src, options)
        assert result["length_penalty"] == alpha and read_lines(out) == expected
        assert result["bleu"] == score_translations(expected, ref)["bleu"]
    assert read_lines(tmp_path / "hyps-0.0.txt") != read_lines(tmp_path / "hyps-3.0.txt")  # the option is used
