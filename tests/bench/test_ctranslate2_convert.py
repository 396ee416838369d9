"""CTranslate2 conversion: the converted model decodes exactly what ours decodes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ctranslate2
import pytest

from bench.ctranslate2_convert import convert, main
from model import checkpoint
from model.engine import loading
from model.engine.decoding import Hypothesis
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.network.tokenizer import Tokenizer
from model.training.data import read_lines
from tests.factories import random_model

LIMIT = 20  # generated tokens, EOS included, for every sentence
VARIANTS: dict[str, dict[str, Any]] = {
    # post-LN, shared embeddings, sinusoidal positions (the shipped architecture)
    "post-ln": {},
    # the EOS row scaled so that some sentences end early and others hit the limit
    "post-ln-eos": {"eos_scale": 12.0},
    # every other switch: pre-LN (final norms), separate output matrix, learned positions
    "pre-ln-untied-learned": {"norm_first": True, "share_embeddings": False, "positions": "learned"},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Tokenizer
) -> tuple[Translator, ctranslate2.Translator]:
    """Our translator and the CTranslate2 conversion of the same random checkpoint."""
    model = random_model(tiny_tokenizer.vocab_size, **VARIANTS[request.param])
    root = tmp_path_factory.mktemp(request.param)
    checkpoint.save(root / "ckpt", model, tiny_tokenizer)
    out = convert(root / "ckpt", root / "ct2")
    ct2 = ctranslate2.Translator(str(out), device="cpu", inter_threads=1, intra_threads=1)
    return Translator(model, tiny_tokenizer), ct2


@pytest.fixture(scope="module")
def sources(data_dir: Path) -> list[str]:
    return read_lines(data_dir / "test_2016_flickr.de.gz")[:12]


def decode_both(
    pair: tuple[Translator, ctranslate2.Translator], sources: list[str], beam: int
) -> tuple[list[Hypothesis], list[tuple[tuple[int, ...], float]]]:
    ours, ct2 = pair
    tokenizer = ours.tokenizer
    ids = tokenizer.encode(sources)
    options = DecodingOptions(beam_size=beam, length_penalty=0.0, max_length_a=0.0, max_length_b=LIMIT)
    mine = [hyps[0] for hyps in ours.decode_ids(ids, options)]
    results = ct2.translate_batch(
        [tokenizer.pieces(x) for x in ids],
        beam_size=beam,
        length_penalty=0.0,
        max_decoding_length=LIMIT,
        min_decoding_length=0,
        return_scores=True,
    )
    theirs = [(tuple(tokenizer.sp.piece_to_id(p) for p in r.hypotheses[0]), r.scores[0]) for r in results]
    return mine, theirs


@pytest.mark.parametrize("beam", [1, 4])
def test_same_tokens_and_scores_as_ours(
    pair: tuple[Translator, ctranslate2.Translator], sources: list[str], beam: int
) -> None:
    mine, theirs = decode_both(pair, sources, beam)
    assert [h.ids for h in mine] == [ids for ids, _ in theirs]
    for hyp, (_, score) in zip(mine, theirs, strict=True):
        assert score == pytest.approx(hyp.log_prob, abs=1e-3)  # alpha 0: the score is log P


def test_eos_variant_mixes_finished_and_truncated(tiny_tokenizer: Tokenizer, sources: list[str]) -> None:
    """Guards the "post-ln-eos" variant: it must exercise both ways a hypothesis ends."""
    model = random_model(tiny_tokenizer.vocab_size, **VARIANTS["post-ln-eos"])
    options = DecodingOptions(beam_size=1, length_penalty=0.0, max_length_a=0.0, max_length_b=LIMIT)
    hyps = [h[0] for h in Translator(model, tiny_tokenizer).decode_ids(tiny_tokenizer.encode(sources), options)]
    assert {h.finished for h in hyps} == {True, False}


def test_cli_writes_a_self_describing_int8_model(
    tmp_path: Path, tiny_weights_dir: Path, sources: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    main(["--weights", str(tiny_weights_dir / "de-en"), "--out", str(tmp_path / "ct2"), "--quantization", "int8"])
    config = json.loads((tmp_path / "ct2" / "config.json").read_text())
    assert (config["unk_token"], config["bos_token"], config["eos_token"]) == ("<unk>", "<s>", "</s>")
    assert config["decoder_start_token"] == "<s>"
    assert config["add_source_eos"] is True and config["add_source_bos"] is False
    assert config["layer_norm_epsilon"] == pytest.approx(1e-5)
    vocab = json.loads((tmp_path / "ct2" / "shared_vocabulary.json").read_text())
    assert vocab[:4] == ["<pad>", "<unk>", "<s>", "</s>"]
    with pytest.raises(FileExistsError, match="--force"):
        main(["--weights", str(tiny_weights_dir / "de-en"), "--out", str(tmp_path / "ct2")])
    ct2 = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    tokenizer = loading.load(tiny_weights_dir / "de-en").tokenizer
    results = ct2.translate_batch([tokenizer.sp.encode(s, out_type=str) for s in sources[:2]], max_decoding_length=8)
    assert all(1 <= len(r.hypotheses[0]) <= 8 for r in results)
