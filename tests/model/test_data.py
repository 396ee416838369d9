"""Length bucketing: the one rule training, offline translation and the benchmarks batch by; padding."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from model.engine.batches import pad, token_batches
from model.training.data import make_batch, write_lines

LENGTHS = [5, 3, 9, 3, 7, 1, 12, 4]


def test_batches_cover_every_example_once_in_length_order_within_the_token_bound() -> None:
    batches = token_batches(LENGTHS, max_tokens=16)
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))
    flat = [i for b in batches for i in b]
    assert [LENGTHS[i] for i in flat] == sorted(LENGTHS)  # ties by index: 1 before 3
    assert flat[1:3] == [1, 3]
    for batch in batches:
        assert max(LENGTHS[i] for i in batch) * len(batch) <= 16 or len(batch) == 1
    assert batches[-1] == [6]  # 12 tokens: a batch of its own (12 x 2 > 16)


def test_pad_right_pads_to_the_longest_row() -> None:
    padded = pad([[5, 6, 7], [8], []], pad_id=9)
    assert padded.dtype == torch.long
    assert padded.tolist() == [[5, 6, 7], [8, 9, 9], [9, 9, 9]]
    assert pad([], 0).shape == (0, 0)


def test_make_batch_frames_targets_with_bos_and_eos() -> None:
    batch = make_batch([[10, 11], [12]], [[20], [21, 22, 23]], pad_id=0, bos_id=2, eos_id=3)
    assert batch.src.tolist() == [[10, 11, 3], [12, 3, 0]]
    assert batch.tgt_in.tolist() == [[2, 20, 0, 0], [2, 21, 22, 23]]
    assert batch.tgt_out.tolist() == [[20, 3, 0, 0], [21, 22, 23, 3]]
    assert batch.target_tokens == 6


def test_max_items_bounds_the_batch_size() -> None:
    batches = token_batches(LENGTHS, math.inf, max_items=3)
    assert [len(b) for b in batches] == [3, 3, 2]
    assert [LENGTHS[i] for i in batches[0]] == [1, 3, 3]


def test_shuffling_keeps_the_batches_but_not_their_order() -> None:
    lengths = list(range(1, 200))
    plain = token_batches(lengths, 400)
    shuffled = token_batches(lengths, 400, shuffle=True, seed=3)
    assert sorted(i for b in shuffled for i in b) == list(range(199))
    assert shuffled != plain
    assert token_batches(lengths, 400, shuffle=True, seed=3) == shuffled  # seeded


def test_write_lines_refuses_a_line_that_would_break_the_pairing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="newline"):
        write_lines(tmp_path / "x.txt", ["one", "two\nthree"])
    assert not (tmp_path / "x.txt").exists()
    write_lines(tmp_path / "x.txt", ["one", "", "two"])
    assert (tmp_path / "x.txt").read_text() == "one\n\ntwo\n"
