"""The shipped models' repetition defaults (config.json decoding, chosen on val by
bench.repetition): out-of-domain text no longer comes back as a runaway loop."""

from __future__ import annotations

import pytest

from bench.repetition import OUT_OF_DOMAIN, loops, runaway
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
