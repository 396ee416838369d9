"""The tutorials' copy task: a small Transformer learns to copy random symbol sequences."""

from __future__ import annotations

import time

import pytest
import torch

from model.engine.decoding import decode
from model.engine.options import DecodingOptions
from model.network.transformer import Transformer
from model.training.train import inverse_sqrt_schedule, smoothed_loss
from tests.factories import tiny_config

pytestmark = pytest.mark.train

V, LENGTH, BOS, EOS = 14, 10, 2, 3  # symbols are ids 4..13


def copy_batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> src (symbols + EOS), decoder input (BOS + symbols), decoder target (symbols + EOS)."""
    x = torch.randint(4, V, (n, LENGTH), generator=generator)
    src = torch.cat([x, torch.full((n, 1), EOS)], dim=1)
    tgt_in = torch.cat([torch.full((n, 1), BOS), x], dim=1)
    return src, tgt_in, src


def exact_match(model: Transformer, src: torch.Tensor, beam_size: int) -> float:
    hyps = decode(model, src, DecodingOptions(beam_size=beam_size)).hypotheses
    return sum(list(h[0].ids) == row[:-1].tolist() for h, row in zip(hyps, src, strict=True)) / len(src)


def test_copy_task_learns_to_copy() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    cfg = tiny_config(V, d_model=64, d_ff=128, max_positions=32)
    model = Transformer(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.9, 0.98), eps=1e-9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_schedule(100))
    held_out = copy_batch(200, torch.Generator().manual_seed(123))[0]
    start, accuracy = time.monotonic(), 0.0
    for step in range(1, 1501):
        src, tgt_in, tgt_out = copy_batch(64, g)
        loss = smoothed_loss(model(src, tgt_in), tgt_out, 0.0, cfg.pad_id) / tgt_out.numel()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0:
            model.eval()
            accuracy = exact_match(model, held_out, beam_size=1)
            model.train()
            if accuracy == 1.0:
                break
    model.eval()
    assert accuracy == 1.0, f"greedy exact match {accuracy:.2%} after {step} steps, {time.monotonic() - start:.0f} s"
    assert exact_match(model, held_out, beam_size=4) == 1.0
