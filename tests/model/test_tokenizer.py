"""Sentencepiece wrapper: special ids, batch round trips, clear errors."""

from __future__ import annotations

import pytest

from model.network.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, TokenizerError


def test_special_ids_are_fixed(tiny_tokenizer: Tokenizer) -> None:
    sp = tiny_tokenizer.sp
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert tiny_tokenizer.vocab_size == 1000


def test_batch_round_trip_keeps_case_and_punctuation(tiny_tokenizer: Tokenizer) -> None:
    texts = ["Ein Mann fährt Fahrrad.", "Two dogs, one ball!"]
    ids = tiny_tokenizer.encode(texts)
    assert all(min(row) > EOS_ID for row in ids)  # no specials added
    assert tiny_tokenizer.decode(ids) == texts
    pieces = tiny_tokenizer.pieces(ids[0])
    assert pieces[0].startswith("▁") and "".join(pieces).replace("▁", " ").strip() == texts[0]


def test_joint_vocabulary_covers_both_languages(tiny_tokenizer: Tokenizer) -> None:
    de, en = tiny_tokenizer.encode(["Hund", "dog"])
    assert UNK_ID not in de + en


def test_bad_model_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.load(tmp_path / "missing.model")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError):
        Tokenizer.load(tmp_path / "bad.model")


def test_piece_spans_point_at_each_piece_in_the_text(tiny_tokenizer: Tokenizer) -> None:
    text = "Ein  Mann fährt über die Straße."  # two spaces, non-ASCII letters (2 bytes each)
    ids, spans = tiny_tokenizer.piece_spans(text)
    assert ids == tiny_tokenizer.encode([text])[0]
    pieces = tiny_tokenizer.pieces(ids)
    for piece, (start, end) in zip(pieces, spans, strict=True):
        assert text[start:end] == piece.removeprefix("▁")


def test_sampled_segmentations_vary_repeat_by_seed_and_decode_to_the_text(tiny_tokenizer: Tokenizer) -> None:
    texts = ["Ein kleiner Junge spielt im Wasser.", "Two young men are walking down the street."] * 20
    best = tiny_tokenizer.encode(texts)
    first = tiny_tokenizer.sample(texts, alpha=0.3, nbest=-1, seed=7)
    assert first == tiny_tokenizer.sample(texts, alpha=0.3, nbest=-1, seed=7)
    assert first != tiny_tokenizer.sample(texts, alpha=0.3, nbest=-1, seed=8)
    assert any(ids != b for ids, b in zip(first, best, strict=True))  # not the best segmentation every time
    assert len({tuple(ids) for ids in first[0::2]}) > 1  # one sentence, several segmentations
    assert tiny_tokenizer.decode(first) == tiny_tokenizer.decode(best) == texts
    # the best segmentation stays what encode gives, whatever was sampled before
    assert tiny_tokenizer.encode(texts) == best
