"""Decoding options against loops: ``repetition_penalty`` and ``no_repeat_ngram_size``, with the
meanings CTranslate2 and ``transformers`` give them, applied to a step's logits before the beams'
softmax (as CTranslate2 applies them; ``transformers``' beam search applies them to the
log-probabilities after its softmax: the same choices for greedy search, beam scores that differ
by the penalized pieces' probability). Each row's history is the pieces its hypothesis generated
so far (the decoder's start piece not counted).

- ``repetition_penalty`` p (CTRL, Keskar et al. 2019): every piece the hypothesis already holds
  has its logit divided by p where positive, multiplied by p where negative; 1 is off.
- ``no_repeat_ngram_size`` n: a piece that would complete an n-gram the hypothesis already holds
  gets -inf; 0 is off.

Both run on the logits whatever computed them (the fused kernels or the tensor operations), for
greedy and beam search alike, before ``Beams.advance``; the one place they are applied is
``DecodeSession._decode``.
"""

from __future__ import annotations

import math

import torch

from model.engine.options import DecodingOptions


def penalized(options: DecodingOptions) -> bool:
    """Whether ``options`` change any logit."""
    return options.repetition_penalty != 1.0 or options.no_repeat_ngram_size > 0


def apply_penalties(
    logits: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, options: DecodingOptions
) -> None:
    """In place: logits (R, V) of R rows, history (R, T) their generated pieces (entries at and past
    a row's length are not read), lengths (R,) how many each row has generated."""
    if history.shape[1] == 0:
        return
    valid = torch.arange(history.shape[1], device=history.device)[None, :] < lengths[:, None]  # (R, T)
    if options.repetition_penalty != 1.0:
        _repetition(logits, history, valid, options.repetition_penalty)
    n = options.no_repeat_ngram_size
    if n > 0 and history.shape[1] >= n:
        _no_repeat(logits, history, lengths, n)


def _repetition(logits: torch.Tensor, history: torch.Tensor, valid: torch.Tensor, penalty: float) -> None:
    """Each row's held pieces, penalized once (a piece held twice gets the same value twice)."""
    rows = valid.any(dim=1).nonzero()[:, 0]
    if rows.numel() == 0:
        return
    ids, ok = history[rows], valid[rows]
    ids = torch.where(ok, ids, ids[:, :1])  # unread places point at the row's first piece, penalized anyway
    scores = logits[rows].gather(1, ids)
    scores = torch.where(scores > 0, scores / penalty, scores * penalty)
    block = logits[rows]
    block.scatter_(1, ids, scores)
    logits[rows] = block


def _no_repeat(logits: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, n: int) -> None:
    """-inf for each piece that would end an n-gram the row already holds: the (n-1)-gram that ends
    the row is matched against every earlier window."""
    rows = (lengths >= n).nonzero()[:, 0]
    if rows.numel() == 0:
        return
    hist, length = history[rows], lengths[rows]  # (R', T), (R',)
    tail = hist.gather(1, (length[:, None] - (n - 1)) + torch.arange(n - 1, device=hist.device)[None, :])  # (R', n-1)
    windows = hist.unfold(1, n, 1)  # (R', T-n+1, n): the n-gram starting at each place
    starts = torch.arange(windows.shape[1], device=hist.device)[None, :]
    complete = starts + n <= length[:, None]  # windows wholly generated (the last may end the row)
    match = (windows[..., : n - 1] == tail[:, None, :]).all(dim=-1) & complete  # (R', T-n+1)
    which, place = match.nonzero(as_tuple=True)
    if which.numel():
        logits[rows[which], windows[which, place, n - 1]] = -math.inf
