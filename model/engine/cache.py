"""The KV cache for incremental decoding: two halves with different lives.

``SelfAttentionCache`` holds the decoder's own keys/values: one row per hypothesis (sentences
x beam width), one more position every step, and beam search's back-pointers reorder the rows
every step. They live in preallocated buffers. ``reorder(rows)`` follows the back-pointers,
drops finished rows, forgets positions no row can see any more and makes room for sentences
that join, all in one copy: the valid part is gathered straight into a spare buffer
(``index_select(..., out=)``, one copy instead of a gather into a temporary and a copy back:
docs/benchmarks/README.md#numbers-behind-the-code), and the buffer it came from becomes the
spare. The buffers of every layer's keys and values are the same size and are reordered one
after the other, so one ``Spare`` serves them all: 2L + 1 buffers for L layers, not a twin each.
On the fused kernels the copy is left to the next step (``defer``): each layer's self-attention
kernel copies a head's history right before it reads it, so the cache passes through the memory
system once a step, not once for the copy and again for the attention (2L + 2 buffers then: a
layer's keys and values are copied together).

``CrossAttentionCache`` holds the projections of the encoder memory: computed once per
sentence when it joins and stored once per *sentence*: the ``width`` consecutive rows of a
sentence (its hypotheses) share them, so they are never copied per beam or reordered.
Sentences joining a running batch are written behind the others, and sentences leaving it
are replaced by ones moved from the back, so only the rows that change are copied (copying
the whole memory every time a sentence joined or left cost a continuously fed batch
part of its throughput: docs/benchmarks/README.md#numbers-behind-the-code).

``LayerCache`` is one decoder layer's pair and ``KVCache`` every layer's; the invariants
that tie the halves together (self rows = sentences x width) are checked there, on host ints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from model.engine.allocator import zeroed_pages
from model.network.transformer import Transformer

# (src_k, src_v, rows, dst_k, dst_v, first): the fused kernels' ``gather_rows_`` (see ``SelfAttentionCache.reorder``)
Gather = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
_ALL_POSITIONS = torch.empty(0, dtype=torch.long)  # ``gather_rows_``'s ``first``: every row copies every position

SPARE_SLOTS = 16  # positions a new beam-search buffer has beyond what its reorder needs
FIRST_SLOTS = 16  # positions laid out at first; a full layout is spread to twice its slots


def _buffer(like: torch.Tensor, numel: int) -> torch.Tensor:
    """A flat buffer of ``numel`` zeros in ``like``'s dtype and device: on the CPU, large ones
    on pages of their own that go back to the OS when the cache drops them
    (``allocator.zeroed_pages``), not left behind as free heap when the next one is bigger."""
    if like.device.type == "cpu":
        return zeroed_pages(numel, like.dtype)
    return like.new_zeros(numel)


class Spare:
    """The spare flat buffers that the self-attention buffers of a cache reorder into in turn:
    each gather takes one and hands back the buffer it gathered from (one spare in all). A
    reorder left to the step (``SelfAttentionCache.reorder``'s ``defer``) takes two before it hands
    back its own, since its keys and values are copied together (2L + 2 buffers for L layers),
    and is registered here: the deferred copies of a cache's layers form a chain (each layer's
    targets are the buffers the layer before it reads from), so they run in layer order
    (``settle``)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._deferred: list[SelfAttentionCache] = []  # layers with a copy left to the step, in order

    @property
    def held(self) -> list[torch.Tensor]:
        """The spare buffers now."""
        return list(self._buffers)

    def take(self, like: torch.Tensor, needed: int, extra: int) -> torch.Tensor:
        """A flat buffer of at least ``needed`` elements (a spare, or a new one of ``needed +
        extra`` when the spare is smaller), in ``like``'s dtype and device."""
        buffer = self._buffers.pop() if self._buffers else None
        if buffer is None or buffer.numel() < needed:
            buffer = _buffer(like, needed + extra)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """``buffer`` is free: it is a spare now (every ``take`` is followed by one ``give``)."""
        self._buffers.append(buffer)

    def defer(self, cache: SelfAttentionCache) -> None:
        """``cache`` has a copy left to the step: it runs after those registered before it."""
        self._deferred.append(cache)

    def settle(self, through: SelfAttentionCache | None = None) -> None:
        """Run the deferred copies in order, up to and including ``through``'s (None: all)."""
        while self._deferred:
            cache = self._deferred.pop(0)
            cache._copy_deferred()
            if cache is through:
                return

    def release(self, cache: SelfAttentionCache) -> None:
        """``cache``'s copy is handed to the step's kernel: the copies before it run first."""
        while self._deferred[0] is not cache:
            self._deferred.pop(0)._copy_deferred()
        self._deferred.pop(0)


# Moves (target row, source row) that a compaction copies one row at a time; more go through one
# indexed copy: a row copy is one small ATen call, while an indexed copy has a fixed cost per
# buffer however few rows it moves (docs/benchmarks/README.md#kv-cache).
FEW_MOVES = 8


def moves_of(order: Sequence[int]) -> list[tuple[int, int]]:
    """The (target, source) row moves that give row i the contents of row ``order[i]``: only
    where they differ (a compaction's order keeps most rows where they are)."""
    return [(i, j) for i, j in enumerate(order) if i != j]


def move_rows(buffer: torch.Tensor, moves: list[tuple[int, int]]) -> None:
    """Row ``target`` of ``buffer`` (first dimension) takes row ``source``, for each (target,
    source) in ``moves``; no target is another move's source (a compaction's gaps take rows from
    behind the kept ones), so the order does not matter."""
    if len(moves) <= FEW_MOVES:
        for target, source in moves:
            buffer[target].copy_(buffer[source])
        return
    targets, sources = (torch.tensor(side, device=buffer.device) for side in zip(*moves, strict=True))
    buffer[targets] = buffer[sources]


class SelfAttentionCache:
    """One decoder layer's self-attention keys/values: k, v (R, H, length, Dh).

    Invariant: every one of the R rows (a hypothesis) holds the same ``length`` positions,
    ``length <= slots <= capacity``, and the rows are laid out as (R, H, slots, Dh) at the
    front of a flat buffer each for K and V; a reorder gathers them into the ``spare`` (shared
    with the other layers of a ``KVCache``), which grows when the reorder needs more.
    ``capacity`` is the most positions a row may hold (the longest length limit of the rows'
    sentences); ``slots`` what is laid out: ``FIRST_SLOTS`` at first, doubled (up to the
    capacity) when an append finds the layout full, so memory follows the lengths decoded, not
    the limits. ``reorder(rows, room=1)``, which beam search calls every step, lays the copy out
    with ``slots = length + 1``, so after the next append the cached K/V are one contiguous
    block: the attention matmuls over strided K/V ran markedly slower on the CPU
    (docs/benchmarks/README.md#numbers-behind-the-code).
    """

    def __init__(
        self, like: torch.Tensor, rows: int, heads: int, head_dim: int, capacity: int, spare: Spare | None = None
    ) -> None:
        """Room for up to ``capacity`` positions of ``rows`` rows, in ``like``'s dtype and device;
        ``spare``: the buffer reorders gather into (shared by a ``KVCache``'s layers; None: its own)."""
        # Room for the first rows only: a reorder takes the spare at the size it needs (beam
        # search compacts to length + 1 every step), so memory follows what the batch holds,
        # not B * width * capacity for every layer up front.
        slots = min(capacity, FIRST_SLOTS)
        size = rows * heads * slots * head_dim
        self._k, self._v = _buffer(like, size), _buffer(like, size)  # flat
        self._spare = spare if spare is not None else Spare()
        self.heads, self.head_dim, self.capacity = heads, head_dim, capacity
        self.rows, self.slots, self.length = rows, slots, 0
        # a reorder's copy left to the step (``reorder``'s ``defer``): (gather, src_k, src_v, rows,
        # first, positions), run by the step's attention or by ``_flush`` before anything reads
        self._deferred: tuple[Gather, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
        self._lay_out()

    def _layout(self, flat: torch.Tensor, rows: int, slots: int) -> torch.Tensor:
        """(rows, H, slots, Dh) view of the front of a flat buffer (one ATen call: beam search
        lays out every layer's keys and values anew at every step)."""
        dh = self.head_dim
        return flat.as_strided((rows, self.heads, slots, dh), (self.heads * slots * dh, slots * dh, dh, 1))

    def _lay_out(self, k4: torch.Tensor | None = None, v4: torch.Tensor | None = None) -> None:
        """Views of the current buffers, made once per layout (a step reads them as they are):
        (R, H, slots, Dh) (``k4``, ``v4``: already made by the caller); the same with rows and
        heads merged, (R*H, slots, Dh), when ``flat`` first asks for them (the tensor
        operations' path; the fused kernels read the 4-d views)."""
        self._k4 = self._layout(self._k, self.rows, self.slots) if k4 is None else k4
        self._v4 = self._layout(self._v, self.rows, self.slots) if v4 is None else v4
        self._merged: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def k(self) -> torch.Tensor:
        """(R, H, length, Dh) cached keys."""
        self._flush()
        return self._k4[:, :, : self.length]

    @property
    def v(self) -> torch.Tensor:
        """(R, H, length, Dh) cached values."""
        self._flush()
        return self._v4[:, :, : self.length]

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached keys and values with rows and heads merged, (R*H, length, Dh) each (views)."""
        self._flush()
        if self._merged is None:
            merged = (self.rows * self.heads, self.slots, self.head_dim)
            self._merged = (self._k4.view(merged), self._v4.view(merged))
        k3, v3 = self._merged
        return k3[:, : self.length], v3[:, : self.length]

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (R, H, T, Dh) new positions, stored after the cached ones."""
        self._flush()
        start, end = self.length, self.length + k.shape[2]
        self._make_room(end)
        self._k4[:, :, start:end].copy_(k)
        self._v4[:, :, start:end].copy_(v)
        self.length = end

    def next_slot(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For a kernel that writes one new position itself (``model.engine.fused``): the (R, H, slots,
        Dh) K and V buffers, with room at the returned position, which ``length`` counts from now."""
        position = self.length
        self._make_room(position + 1)
        self.length = position + 1
        return self._k4, self._v4, position

    def take_deferred(self) -> list[torch.Tensor]:
        """For the step's self-attention kernel (``model.engine.fused``'s ``self_attend``, after
        ``next_slot``): the reorder it is to do first, [src_k, src_v, rows, first], its copy
        then no longer this cache's to run; [] when none is pending."""
        if self._deferred is None:
            return []
        _, src_k, src_v, rows, first, _ = self._deferred
        self._spare.release(self)
        self._deferred = None
        return [src_k, src_v, rows, first]

    def _flush(self) -> None:
        """Run the pending reorder copy (and those of the layers before it) before the cache is read."""
        if self._deferred is not None:
            self._spare.settle(self)

    def _copy_deferred(self) -> None:
        """The pending reorder copy, into the layout it was laid out for (``Spare.settle``)."""
        assert self._deferred is not None
        gather, src_k, src_v, rows, first, positions = self._deferred
        self._deferred = None
        gather(src_k, src_v, rows, self._k4[:, :, :positions], self._v4[:, :, :positions], first)

    def compact(self, moves: list[tuple[int, int]], rows: int, capacity: int | None = None) -> None:
        """Rows leave in place: row ``target`` takes row ``source``'s positions for each move, then
        only the first ``rows`` rows stay (the layout keeps its slots; no gather into the spare).
        What a greedy batch needs when sentences finish: ``reorder`` with those rows gathered
        would copy every row that stays. ``capacity``: as ``reorder``'s."""
        assert rows <= self.rows and all(t < rows <= s for t, s in moves), (rows, self.rows, moves)
        self._flush()
        held = self.length
        for laid_out in (self._k4, self._v4):
            move_rows(laid_out[:, :, :held], moves)
        if capacity is not None:
            self.capacity = max(capacity, self.slots)
        self.rows = rows
        self._lay_out()

    def _make_room(self, end: int) -> None:
        """Room for ``end`` positions in the layout (spread out as ``reorder`` grows it)."""
        if end > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} exceeded ({end})")
        if end > self.slots:  # the layout is full: spread it out (``reorder``'s growth)
            start = self.length
            self.reorder(torch.arange(self.rows, device=self._k.device), self._grown(start, end) - start)

    def _grown(self, held: int, needed: int) -> int:
        """Slots of a grown layout: twice the positions held, at least ``FIRST_SLOTS`` (and
        ``needed``), at most the capacity."""
        return max(needed, min(self.capacity, max(2 * held, FIRST_SLOTS)))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (R, H, T, Dh) new positions -> all cached K, V (R, H, length+T, Dh)."""
        self.write(k, v)
        return self.k, self.v

    def reorder(
        self,
        rows: torch.Tensor,
        room: int | None = None,
        drop: int = 0,
        add: int = 0,
        capacity: int | None = None,
        gather: Gather | None = None,
        first: torch.Tensor | None = None,
        defer: bool = False,
    ) -> None:
        """Row i takes the history of row ``rows[i]``; rows: (R',) long (rows may be dropped,
        or repeated to widen a beam). Then ``add`` rows follow with an all-zero history
        (sentences joining; their attention masks it out), and the first ``drop`` positions are
        forgotten. The copy has room for ``room`` more positions before the next reorder (None:
        grown, twice the positions kept, at least ``FIRST_SLOTS`` and one more, at most the
        capacity); the buffers grow if that does not fit. ``capacity``: the most positions a
        row may hold from now on (counted after the drop; None: as before). ``gather``: the
        fused kernels' copy of keys then values in one call (``model.engine.fused``); None: torch's.
        ``first`` (n,) with ``gather``: row i's positions before ``first[i]`` (counted after the
        drop) are left as they are, neither copied nor zeroed: for a caller whose attention never
        reads a row's positions from before its sentence joined (the fused kernels' with their
        mask), so a reorder copies each row's own positions, not the oldest row's. ``defer`` (with
        ``gather``): the copy is left to the step's self-attention kernel, which does it head by
        head right before it reads the head (``take_deferred``): the keys and values pass through
        the memory system once a step instead of twice; anything else that reads the cache
        first runs it (``_flush``)."""
        assert 0 <= drop <= self.length, (drop, self.length)
        defer = defer and gather is not None
        # a copy now writes into spares that pending copies may still read from: those run first
        if defer:
            self._flush()
        else:
            self._spare.settle()
        kept, new = rows.numel(), self.length - drop
        n = kept + add
        if capacity is not None:
            self.capacity = capacity
        slots = new + room if room is not None else self._grown(new, new + 1)
        needed = n * self.heads * slots * self.head_dim
        # Beam search compacts to one more slot every step (room 1), and a greedy batch that
        # sentences join lays out twice its positions at each join: either needs a little more
        # than the spare holds at almost every step. A new buffer for them gets SPARE_SLOTS more,
        # so it is reallocated (and its fresh pages faulted in) every few steps, not at every one.
        # A grown layout without joiners (a greedy batch on its own) has its room in its slots.
        extra = n * self.heads * SPARE_SLOTS * self.head_dim if room == 1 or add else 0
        # keys gather into the spare, and the keys' buffer is the spare the values gather into;
        # a deferred copy reads both sources while it writes, so it takes two spares
        into_k = self._spare.take(self._k, needed, extra)
        if defer:
            into_v = self._spare.take(self._v, needed, extra)
            self._spare.give(self._k)
        else:
            self._spare.give(self._k)
            into_v = self._spare.take(self._v, needed, extra)
        self._spare.give(self._v)
        whole = drop == 0 and self.length == self.slots
        sources = [laid_out if whole else laid_out[:, :, drop : self.length] for laid_out in (self._k4, self._v4)]
        k4, v4 = self._layout(into_k, n, slots), self._layout(into_v, n, slots)  # (n, H, slots, Dh): the next layout
        targets = [layout if new == slots else layout[:, :, :new] for layout in (k4, v4)]
        copied = _ALL_POSITIONS if first is None else first
        if defer:
            assert gather is not None
            self._deferred = (gather, sources[0], sources[1], rows, copied, new)
            self._spare.defer(self)
        elif gather is not None:
            gather(sources[0], sources[1], rows, targets[0], targets[1], copied)
        else:
            for source, target in zip(sources, targets, strict=True):
                torch.index_select(source, 0, rows, out=target[:kept] if add else target)
                if add:
                    target[kept:].zero_()
        self._k, self._v = into_k, into_v
        self.rows, self.slots, self.length = n, slots, new
        self.capacity = max(self.capacity, slots)
        self._lay_out(k4, v4)


class CrossAttentionCache:
    """One decoder layer's cross-attention keys/values: k, v (B, H, S, Dh), one per sentence.

    Invariant: sentence b's K/V are row b, read by all of its hypotheses (never copied per
    beam, never reordered); S (``source``) is at least every sentence's source length, and
    positions past a sentence's own length hold finite values (buffers start zeroed and only
    ever receive projections) that the source mask hides: a hidden key's weight is exactly 0.
    The rows and columns in use are the front of buffers that grow with room to spare.
    """

    def __init__(self, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._k, self._v = kv  # (rows, H, columns, Dh) buffers, front in use
        self.sentences, self.source = self._k.shape[0], self._k.shape[2]
        self._lay_out()

    def _lay_out(self) -> None:
        """Views of the part in use, made when it changes (a step reads them as they are)."""
        self.k = self._k[: self.sentences, :, : self.source]  # (B, H, S, Dh) keys of the memory
        self.v = self._v[: self.sentences, :, : self.source]  # (B, H, S, Dh) values
        b, h, s, dh = self.k.shape
        self.flat = (self.k.view(b * h, s, dh), self.v.view(b * h, s, dh))  # (B*H, S, Dh) each, views

    def extend(self, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Sentences join: their K/V (B', H, S', Dh) are written behind the current ones."""
        new_k, new_v = kv
        b, s = new_k.shape[0], new_k.shape[2]
        rows, columns = self.sentences + b, max(self.source, s)
        if rows > self._k.shape[0] or columns > self._k.shape[2]:  # grow, with room
            have_rows, have_columns = self._k.shape[0], self._k.shape[2]
            heads, head_dim = self._k.shape[1], self._k.shape[3]
            size = (max(rows, 2 * have_rows), heads, max(columns, have_columns), head_dim)
            for name in ("_k", "_v"):
                old = getattr(self, name)
                grown = _buffer(old, math.prod(size)).view(size)
                grown[: self.sentences, :, : old.shape[2]] = old[: self.sentences]
                setattr(self, name, grown)
        self._k[self.sentences : rows, :, :s] = new_k
        self._v[self.sentences : rows, :, :s] = new_v
        self.sentences, self.source = rows, columns
        self._lay_out()

    def select(self, sentences: list[int], length: int | None = None) -> None:
        """Sentence i takes the K/V of sentence ``sentences[i]`` (B' of them); only rows that
        change are copied, so an order that fills the gaps of leaving sentences with the last
        ones moves few. ``length``: keep only that many source positions (None: all); the
        caller passes the longest source still active, which keeps the invariant."""
        assert length is None or length <= self.source, (length, self.source)
        moved = moves_of(sentences)
        if moved:
            for buffer in (self._k, self._v):
                move_rows(buffer, moved)
        self.sentences = len(sentences)
        if length is not None:
            self.source = length
        self._lay_out()


class LayerCache:
    """One decoder layer's cache: its self-attention half (R = B * width rows, see
    ``SelfAttentionCache``) and its cross-attention half (B sentences, ``CrossAttentionCache``)."""

    def __init__(self, cross_kv: tuple[torch.Tensor, torch.Tensor], capacity: int, spare: Spare | None = None) -> None:
        """cross_kv: (B, H, S, Dh) each; room for ``capacity`` positions of B rows (one per
        sentence); a reorder may widen it to B * width rows (beam search after its first step).
        ``spare``: the reorder buffer shared with the cache's other layers (None: its own)."""
        b, h, _, dh = cross_kv[0].shape
        self.cross_attention = CrossAttentionCache(cross_kv)
        self.self_attention = SelfAttentionCache(cross_kv[0], b, h, dh, capacity, spare)

    @property
    def cross_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, S, Dh) cross-attention keys and values."""
        return self.cross_attention.k, self.cross_attention.v

    def append_self(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (R, H, T, Dh) new positions -> all cached self-attention K, V (R, H, length+T, Dh)."""
        return self.self_attention.append(k, v)


class KVCache:
    """Cache for every decoder layer, passed explicitly through the decoder."""

    def __init__(self, layers: list[LayerCache]) -> None:
        self.layers = layers

    @property
    def length(self) -> int:
        """Number of target positions held."""
        return self.layers[0].self_attention.length if self.layers else 0

    @property
    def batch_size(self) -> int:
        """Live self-attention rows (sentences x hypotheses)."""
        return self.layers[0].self_attention.rows

    @property
    def sentences(self) -> int:
        """Sentences whose cross-attention K/V are held."""
        return self.layers[0].cross_attention.sentences

    @property
    def source_length(self) -> int:
        """Source positions of the cross-attention K/V (>= every sentence's source length)."""
        return self.layers[0].cross_attention.source

    def reorder(
        self,
        rows: torch.Tensor,
        room: int | None = None,
        drop: int = 0,
        add: int = 0,
        capacity: int | None = None,
        *,
        width: int,
        gather: Gather | None = None,
        first: torch.Tensor | None = None,
        defer: bool = False,
    ) -> None:
        """Self-attention rows: beam back-pointers, dropped and added rows, forgotten positions,
        the most positions a row may hold, the copy (see ``SelfAttentionCache.reorder``), after which each
        of the cross-attention sentences has ``width`` consecutive rows (sentences that joined
        since the last reorder included: they are the ``add`` rows). ``first``: positions each
        row may leave uncopied (see ``SelfAttentionCache.reorder``); ``defer``: each layer's copy
        left to its attention in the next step (the same)."""
        assert rows.numel() + add == self.sentences * width, (rows.numel(), add, self.sentences, width)
        for layer in self.layers:
            layer.self_attention.reorder(rows, room, drop, add, capacity, gather, first, defer)

    def compact(self, moves: list[tuple[int, int]], rows: int, capacity: int | None = None) -> None:
        """Self-attention rows leave in place (see ``SelfAttentionCache.compact``): one row per
        sentence (greedy), so ``rows`` is the sentences left, whose memory ``select_memory``
        moved alike."""
        assert rows == self.sentences, (rows, self.sentences)
        for layer in self.layers:
            layer.self_attention.compact(moves, rows, capacity)

    def extend_memory(self, cross_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Sentences join: one (K, V) pair per layer, each (B', H, S', Dh). Their self-attention
        rows come with the next ``reorder`` (its ``add``)."""
        for layer, kv in zip(self.layers, cross_kv, strict=True):
            layer.cross_attention.extend(kv)

    def select_memory(self, sentences: list[int], length: int | None = None) -> None:
        """Sentence i takes the encoder memory of ``sentences[i]``; the others (finished) are
        dropped, and source positions from ``length`` on (see ``CrossAttentionCache.select``).
        Their self-attention rows follow with the next ``reorder``."""
        for layer in self.layers:
            layer.cross_attention.select(sentences, length)


def init_cache(
    model: Transformer,
    memory: torch.Tensor,
    capacity: int,
    cross_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> KVCache:
    """A cache for ``model``'s decoder: the memory (B, S, D) projected to every layer's cross K/V
    once (``cross_kv``: already projected, as ``Transformer.project_memory`` would); room for
    ``capacity`` steps of B rows (beam search widens it to B * width rows, which share their
    sentence's cross K/V)."""
    spare = Spare()  # one reorder buffer for every layer's self-attention K and V
    kvs = model.project_memory(memory) if cross_kv is None else cross_kv
    return KVCache([LayerCache(kv, capacity, spare) for kv in kvs])
