"""Merging sentencepiece pieces into words, and attention maps with them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.network.attention_words import merge_map, merge_pieces, word_alignment

SOURCE = ["▁Ein", "▁Mann", "▁fährt", "▁Fahr", "rad", ".", "</s>"]
TARGET_INPUT = ["<s>", "▁A", "▁man", "▁ri", "des", "▁a", "▁bike", "."]


def test_continuation_pieces_join_the_previous_word() -> None:
    words, groups = merge_pieces(SOURCE)
    assert words == ["Ein", "Mann", "fährt", "Fahrrad.", "</s>"]
    assert groups == [[0], [1], [2], [3, 4, 5], [6]]


def test_special_tokens_stay_alone() -> None:
    words, groups = merge_pieces(TARGET_INPUT)
    assert words == ["<s>", "A", "man", "rides", "a", "bike."]
    assert groups == [[0], [1], [2], [3, 4], [5], [6, 7]]
    # A piece without the marker right after a special starts a word of its own.
    assert merge_pieces(["<s>", "rad", "</s>", "<unk>", "x"]) == (
        ["<s>", "rad", "</s>", "<unk>", "x"],
        [[0], [1], [2], [3], [4]],
    )


def test_bare_marker_joins_what_follows_and_never_leaves_an_empty_label() -> None:
    assert merge_pieces(["▁", "(", "▁x", "▁"]) == (["(", "x", "▁"], [[0, 1], [2], [3]])
    assert merge_pieces([]) == ([], [])


def random_maps(*shape: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.softmax(torch.randn(*shape), dim=-1)


def test_merged_map_has_word_shape_and_rows_sum_to_one() -> None:
    _, src_groups = merge_pieces(SOURCE)
    _, tgt_groups = merge_pieces(TARGET_INPUT)
    maps = random_maps(3, 4, len(TARGET_INPUT), len(SOURCE))  # (L, H, Q, K)
    merged = merge_map(maps, tgt_groups, src_groups)
    assert merged.shape == (3, 4, len(tgt_groups), len(src_groups))
    assert merged.dtype == maps.dtype
    torch.testing.assert_close(merged.sum(-1), torch.ones(3, 4, len(tgt_groups)))


def test_keys_are_summed_and_queries_averaged() -> None:
    maps = random_maps(len(SOURCE), len(SOURCE))
    _, groups = merge_pieces(SOURCE)
    merged = merge_map(maps, groups, groups)
    fahrrad = [3, 4, 5]
    # Query "Ein" (one piece) to key "Fahrrad." (three pieces): the sum over the pieces.
    assert float(merged[0, 3]) == pytest.approx(float(maps[0, fahrrad].sum()))
    # Query "Fahrrad." to key "Ein": the mean over its pieces' rows.
    assert float(merged[3, 0]) == pytest.approx(float(maps[fahrrad, 0].mean()))
    # Single-piece words are unchanged.
    assert float(merged[1, 2]) == pytest.approx(float(maps[1, 2]))


def test_numpy_arrays_work_too_and_identity_groups_change_nothing() -> None:
    maps = random_maps(2, 5, 6).numpy()
    _, groups = merge_pieces(SOURCE[:6])
    merged = merge_map(maps, [[i] for i in range(5)], groups)
    assert isinstance(merged, np.ndarray) and merged.shape == (2, 5, 4) and merged.dtype == maps.dtype
    np.testing.assert_allclose(merged.sum(-1), 1.0, rtol=1e-5)
    identity = [[i] for i in range(6)]
    np.testing.assert_allclose(merge_map(maps, [[i] for i in range(5)], identity), maps, rtol=1e-6)


@pytest.mark.parametrize("groups", [[[0], [1]], [[0, 1], [1, 2]], [[0], [], [1, 2]], [[0], [1, 2, 3]]])
def test_groups_must_split_the_axis_exactly(groups: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="groups"):
        merge_map(random_maps(3, 3), [[0], [1], [2]], groups)


def test_word_alignment_links_each_target_word_to_its_strongest_source_word() -> None:
    source = ["▁Ein", "▁Fahr", "rad", "</s>"]  # words: Ein, Fahrrad
    target = ["▁A", "▁bi", "cycle", "</s>"]  # words: A, bicycle
    cross = torch.zeros(2, 2, 4, 4)  # (L, H, T, S)
    cross[..., 0, 0] = 1.0  # A -> Ein
    cross[..., 1, 1] = 0.3  # bi -> Fahr + rad (0.6 for the word) ...
    cross[..., 1, 2] = 0.3
    cross[..., 1, 3] = 0.4  # ... although </s> is the strongest single piece
    cross[..., 2, 2] = 1.0
    cross[..., 3, 3] = 1.0  # </s> -> </s>: no word
    assert word_alignment(cross, source, target) == [0, 1]
