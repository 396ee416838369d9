"""bench/batching.py: static against continuous batching, on the shipped weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import batching


def test_three_modes_decode_the_same_sentence_steps(
    shipped: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--weights", str(shipped), "--data-dir", str(data_dir), "--limit", "48", "--batch", "8"]
    batching.main([*args, "--repeat", "1", "--threads", "1", "--join-group", "1"])
    rows = {row["mode"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    assert list(rows) == ["static-sorted", "static-arrival", "continuous"]
    for row in rows.values():
        assert row["sentences"] == 48 and row["seconds"] > 0 and row["beam_size"] == 4
        assert row["vocabulary"] == "shortlist"  # the shipped weights' shortlist, as the service decodes
    # each sentence takes the steps it takes alone, however it is batched ...
    assert len({row["sentence_steps"] for row in rows.values()}) == 1
    # ... but a batch that is topped up stays fuller, so it needs fewer steps than static ones
    assert rows["continuous"]["steps"] < rows["static-arrival"]["steps"]
    assert rows["continuous"]["mean_active"] > rows["static-arrival"]["mean_active"]
    assert rows["continuous"]["mean_active"] <= 8


def test_no_shortlist_decodes_the_whole_vocabulary(
    shipped: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--weights", str(shipped), "--data-dir", str(data_dir), "--limit", "8", "--batch", "4"]
    batching.main([*args, "--repeat", "1", "--threads", "1", "--modes", "continuous", "--no-shortlist"])
    (row,) = map(json.loads, capsys.readouterr().out.splitlines())
    assert row["vocabulary"] == "full" and row["sentences"] == 8


def test_a_continuous_batch_takes_joiners_in_groups(
    shipped: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--join-group``: sentences join once the batch has room for that many, so there are fewer
    admissions than with a place filled at every step, and the batch is less full between them."""
    args = ["--weights", str(shipped), "--data-dir", str(data_dir), "--limit", "48", "--batch", "8"]
    rows = []
    for group in ("1", "4"):
        batching.main([*args, "--repeat", "1", "--threads", "1", "--modes", "continuous", "--join-group", group])
        (row,) = map(json.loads, capsys.readouterr().out.splitlines())
        rows.append(row)
    one, four = rows
    assert (one["join_group"], four["join_group"]) == (1, 4)
    assert one["sentence_steps"] == four["sentence_steps"]  # the same sentences, decoded as alone
    assert four["admissions"] < one["admissions"]
    assert four["mean_active"] < one["mean_active"] <= 8
