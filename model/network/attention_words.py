"""Word-level attention: merge sentencepiece pieces into words and attention maps accordingly.

A word starts at a piece carrying the "▁" marker; pieces without it continue the word
before them. Special tokens (``<s>``, ``</s>``, ``<unk>``...) always stand alone.

Merging a map (..., Q, K) sums the keys of a word (the attention a query pays to the
whole word) and averages its queries (the attention pattern of the word as a whole), so
every row still sums to 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

MARKER = "▁"
CONTROL = frozenset(["<s>", "</s>", "<pad>"])  # pieces that are not words of the text
ArrayT = TypeVar("ArrayT", torch.Tensor, np.ndarray)


def is_special(piece: str) -> bool:
    """``<s>``, ``</s>``, ``<unk>``, ``<pad>``: control pieces that never join a word."""
    return len(piece) > 2 and piece.startswith("<") and piece.endswith(">")


def merge_pieces(tokens: Sequence[str]) -> tuple[list[str], list[list[int]]]:
    """Pieces -> (words, groups): ``groups[w]`` lists the piece indices that make word ``w``.

    ["▁Ein", "▁Fahr", "rad", ".", "</s>"] -> (["Ein", "Fahrrad.", "</s>"], [[0], [1, 2, 3], [4]])
    """
    words: list[str] = []
    groups: list[list[int]] = []
    joinable = False  # whether the last word may take a continuation piece
    for i, piece in enumerate(tokens):
        if is_special(piece):
            words.append(piece)
            groups.append([i])
            joinable = False
        elif piece.startswith(MARKER) or not joinable:
            words.append(piece.removeprefix(MARKER))
            groups.append([i])
            joinable = True
        else:
            words[-1] += piece
            groups[-1].append(i)
    # A bare "▁" piece followed by nothing it could join would leave an empty label.
    return [w or MARKER for w in words], groups


def _check_groups(groups: Sequence[Sequence[int]], size: int, axis: str) -> None:
    flat = sorted(i for g in groups for i in g)
    if any(not g for g in groups) or flat != list(range(size)):
        raise ValueError(f"{axis} groups must split 0..{size - 1} into non-empty groups, got {list(groups)}")


def query_matrix(groups: Sequence[Sequence[int]], size: int) -> np.ndarray:
    """(W, Q) averaging matrix: row w holds 1/len(group) at the group's pieces."""
    _check_groups(groups, size, "query")
    out = np.zeros((len(groups), size))
    for w, group in enumerate(groups):
        out[w, list(group)] = 1.0 / len(group)
    return out


def key_matrix(groups: Sequence[Sequence[int]], size: int) -> np.ndarray:
    """(K, W) summing matrix: column w holds 1 at the group's pieces."""
    _check_groups(groups, size, "key")
    out = np.zeros((size, len(groups)))
    for w, group in enumerate(groups):
        out[list(group), w] = 1.0
    return out


def merge_map(attn: ArrayT, query_groups: Sequence[Sequence[int]], key_groups: Sequence[Sequence[int]]) -> ArrayT:
    """(..., Q, K) -> (..., Wq, Wk): queries averaged, keys summed per group (tensor or array in, same out)."""
    queries, keys = attn.shape[-2], attn.shape[-1]
    avg, total = query_matrix(query_groups, queries), key_matrix(key_groups, keys)
    if isinstance(attn, torch.Tensor):
        avg_t = torch.as_tensor(avg, dtype=attn.dtype, device=attn.device)
        total_t = torch.as_tensor(total, dtype=attn.dtype, device=attn.device)
        return avg_t @ attn @ total_t
    return (avg.astype(attn.dtype) @ attn @ total.astype(attn.dtype)).astype(attn.dtype)


def word_alignment(cross: torch.Tensor, source: Sequence[str], target: Sequence[str]) -> list[int | None]:
    """Target word -> the source word it attends to most, from cross-attention averaged over
    layers and heads (end-of-sentence left out; ``None`` only when the source has no word).

    cross: (L, H, T, S) over ``target`` and ``source`` pieces (as ``AttentionResult`` has
    them); words as ``merge_pieces`` makes them, special pieces (``</s>``) left out on both
    sides, so index w is the w-th real word of each side.
    """
    _, source_groups = merge_pieces(source)
    _, target_groups = merge_pieces(target)
    words = merge_map(cross.float().mean(dim=(0, 1)), target_groups, source_groups)  # (Wt, Ws)
    real_source = [w for w, group in enumerate(source_groups) if source[group[0]] not in CONTROL]
    number = {w: n for n, w in enumerate(real_source)}
    links: list[int | None] = []
    for w, group in enumerate(target_groups):
        if target[group[0]] in CONTROL:
            continue
        row = words[w]
        best = max(real_source, key=lambda k: float(row[k]), default=None)
        links.append(None if best is None else number[best])
    return links
