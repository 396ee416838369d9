"""The shipped models' repetition defaults (config.json decoding, chosen on val by
bench.repetition): out-of-domain text no longer comes back as a runaway loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.repetition import OUT_OF_DOMAIN, loops, plot, runaway
from model.engine import loading
from model.engine.translator import Translator
from tests.helpers import ROOT


def test_the_loop_criteria() -> None:
    assert runaway((5, 5, 5, 5, 5)) and not runaway((5, 5, 5, 5, 6))
    assert runaway((1, 2, 1, 2, 1, 2)) and not runaway((1, 2, 1, 2, 3))
    assert loops((1, 2, 1, 2)) and loops((7, 7, 7)) and not loops((1, 2, 3, 1, 2))


@pytest.mark.parametrize("name", ["en-de"])  # (bench.repetition measures the others: docs/decoding.md)
def test_out_of_domain_text_does_not_loop(name: str) -> None:
    ckpt = loading.load(ROOT / "weights" / name)
    options = loading.decoding_options(ckpt.meta)
    assert options.no_repeat_ngram_size == 4  # the card's default
    sources = [s for s, _ in OUT_OF_DOMAIN[:10]]  # (issue 74's two among them; bench.repetition runs all)
    translations = Translator(ckpt.model, ckpt.tokenizer).translate(sources, options)
    assert not [t.text for t in translations if runaway(t.hypotheses[0].pieces)]
    plain = loading.decoding_options({**ckpt.meta, "decoding": {**ckpt.meta["decoding"], "no_repeat_ngram_size": 0}})
    before = Translator(ckpt.model, ckpt.tokenizer).translate([s for s, _ in OUT_OF_DOMAIN[:2]], plain)
    if name == "en-de":  # issue 74's example, without the default
        assert runaway(before[0].hypotheses[0].pieces)


def test_the_many_to_many_model_does_not_loop_from_german() -> None:
    """The many-to-many model's card (its n-gram guard by direction): the out-of-domain set's
    German references, into French and Czech, come back without a runaway loop."""
    from model.network.tokenizer import target_prefix

    ckpt = loading.load(ROOT / "weights" / "many-to-many")
    german = [reference for _, reference in OUT_OF_DOMAIN]
    for target, guard in (("fr", 5), ("cs", 4)):
        options = loading.decoding_options(ckpt.meta, direction=f"de-{target}")
        assert options.no_repeat_ngram_size == guard
        translator = Translator(ckpt.model, ckpt.tokenizer, target_prefix(ckpt.tokenizer, target))
        looping = [t.text for t in translator.translate(german, options) if runaway(t.hypotheses[0].pieces)]
        assert not looping, target


def test_the_confidence_plot_gives_each_sets_bands(tmp_path: Path) -> None:
    """``--plot``: confidence against chrF drawn into an image, and each set's mean chrF per
    confidence band (what docs/decoding.md tabulates)."""
    rows = [
        {"set": "val", "confidence": 85, "chrf": 70.0},
        {"set": "val", "confidence": 95, "chrf": 80.0},
        {"set": "val", "confidence": 45, "chrf": 30.0},
        {"set": "out-of-domain", "confidence": 30, "chrf": 10.0},
    ]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = plot(source, tmp_path / "plot.png")
    assert figures == {
        "val": {"40-60": {"sentences": 1, "mean_chrf": 30.0}, "80-100": {"sentences": 2, "mean_chrf": 75.0}},
        "out-of-domain": {"0-40": {"sentences": 1, "mean_chrf": 10.0}},
    }
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
