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
    cache = LayerCache((memory, memory), capacity=8, width=3)  # 2 sentences, beams of 3
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
