"""Attention masks.

Convention (the same as ``scaled_dot_product_attention``'s boolean ``attn_mask``):
a mask is a bool tensor broadcastable to ``(batch, heads, queries, keys)`` where
**True means "this query may attend to this key"** and False means "blocked".
"""

from __future__ import annotations

import torch


def padding_mask(ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Keys that are real tokens.

    ids: (B, S) token ids  ->  (B, 1, 1, S) bool, True where ``ids != pad_id``.
    """
    return (ids != pad_id)[:, None, None, :]


def causal_mask(length: int, device: torch.device | None = None) -> torch.Tensor:
    """Each query sees itself and earlier positions.

    -> (1, 1, T, T) bool, True on and below the diagonal.
    """
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]


def fill_blocked(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Set blocked scores to the dtype's minimum so softmax gives them zero weight."""
    if mask is None:
        return scores
    return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
