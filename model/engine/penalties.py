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

With a lexical shortlist (``model.engine.shortlist.ShortlistColumns``) a row's logits are by column,
not by piece id: the ``always`` columns every sentence shares, then its sentence's own. The history
and the n-gram matching stay on ids; each piece to penalize or ban is written at its column in that
row (every piece a hypothesis generated was one of its sentence's columns). A piece that is none of
a row's columns is never chosen there, so nothing is written for it: the row's logits are those of
the whole vocabulary's, penalized the same way, restricted to its columns.
"""

from __future__ import annotations

import math

import torch

from model.engine.options import DecodingOptions
from model.engine.shortlist import ShortlistColumns


def penalized(options: DecodingOptions) -> bool:
    """Whether ``options`` change any logit."""
    return options.repetition_penalty != 1.0 or options.no_repeat_ngram_size > 0


def apply_penalties(
    logits: torch.Tensor,
    history: torch.Tensor,
    lengths: torch.Tensor,
    options: DecodingOptions,
    columns: ShortlistColumns | None = None,
    own: torch.Tensor | None = None,
    sentence: torch.Tensor | None = None,
) -> None:
    """In place: logits (R, V) of R rows, history (R, T) their generated pieces (entries at and past
    a row's length are not read), lengths (R,) how many each row has generated. With a shortlist's
    ``columns``: logits (R, N) over its ``always`` columns and own (R, E) over each row's sentence's
    own columns, sentence (R,) each row's sentence (its place in ``columns.spans``), both changed in
    place."""
    if history.shape[1] == 0:
        return
    valid = torch.arange(history.shape[1], device=history.device)[None, :] < lengths[:, None]  # (R, T)
    if columns is not None:
        assert own is not None and sentence is not None, "a shortlist's logits come with their own columns"
        _in_columns(logits, own, columns, sentence, history, valid, lengths, options)
        return
    if options.repetition_penalty != 1.0:
        _repetition(logits, history, valid, options.repetition_penalty)
    n = options.no_repeat_ngram_size
    if n > 0 and history.shape[1] >= n:
        rows, banned = _banned(history, lengths, n)
        if rows.numel():
            logits[rows, banned] = -math.inf


def _penalize(scores: torch.Tensor, penalty: float) -> torch.Tensor:
    return torch.where(scores > 0, scores / penalty, scores * penalty)


def _repetition(logits: torch.Tensor, history: torch.Tensor, valid: torch.Tensor, penalty: float) -> None:
    """Each row's held pieces, penalized once (a piece held twice gets the same value twice)."""
    rows = valid.any(dim=1).nonzero()[:, 0]
    if rows.numel() == 0:
        return
    ids, ok = history[rows], valid[rows]
    ids = torch.where(ok, ids, ids[:, :1])  # unread places point at the row's first piece, penalized anyway
    scores = _penalize(logits[rows].gather(1, ids), penalty)
    block = logits[rows]
    block.scatter_(1, ids, scores)
    logits[rows] = block


def _banned(history: torch.Tensor, lengths: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rows, ids): each piece that would end an n-gram its row already holds (a row once per
    such n-gram): the (n-1)-gram that ends the row is matched against every earlier window."""
    rows = (lengths >= n).nonzero()[:, 0]
    if rows.numel() == 0:
        return rows, rows
    hist, length = history[rows], lengths[rows]  # (R', T), (R',)
    tail = hist.gather(1, (length[:, None] - (n - 1)) + torch.arange(n - 1, device=hist.device)[None, :])  # (R', n-1)
    windows = hist.unfold(1, n, 1)  # (R', T-n+1, n): the n-gram starting at each place
    starts = torch.arange(windows.shape[1], device=hist.device)[None, :]
    complete = starts + n <= length[:, None]  # windows wholly generated (the last may end the row)
    match = (windows[..., : n - 1] == tail[:, None, :]).all(dim=-1) & complete  # (R', T-n+1)
    which, place = match.nonzero(as_tuple=True)
    return rows[which], windows[which, place, n - 1]


def _in_columns(
    logits: torch.Tensor,
    own: torch.Tensor,
    columns: ShortlistColumns,
    sentence: torch.Tensor,
    history: torch.Tensor,
    valid: torch.Tensor,
    lengths: torch.Tensor,
    options: DecodingOptions,
) -> None:
    """Both options on a shortlist's logits: the same pieces as by id, each at its column in its row."""
    n_always = logits.shape[1]

    def split(rows: torch.Tensor, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(rows, ids) -> (block, rows, columns) for the ``always`` columns and the own ones."""
        column = columns.column_of(sentence[rows], ids)
        shared, mine = (column >= 0) & (column < n_always), column >= n_always
        return [(logits, rows[shared], column[shared]), (own, rows[mine], column[mine] - n_always)]

    if options.repetition_penalty != 1.0:
        rows, place = valid.nonzero(as_tuple=True)
        if rows.numel():
            for block, r, c in split(rows, history[rows, place]):  # every value read before any written
                block[r, c] = _penalize(block[r, c], options.repetition_penalty)
    n = options.no_repeat_ngram_size
    if n > 0 and history.shape[1] >= n:
        rows, banned = _banned(history, lengths, n)
        if rows.numel():
            for block, r, c in split(rows, banned):
                block[r, c] = -math.inf
