"""The KV cache's two halves: self-attention rows (appends, reorders by beam back-pointers, dropped
and added rows, layouts) and cross-attention sentences (joining, leaving), and what ties them."""

from __future__ import annotations

import copy

import pytest
import torch

from model.engine import fused
from model.engine.cache import (
    FEW_MOVES,
    FIRST_SLOTS,
    CrossAttentionCache,
    KVCache,
    LayerCache,
    SelfAttentionCache,
    Spare,
    move_rows,
)
from model.engine.features import detected, fused_variant
from tests.helpers import require, rss_mib

pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("fused_kernels")]

H, DH = 2, 3


def step(rows: int, t: int = 1) -> torch.Tensor:
    return torch.randn(rows, H, t, DH)


@pytest.mark.parametrize("room", [None, 1, 2])
def test_reorder_and_append_keep_every_row_history(room: int | None) -> None:
    torch.manual_seed(0)
    cache = SelfAttentionCache(torch.empty(0), rows=2, heads=H, head_dim=DH, capacity=8)  # 2 sentences, beams of 3
    ref_k, ref_v = step(2), step(2)
    cache.append(ref_k, ref_v)
    widen = torch.tensor([0, 0, 0, 1, 1, 1])  # beam search after its first step
    cache.reorder(widen, room)
    ref_k, ref_v = ref_k[widen], ref_v[widen]
    for rows in ([2, 0, 1, 5, 3, 3], [1, 1, 0, 4, 5, 3], [0, 2], [1, 1]):  # the last two drop rows
        k, v = step(ref_k.shape[0]), step(ref_k.shape[0])
        got_k, got_v = cache.append(k, v)
        ref_k, ref_v = torch.cat([ref_k, k], dim=2), torch.cat([ref_v, v], dim=2)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
        if room == 1:  # the compact layout leaves exactly the appended history, contiguous
            assert got_k.is_contiguous() and got_v.is_contiguous()
        index = torch.tensor(rows)
        cache.reorder(index, room)
        ref_k, ref_v = ref_k[index], ref_v[index]
        assert torch.equal(cache.k, ref_k) and torch.equal(cache.v, ref_v)
    # appending past a compact layout spreads it out again, history intact
    for _ in range(3):
        k, v = step(2), step(2)
        got_k, _ = cache.append(k, v)
        ref_k = torch.cat([ref_k, k], dim=2)
        assert torch.equal(got_k, ref_k)
    assert cache.length == 8
    with pytest.raises(ValueError, match="capacity 8 exceeded"):
        cache.append(step(2), step(2))


def test_the_layout_grows_with_the_length_decoded_not_the_limit() -> None:
    """A cache for up to 200 positions lays out 16 at first and doubles when full (history
    intact), never past the capacity: memory follows what is decoded (greedy search)."""
    torch.manual_seed(4)
    cache = SelfAttentionCache(torch.empty(0), rows=3, heads=H, head_dim=DH, capacity=40)
    assert cache.slots == FIRST_SLOTS and cache.capacity == 40
    ref_k = torch.zeros(3, H, 0, DH)
    slots = []
    for _ in range(40):
        k = step(3)
        got_k, _ = cache.append(k, step(3))
        ref_k = torch.cat([ref_k, k], dim=2)
        assert torch.equal(got_k, ref_k)
        slots.append(cache.slots)
    assert sorted(set(slots)) == [16, 32, 40]
    with pytest.raises(ValueError, match="capacity 40 exceeded"):
        cache.append(step(3), step(3))
    cache.reorder(torch.arange(3), room=1, capacity=45)  # a longer-lived sentence joined
    cache.append(step(3), step(3))
    assert cache.length == 41


def test_reorder_adds_zeroed_rows_and_forgets_old_positions() -> None:
    """Continuous batching: sentences join with an empty (zero, masked) history, and positions
    before the oldest active sentence joined are dropped, in the same copy as the reorder."""
    torch.manual_seed(1)
    cache = SelfAttentionCache(torch.empty(0), rows=2, heads=H, head_dim=DH, capacity=4)
    ref_k, ref_v = step(2, 3), step(2, 3)
    cache.append(ref_k, ref_v)
    cache.reorder(torch.tensor([1, 0]), room=3, drop=1, add=2)
    assert cache.length == 2 and cache.rows == 4
    assert torch.equal(cache.k[:2], ref_k[[1, 0], :, 1:]) and torch.equal(cache.v[:2], ref_v[[1, 0], :, 1:])
    assert not cache.k[2:].any() and not cache.v[2:].any()
    k, v = step(4, 3), step(4, 3)  # room for 3 more, past the original capacity
    got_k, got_v = cache.append(k, v)
    assert torch.equal(got_k[:2], torch.cat([ref_k[[1, 0], :, 1:], k[:2]], dim=2))
    assert torch.equal(got_v[2:, :, 2:], v[2:]) and cache.length == 5


def test_memory_of_joining_and_leaving_sentences() -> None:
    """Joining sentences are written behind the others (padded to the longest source); leaving
    ones are replaced in place, so only moved rows are copied and the buffers are kept."""
    torch.manual_seed(2)
    first, joining = torch.randn(2, H, 3, DH), torch.randn(3, H, 5, DH)
    cache = CrossAttentionCache((first.clone(), first.clone()))
    cache.extend((joining, joining))
    k = cache.k
    assert k.shape == (5, H, 5, DH)
    assert torch.equal(k[:2, :, :3], first) and torch.equal(k[2:], joining)
    assert torch.isfinite(k).all()  # padding positions hold finite values (masked by the source mask)
    buffer, before = cache._k.data_ptr(), k.clone()
    cache.select([0, 4, 2], length=4)  # sentences 1 and 3 leave; 4 fills the gap at 1
    assert torch.equal(cache.k, before[[0, 4, 2], :, :4])
    assert torch.equal(cache.v[1], joining[2, :, :4])
    cache.extend((first[:1], first[:1]))  # fits: no new buffer
    assert cache._k.data_ptr() == buffer and cache.k.shape == (4, H, 4, DH)
    assert torch.equal(cache.k[3, :, :3], first[0])


def test_kv_cache_ties_self_rows_to_cross_sentences() -> None:
    """Each layer is a self-attention half (rows) over a cross-attention half (sentences);
    a reorder must leave ``width`` rows per sentence, joiners included, which is checked."""
    torch.manual_seed(3)
    memory = torch.randn(2, H, 5, DH)
    cache = KVCache([LayerCache((memory.clone(), memory.clone()), capacity=6) for _ in range(2)])
    assert (cache.sentences, cache.batch_size, cache.source_length, cache.length) == (2, 2, 5, 0)
    for layer in cache.layers:
        k, v = layer.append_self(step(2), step(2))
        assert k.shape == v.shape == (2, H, 1, DH) and layer.cross_kv[0].shape == (2, H, 5, DH)
    cache.reorder(torch.tensor([0, 0, 0, 1, 1, 1]), room=1, width=3)  # beams of 3
    assert cache.batch_size == 6 and cache.length == 1
    cache.extend_memory([(torch.randn(1, H, 7, DH),) * 2] * 2)  # a sentence joins: its rows come next
    assert cache.sentences == 3 and cache.source_length == 7 and cache.batch_size == 6
    with pytest.raises(AssertionError):
        cache.reorder(torch.arange(6), room=1, width=3)  # the joiner's rows are missing
    cache.reorder(torch.arange(6), room=1, add=3, width=3)
    assert cache.batch_size == 9
    cache.select_memory([0, 2], length=7)  # sentence 1 leaves
    cache.reorder(torch.tensor([0, 1, 2, 6, 7, 8]), room=1, width=3)
    assert (cache.sentences, cache.batch_size) == (2, 6)


@pytest.mark.parametrize("leaving", [1, 2 * FEW_MOVES])
def test_greedy_rows_leave_in_place(leaving: int) -> None:
    """Sentences leaving a greedy batch: the rows behind fill their gaps in the same buffers (no
    gather into the spare, the layout's slots kept), the history of every row that stays intact,
    the next append where it was; the same rows as a reorder gathers, on both halves."""
    torch.manual_seed(5)
    n = 3 * leaving
    memory = torch.randn(n, H, 5, DH)
    cache = KVCache([LayerCache((memory.clone(), memory.clone()), capacity=30) for _ in range(2)])
    for _ in range(3):
        for layer in cache.layers:
            layer.append_self(step(n), step(n))
    twin = copy.deepcopy(cache)
    gone = set(range(0, 2 * leaving, 2))  # every other row of the front leaves
    kept = [i for i in range(n) if i not in gone]
    order = list(range(n - leaving))
    for gap, row in zip(sorted(gone), [i for i in kept if i >= n - leaving], strict=True):
        order[gap] = row
    moves = [(i, j) for i, j in enumerate(order) if i != j]
    assert len(moves) == leaving
    self_half = cache.layers[0].self_attention
    buffers, slots = (self_half._k.data_ptr(), self_half._v.data_ptr()), self_half.slots
    cache.select_memory(order)
    cache.compact(moves, len(order), capacity=20)
    twin.select_memory(order)
    twin.reorder(torch.tensor(order), width=1)
    assert (self_half._k.data_ptr(), self_half._v.data_ptr()) == buffers and self_half.slots == slots
    assert (cache.batch_size, cache.sentences, cache.length) == (len(order), len(order), 3)
    for layer, reference in zip(cache.layers, twin.layers, strict=True):
        assert torch.equal(layer.self_attention.k, reference.self_attention.k)
        assert torch.equal(layer.self_attention.v, reference.self_attention.v)
        assert torch.equal(layer.cross_kv[0], reference.cross_kv[0])
        k, v = step(len(order)), step(len(order))
        got_k, got_v = layer.append_self(k, v)
        want_k, want_v = reference.append_self(k, v)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    with pytest.raises(AssertionError):
        cache.compact([(0, 1)], len(order) - 1)  # a move's source must be a row that leaves


@pytest.mark.parametrize("count", [FEW_MOVES, FEW_MOVES + 1])
def test_move_rows_one_at_a_time_or_indexed(count: int) -> None:
    torch.manual_seed(6)
    buffer = torch.randn(2 * count, 3, 4)
    moves = [(i, 2 * count - 1 - i) for i in range(count)]
    expected = buffer.clone()
    expected[:count] = buffer[torch.arange(2 * count - 1, count - 1, -1)]
    move_rows(buffer, moves)
    assert torch.equal(buffer, expected)


def test_layers_reorder_through_one_spare_buffer() -> None:
    """A cache's L layers hold 2L self-attention buffers and share one spare (2L + 1 in all,
    not a twin each), and every layer keeps its own history through the shared spare."""
    torch.manual_seed(4)
    memory = torch.randn(2, H, 5, DH)
    spare = Spare()
    layers = [LayerCache((memory.clone(), memory.clone()), capacity=30, spare=spare) for _ in range(3)]
    cache = KVCache(layers)
    history = [[] for _ in layers]  # each layer's (R, H, t, DH) keys, row order followed by hand
    rows = torch.tensor([0, 0, 1, 1])  # beams of 2 after the first step
    for t in range(20):
        for layer, seen in zip(layers, history, strict=True):
            k = step(cache.batch_size)
            layer.append_self(k, -k)
            seen.append(k)
        for i, seen in enumerate(history):
            assert torch.equal(layers[i].self_attention.k, torch.cat(seen, 2))
            assert torch.equal(layers[i].self_attention.v, -torch.cat(seen, 2))
        cache.reorder(rows, room=1, width=2)
        for seen in history:
            seen[:] = [x[rows] for x in seen]
        rows = torch.tensor([1, 0, 3, 2]) if t % 2 else torch.tensor([0, 0, 2, 3])
        buffers = {b.data_ptr() for layer in layers for b in (layer.self_attention._k, layer.self_attention._v)}
        assert len(buffers) == 2 * len(layers) and len(spare.held) == 1
        assert spare.held[0].data_ptr() not in buffers


def test_a_deferred_reorder_is_copied_by_the_step_or_before_anything_reads_the_cache() -> None:
    """``defer``: each layer's copy waits for the step's attention kernel (``take_deferred`` hands
    it over, the copies of the layers before it run first), or for the first read of the cache
    (``k``, ``v``, ``flat``, ``write``), which runs the pending copies of the layers before it and
    its own, in layer order: the copies form a chain (a layer's targets are the buffers the
    layer before it reads), so reading the last layer first still gives every layer its history.
    2L + 2 buffers: a deferred copy takes two spares before it hands back its own."""
    kernels_module = fused.load(fused_variant(detected()))
    require(kernels_module is not None, "the fused step kernels do not build here: see the log")

    def run_copy(target: SelfAttentionCache, handed: list[torch.Tensor]) -> None:
        """A handed-over copy made the way the step's kernel makes it (``gather_rows_``'s result)."""
        src_k, src_v, index, first = handed
        kernels_module.gather_rows_(src_k, src_v, index, target._k4[:, :, : target.length],
                                    target._v4[:, :, : target.length], first)  # fmt: skip

    torch.manual_seed(6)
    memory = torch.randn(2, H, 5, DH)
    spare = Spare()
    layers = [LayerCache((memory.clone(), memory.clone()), capacity=30, spare=spare) for _ in range(3)]
    cache = KVCache(layers)
    history = [[] for _ in layers]
    rows = torch.tensor([0, 0, 1, 1])
    for t in range(12):
        for layer, seen in zip(layers, history, strict=True):
            k = step(cache.batch_size)
            layer.append_self(k, -k)  # (the copy of a pending reorder runs first)
            seen.append(k)
        cache.reorder(rows, room=1, width=2, gather=kernels_module.gather_rows_, defer=True)
        for seen in history:
            seen[:] = [x[rows] for x in seen]
        rows = torch.tensor([1, 0, 3, 2]) if t % 2 else torch.tensor([0, 0, 2, 3])
        buffers = {b.data_ptr() for layer in layers for b in (layer.self_attention._k, layer.self_attention._v)}
        assert len(buffers) == 2 * len(layers) and len(spare.held) == 2
        assert not buffers & {b.data_ptr() for b in spare.held}
        if t % 3 == 0:  # read last layer first: the chain runs in order
            for i in reversed(range(len(layers))):
                assert torch.equal(layers[i].self_attention.k, torch.cat(history[i], 2))
                assert torch.equal(layers[i].self_attention.v, -torch.cat(history[i], 2))
        elif t % 3 == 1:  # the step's kernel takes each layer's copy in turn
            for layer in layers:
                run_copy(layer.self_attention, layer.self_attention.take_deferred())
            assert all(layer.self_attention.take_deferred() == [] for layer in layers)
        else:  # the middle layer's copy handed over first: layer 0's runs before it, layer 2's waits
            middle = layers[1].self_attention
            handed = middle.take_deferred()
            assert len(handed) == 4 and layers[0].self_attention._deferred is None
            assert layers[2].self_attention._deferred is not None
            run_copy(middle, handed)  # as the step's kernel would, before the layer's attention
    for i in range(len(layers)):
        assert torch.equal(layers[i].self_attention.k, torch.cat(history[i], 2))
        assert torch.equal(layers[i].self_attention.v, -torch.cat(history[i], 2))


def test_large_buffers_go_back_to_the_os_when_the_cache_drops_them() -> None:
    """A batch's self-attention buffers (here 8 rows x 64 heads x 64 dims x ~48 slots, ~6 MiB
    each) sit on pages of their own: they come zeroed, and dropping the cache lowers the
    process's RSS at once, without a ``malloc_trim`` (a heap would keep them resident)."""
    heads, dh, rows = 64, 64, 8
    memory = torch.zeros(rows, heads, 4, dh)
    rss = rss_mib()
    cache = KVCache([LayerCache((memory, memory), capacity=64, spare=Spare()) for _ in range(3)])
    width = torch.arange(rows)
    for _ in range(40):  # beam search: one more slot every step
        for layer in cache.layers:
            layer.append_self(torch.ones(rows, heads, 1, dh), torch.ones(rows, heads, 1, dh))
        cache.reorder(width, room=1, width=1)
    held = rss_mib()
    assert held - rss > 6 * 4, (rss, held)  # 6 buffers (and the spare) of ~6 MiB each
    assert torch.equal(cache.layers[0].self_attention.k, torch.ones(rows, heads, 40, dh))
    del cache, layer
    assert rss_mib() < held - 6 * 4, (rss, held, rss_mib())
