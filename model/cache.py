"""The KV cache for incremental decoding.

Self-attention keys/values live in preallocated buffers and grow one step at a time.
Cross-attention keys/values are computed once per sentence from the encoder memory and
stored once per *sentence*: with beam search the ``width`` consecutive rows of a sentence
(its hypotheses) share them, so they are never copied per beam. Sentences joining a running
batch are written behind the others, and sentences leaving it are replaced by ones moved
from the back, so only the rows that change are copied (copying the whole memory every
time a sentence joined or left cost a continuously fed batch 3-5% of its throughput).

``reorder(rows)`` follows beam search's back-pointers, drops finished rows, forgets
positions no row can see any more and makes room for sentences that join, all in one copy:
each self-attention buffer has a twin, and the valid part is gathered straight into the
twin (``index_select(..., out=)``), which measured ~6x faster than gathering into a
temporary and copying it back.
"""

from __future__ import annotations

import torch

SPARE_SLOTS = 16  # positions a grown self-attention buffer has beyond what the reorder needs


class LayerCache:
    """One decoder layer's cached tensors.

    self_k/self_v: (R, H, length, Dh), R live rows, laid out as (R, H, slots, Dh) at the
    front of flat buffers that grow when a reorder needs more. ``slots`` is the capacity at
    first; ``reorder(rows, room=1)``, which beam search calls every step, lays the copy out
    with ``slots = length + 1``, so after the next append the cached K/V are one contiguous
    block: the attention matmuls over strided K/V ran 1.6-2.7x slower on the CPU.
    cross_k/cross_v: (B, H, S, Dh) projections of the encoder memory, R = B * width rows.
    """

    def __init__(self, cross_kv: tuple[torch.Tensor, torch.Tensor], capacity: int) -> None:
        """Room for ``capacity`` positions of B rows (one per sentence); ``reorder`` may widen
        it to B * width rows (beam search after its first step), growing the buffers then."""
        self._cross_k, self._cross_v = cross_kv  # (rows, H, columns, Dh) buffers, front in use
        b, h, s, dh = self._cross_k.shape
        self.sentences, self.source = b, s
        # Room for the first rows only: the twins are allocated by the first reorder, at the
        # size it needs (beam search compacts to length + 1 every step), so memory follows
        # what the batch holds, not B * width * capacity for every layer up front.
        size = b * h * capacity * dh
        self._k = [self._cross_k.new_empty(size), self._cross_k.new_empty(0)]
        self._v = [self._cross_v.new_empty(size), self._cross_v.new_empty(0)]
        self._current = 0
        self.heads, self.head_dim, self.capacity = h, dh, capacity
        self.rows = b
        self.slots = capacity
        self.length = 0

    def _layout(self, flat: torch.Tensor, rows: int, slots: int) -> torch.Tensor:
        """(rows, H, slots, Dh) view of the front of a flat buffer."""
        return flat[: rows * self.heads * slots * self.head_dim].view(rows, self.heads, slots, self.head_dim)

    @property
    def self_k(self) -> torch.Tensor:
        """(R, H, length, Dh) cached keys."""
        return self._layout(self._k[self._current], self.rows, self.slots)[:, :, : self.length]

    @property
    def self_v(self) -> torch.Tensor:
        """(R, H, length, Dh) cached values."""
        return self._layout(self._v[self._current], self.rows, self.slots)[:, :, : self.length]

    @property
    def cross_k(self) -> torch.Tensor:
        """(B, H, S, Dh) keys of the encoder memory (a view: rows of other strides are fine for
        the attention's batched matmuls)."""
        return self._cross_k[: self.sentences, :, : self.source]

    @property
    def cross_v(self) -> torch.Tensor:
        """(B, H, S, Dh) values of the encoder memory."""
        return self._cross_v[: self.sentences, :, : self.source]

    @property
    def cross_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cross_k, self.cross_v

    def append_self(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (R, H, T, Dh) new positions -> all cached K, V (R, H, length+T, Dh)."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} exceeded ({end})")
        if end > self.slots:  # a compact layout is full: spread it out to the whole capacity
            self.reorder(torch.arange(self.rows, device=k.device))
        self._layout(self._k[self._current], self.rows, self.slots)[:, :, start:end] = k
        self._layout(self._v[self._current], self.rows, self.slots)[:, :, start:end] = v
        self.length = end
        return self.self_k, self.self_v

    def reorder(self, rows: torch.Tensor, room: int | None = None, drop: int = 0, add: int = 0) -> None:
        """Row i takes the self-attention history of row ``rows[i]``; rows: (R',) long (rows
        may be dropped, or repeated to widen a beam). Then ``add`` rows follow with an all-zero
        history (sentences joining; their attention masks it out), and the first ``drop``
        positions are forgotten. The copy has room for ``room`` more positions before the next
        reorder (None: up to the capacity); the buffers grow if that does not fit."""
        kept, new, twin = rows.numel(), self.length - drop, 1 - self._current
        n = kept + add
        slots = max(self.capacity, new) if room is None else new + room
        needed = n * self.heads * slots * self.head_dim
        for buffers in (self._k, self._v):
            if buffers[twin].numel() < needed:  # with SPARE_SLOTS more, so beam search (one more slot
                spare = n * self.heads * SPARE_SLOTS * self.head_dim  # per step) reallocates rarely
                buffers[twin] = buffers[twin].new_empty(needed + spare)
            source = self._layout(buffers[self._current], self.rows, self.slots)[:, :, drop : self.length]
            target = self._layout(buffers[twin], n, slots)[:, :, :new]
            torch.index_select(source, 0, rows, out=target[:kept])
            if add:
                target[kept:].zero_()
        self._current, self.rows, self.slots, self.length = twin, n, slots, new
        self.capacity = max(self.capacity, slots)

    def extend_memory(self, cross_kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Sentences join: their cross K/V (B', H, S', Dh) are written behind the current ones.

        Source positions past a sentence's own length hold whatever was there (finite values:
        buffers start zeroed and only ever receive projections); the source mask hides them,
        and a hidden key's weight is exactly 0.
        """
        new_k, new_v = cross_kv
        b, s = new_k.shape[0], new_k.shape[2]
        rows, columns = self.sentences + b, max(self.source, s)
        if rows > self._cross_k.shape[0] or columns > self._cross_k.shape[2]:  # grow, with room
            have_rows, have_columns = self._cross_k.shape[0], self._cross_k.shape[2]
            size = (max(rows, 2 * have_rows), self.heads, max(columns, have_columns), self.head_dim)
            for name in ("_cross_k", "_cross_v"):
                old = getattr(self, name)
                grown = old.new_zeros(size)
                grown[: self.sentences, :, : old.shape[2]] = old[: self.sentences]
                setattr(self, name, grown)
        self._cross_k[self.sentences : rows, :, :s] = new_k
        self._cross_v[self.sentences : rows, :, :s] = new_v
        self.sentences, self.source = rows, columns

    def select_memory(self, sentences: list[int], length: int | None = None) -> None:
        """Sentence i takes the cross K/V of sentence ``sentences[i]`` (B' of them); only rows
        that change are copied, so an order that fills the gaps of leaving sentences with the
        last ones moves few. ``length``: keep only that many source positions (None: all)."""
        moved = [(i, j) for i, j in enumerate(sentences) if i != j]
        if moved:
            targets, sources = (torch.tensor(side, device=self._cross_k.device) for side in zip(*moved, strict=True))
            for buffer in (self._cross_k, self._cross_v):
                buffer[targets] = buffer[sources]
        self.sentences = len(sentences)
        if length is not None:
            self.source = length


class KVCache:
    """Cache for every decoder layer, passed explicitly through the decoder."""

    def __init__(self, layers: list[LayerCache]) -> None:
        self.layers = layers

    @property
    def length(self) -> int:
        """Number of target positions held."""
        return self.layers[0].length if self.layers else 0

    @property
    def batch_size(self) -> int:
        """Live rows (sentences x hypotheses)."""
        return self.layers[0].rows

    def reorder(self, rows: torch.Tensor, room: int | None = None, drop: int = 0, add: int = 0) -> None:
        """Beam back-pointers, dropped and added rows, forgotten positions (see ``LayerCache.reorder``)."""
        for layer in self.layers:
            layer.reorder(rows, room, drop, add)

    def extend_memory(self, cross_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Sentences join: one (K, V) pair per layer, each (B', H, S', Dh)."""
        for layer, kv in zip(self.layers, cross_kv, strict=True):
            layer.extend_memory(kv)

    def select_memory(self, sentences: list[int], length: int | None = None) -> None:
        """Sentence i takes the encoder memory of ``sentences[i]``; the others (finished) are
        dropped, and source positions from ``length`` on (see ``LayerCache.select_memory``)."""
        for layer in self.layers:
            layer.select_memory(sentences, length)
