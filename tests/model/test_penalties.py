"""``repetition_penalty`` and ``no_repeat_ngram_size``: transformers' meaning on the logits, the
same tokens as its greedy ``generate``, the same on the fused kernels and the tensor operations,
greedy and beam, and no loop left in a random model's output (which loops by nature)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from model.engine import loading
from model.engine.batches import pad
from model.engine.options import DecodingOptions, Repetition
from model.engine.penalties import apply_penalties
from model.engine.translator import Translator
from model.training.data import read_lines
from tests.helpers import require

PAD, EOS, LIMIT = 300, 0, 16


def repeats_back_to_back(ids: tuple[int, ...], n: int) -> bool:
    """Whether some n-gram of ``ids`` is followed at once by itself."""
    return any(ids[i : i + n] == ids[i + n : i + 2 * n] for i in range(len(ids) - 2 * n + 1))


def test_penalties_are_transformers_processors() -> None:
    require(importlib.util.find_spec("transformers") is not None, "transformers is not installed (dev extra)")
    from transformers import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    history = torch.randint(0, 6, (16, 12), generator=g)  # few distinct pieces: many repeats
    logits = torch.randn(16, 50, generator=g)
    for penalty, n in ((1.3, 0), (1.0, 2), (1.0, 3), (2.0, 2)):
        ours = logits.clone()
        apply_penalties(
            ours, history, torch.full((16,), 12), DecodingOptions(repetition_penalty=penalty, no_repeat_ngram_size=n)
        )
        theirs = logits.clone()
        if penalty != 1.0:
            theirs = RepetitionPenaltyLogitsProcessor(penalty)(history, theirs)
        if n:
            theirs = NoRepeatNGramLogitsProcessor(n)(history, theirs)
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    shorter = logits.clone()  # rows read only their own length
    apply_penalties(shorter, history, torch.tensor([5] * 16), DecodingOptions(no_repeat_ngram_size=2))
    expected = NoRepeatNGramLogitsProcessor(2)(history[:, :5], logits.clone())
    torch.testing.assert_close(shorter, expected, atol=0, rtol=0)


@pytest.fixture(scope="module")
def sentences(data_dir: Path) -> list[str]:
    return read_lines(data_dir / "val.de.gz")[200:260]


def decode(imported: Path, sentences: list[str], options: DecodingOptions, fused: bool) -> list[tuple[int, ...]]:
    ckpt = loading.load(imported, fused=fused)
    hyps = Translator(ckpt.model, ckpt.tokenizer).decode_ids(ckpt.tokenizer.encode(sentences), options)
    return [h[0].ids for h in hyps]


def generated(marian: Any, ids: list[list[int]], **options: Any) -> list[tuple[int, ...]]:
    src = pad([[*row, EOS] for row in ids], PAD)
    with torch.inference_mode():
        rows = marian.generate(
            input_ids=src, attention_mask=src.ne(PAD).long(), max_new_tokens=LIMIT, num_beams=1, **options
        ).tolist()
    return [tuple(r[1 : r.index(EOS)] if EOS in r[1:] else [t for t in r[1:] if t != PAD]) for r in rows]


def test_greedy_is_generates_with_the_same_options(imported: Path, marian_dir: Path, sentences: list[str]) -> None:
    from transformers import MarianMTModel

    marian = MarianMTModel.from_pretrained(str(marian_dir)).eval()
    ckpt = loading.load(imported)
    ids = ckpt.tokenizer.encode(sentences[:40])
    for penalty, n in ((1.5, 0), (1.2, 2)):
        options = DecodingOptions(
            beam_size=1, max_length_a=0.0, max_length_b=LIMIT, repetition_penalty=penalty, no_repeat_ngram_size=n
        )
        ours = [h[0].ids for h in Translator(ckpt.model, ckpt.tokenizer).decode_ids(ids, options)]
        assert ours == generated(marian, ids, repetition_penalty=penalty, no_repeat_ngram_size=n)


@pytest.mark.parametrize("beam", [1, 4])
def test_no_loops_on_either_path(imported: Path, sentences: list[str], beam: int, fused_kernels: None) -> None:
    plain = DecodingOptions(beam_size=beam, max_length_a=0.0, max_length_b=LIMIT)
    looping = decode(imported, sentences, plain, fused=True)
    assert sum(repeats_back_to_back(row, 1) for row in looping) > len(looping) // 4  # the random model loops
    options = DecodingOptions(beam_size=beam, max_length_a=0.0, max_length_b=LIMIT, no_repeat_ngram_size=2,
                              repetition_penalty=1.2)  # fmt: skip
    fused, tensor = (decode(imported, sentences, options, fused=f) for f in (True, False))
    assert fused == tensor
    assert not any(repeats_back_to_back(row, n) for row in fused for n in (2, 3, 4))


def test_request_options_override_the_card() -> None:
    meta = {"model": {}, "decoding": {"beam_size": 4, "no_repeat_ngram_size": 3, "repetition_penalty": 1.1}}
    card = loading.decoding_options(meta)
    assert (card.no_repeat_ngram_size, card.repetition_penalty) == (3, 1.1)
    asked = loading.decoding_options(meta, repetition=Repetition(no_repeat_ngram_size=0))
    assert (asked.no_repeat_ngram_size, asked.repetition_penalty) == (0, 1.1)
    with pytest.raises(ValueError, match="repetition_penalty"):
        DecodingOptions(repetition_penalty=0.0)
