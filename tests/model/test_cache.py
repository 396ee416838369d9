"""The KV cache's buffers: appends, reorders (beam back-pointers, dropped rows), layouts."""

from __future__ import annotations

import pytest
import torch

from model.cache import LayerCache

H, DH = 2, 3


def step(rows: int, t: int = 1) -> torch.Tensor:
    return torch.randn(rows, H, t, DH)


@pytest.mark.parametrize("room", [None, 1, 2])
def test_reorder_and_append_keep_every_row_history(room: int | None) -> None:
    torch.manual_seed(0)
    memory = torch.randn(2, H, 5, DH)
    cache = LayerCache((memory, memory), capacity=8)  # 2 sentences, beams of 3
    ref_k, ref_v = step(2), step(2)
    cache.append_self(ref_k, ref_v)
    widen = torch.tensor([0, 0, 0, 1, 1, 1])  # beam search after its first step
    cache.reorder(widen, room)
    ref_k, ref_v = ref_k[widen], ref_v[widen]
    for rows in ([2, 0, 1, 5, 3, 3], [1, 1, 0, 4, 5, 3], [0, 2], [1, 1]):  # the last two drop rows
        k, v = step(ref_k.shape[0]), step(ref_k.shape[0])
        got_k, got_v = cache.append_self(k, v)
        ref_k, ref_v = torch.cat([ref_k, k], dim=2), torch.cat([ref_v, v], dim=2)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
        if room == 1:  # the compact layout leaves exactly the appended history, contiguous
            assert got_k.is_contiguous() and got_v.is_contiguous()
        index = torch.tensor(rows)
        cache.reorder(index, room)
        ref_k, ref_v = ref_k[index], ref_v[index]
        assert torch.equal(cache.self_k, ref_k) and torch.equal(cache.self_v, ref_v)
    # appending past a compact layout spreads it out again, history intact
    for _ in range(3):
        k, v = step(2), step(2)
        got_k, _ = cache.append_self(k, v)
        ref_k = torch.cat([ref_k, k], dim=2)
        assert torch.equal(got_k, ref_k)
    assert cache.length == 8
    with pytest.raises(ValueError, match="capacity 8 exceeded"):
        cache.append_self(step(2), step(2))


def test_reorder_adds_zeroed_rows_and_forgets_old_positions() -> None:
    """Continuous batching: sentences join with an empty (zero, masked) history, and positions
    before the oldest active sentence joined are dropped, in the same copy as the reorder."""
    torch.manual_seed(1)
    memory = torch.randn(2, H, 5, DH)
    cache = LayerCache((memory, memory), capacity=4)
    ref_k, ref_v = step(2, 3), step(2, 3)
    cache.append_self(ref_k, ref_v)
    cache.reorder(torch.tensor([1, 0]), room=3, drop=1, add=2)
    assert cache.length == 2 and cache.rows == 4
    assert torch.equal(cache.self_k[:2], ref_k[[1, 0], :, 1:]) and torch.equal(cache.self_v[:2], ref_v[[1, 0], :, 1:])
    assert not cache.self_k[2:].any() and not cache.self_v[2:].any()
    k, v = step(4, 3), step(4, 3)  # room for 3 more, past the original capacity
    got_k, got_v = cache.append_self(k, v)
    assert torch.equal(got_k[:2], torch.cat([ref_k[[1, 0], :, 1:], k[:2]], dim=2))
    assert torch.equal(got_v[2:, :, 2:], v[2:]) and cache.length == 5


def test_memory_of_joining_and_leaving_sentences() -> None:
    """Joining sentences are written behind the others (padded to the longest source); leaving
    ones are replaced in place, so only moved rows are copied and the buffers are kept."""
    torch.manual_seed(2)
    first, joining = torch.randn(2, H, 3, DH), torch.randn(3, H, 5, DH)
    cache = LayerCache((first.clone(), first.clone()), capacity=4)
    cache.extend_memory((joining, joining))
    k = cache.cross_k
    assert k.shape == (5, H, 5, DH)
    assert torch.equal(k[:2, :, :3], first) and torch.equal(k[2:], joining)
    assert torch.isfinite(k).all()  # padding positions hold finite values (masked by the source mask)
    buffer, before = cache._cross_k.data_ptr(), k.clone()
    cache.select_memory([0, 4, 2], length=4)  # sentences 1 and 3 leave; 4 fills the gap at 1
    assert torch.equal(cache.cross_k, before[[0, 4, 2], :, :4])
    assert torch.equal(cache.cross_v[1], joining[2, :, :4])
    cache.extend_memory((first[:1], first[:1]))  # fits: no new buffer
    assert cache._cross_k.data_ptr() == buffer and cache.cross_k.shape == (4, H, 4, DH)
    assert torch.equal(cache.cross_k[3, :, :3], first[0])
