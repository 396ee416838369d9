"""The KV cache for incremental decoding.

Self-attention keys/values live in buffers preallocated for the whole decode and grow one
step at a time; cross-attention keys/values are computed once per batch from the encoder
memory. ``reorder`` follows beam search's back-pointers; ``select`` drops finished rows.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One decoder layer's cached tensors.

    self_k/self_v: (B, H, capacity, Dh) buffers, the first ``length`` positions valid.
    cross_k/cross_v: (B, H, S, Dh) projections of the encoder memory.
    """

    def __init__(self, cross_kv: tuple[torch.Tensor, torch.Tensor], capacity: int) -> None:
        self.cross_k, self.cross_v = cross_kv
        b, h, _, dh = self.cross_k.shape
        shape = (b, h, capacity, dh)
        self.self_k = self.cross_k.new_empty(shape)
        self.self_v = self.cross_v.new_empty(shape)
        self.length = 0

    @property
    def cross_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cross_k, self.cross_v

    def append_self(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (B, H, T, Dh) new positions -> all cached K, V (B, H, length+T, Dh)."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.self_k.shape[2]:
            raise ValueError(f"KV cache capacity {self.self_k.shape[2]} exceeded ({end})")
        self.self_k[:, :, start:end] = k
        self.self_v[:, :, start:end] = v
        self.length = end
        return self.self_k[:, :, :end], self.self_v[:, :, :end]

    def reorder(self, indices: torch.Tensor) -> None:
        """Reorder the self-attention rows (beam back-pointers); indices: (B,) long."""
        n = self.length
        self.self_k[:, :, :n] = self.self_k[indices, :, :n]
        self.self_v[:, :, :n] = self.self_v[indices, :, :n]

    def select(self, indices: torch.Tensor) -> None:
        """Keep only the given rows of every tensor (the batch shrinks to len(indices))."""
        self.self_k = self.self_k.index_select(0, indices)
        self.self_v = self.self_v.index_select(0, indices)
        self.cross_k = self.cross_k.index_select(0, indices)
        self.cross_v = self.cross_v.index_select(0, indices)


class KVCache:
    """Cache for every decoder layer, passed explicitly through the decoder."""

    def __init__(self, layers: list[LayerCache]) -> None:
        self.layers = layers

    @property
    def length(self) -> int:
        """Number of target positions already decoded."""
        return self.layers[0].length if self.layers else 0

    @property
    def batch_size(self) -> int:
        return self.layers[0].self_k.shape[0]

    def reorder(self, indices: torch.Tensor) -> None:
        """Beam back-pointers: row i takes the history of row indices[i]."""
        for layer in self.layers:
            layer.reorder(indices)

    def select(self, indices: torch.Tensor) -> None:
        """Drop the rows not in ``indices`` (finished sentences)."""
        for layer in self.layers:
            layer.select(indices)
