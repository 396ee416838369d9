"""Id lists into padded tensors and length-bucketed batches: the one batching rule of offline
translation, training and the benchmarks."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch


def pad(rows: Sequence[Sequence[int]], pad_id: int = 0) -> torch.Tensor:
    """Right-pad id lists into a (B, max_len) long tensor: the rows padded as Python lists, then
    one tensor (faster than torch's ``pad_sequence`` on a tensor per row, from one row to a
    training epoch's batches: docs/benchmarks/README.md#numbers-behind-the-code)."""
    if not rows:
        return torch.zeros(0, 0, dtype=torch.long)
    width = max(map(len, rows))
    return torch.tensor([[*row, *[pad_id] * (width - len(row))] for row in rows], dtype=torch.long)


def token_batches(
    lengths: Sequence[int], max_tokens: float, shuffle: bool = False, seed: int = 0, max_items: int | None = None
) -> list[list[int]]:
    """Group example indices into batches of at most ``max_tokens`` padded tokens (and at most
    ``max_items`` examples): the one length-bucketing rule of training, offline translation
    and the benchmarks.

    Examples are sorted by length (ties: by index, or randomly when shuffling) so a batch
    holds similar lengths and little padding; with ``shuffle`` the batch order is then
    shuffled. ``lengths[i]`` is the padded cost of example i (e.g. max of source/target length).
    An example longer than ``max_tokens`` gets a batch of its own.
    """
    rng = random.Random(seed)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random() if shuffle else i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        full = max_items is not None and len(current) >= max_items
        if current and (full or longest_if_added * (len(current) + 1) > max_tokens):
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    return batches
