"""The operations of beam search's side of a decoding session, behind one interface with two
implementations: ``TensorSearchOps`` (torch's tensor operations: the reference, any device) and
``FusedSearchOps`` (one call of the fused C++ kernels each, ``model.engine.fused``, on the CPU). A
step's update of the beams (``advance``), the shortlist's candidates of sentences that join
(``candidates``), the KV cache's row copy when it reorders (``gather_rows``) and whether a step's
advance may take the logits of only some rows (``advances_some_rows``). ``DecodeSession`` holds
one, chosen once (``search_ops``), and passes it the beams and the shortlist; the two give the
same results (tests/model/test_fused.py, tests/model/test_decoding.py on both paths).

``model.engine.layer_ops`` is the same for what a decoder step and an encoder pass run between
their matrix products.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F

from model.engine.beams import Beams, length_penalty, top_k
from model.engine.cache import Gather
from model.engine.shortlist import Shortlist, ShortlistColumns

_NONE = torch.empty(0, dtype=torch.long)  # "none" for the fused kernels' optional arguments


class SearchOps(Protocol):
    """What a decoding session's beam search runs besides the decoder step."""

    def advance(
        self,
        beams: Beams,
        logits: torch.Tensor,
        start: torch.Tensor,
        now: int,
        alpha: float,
        eos_id: int,
        columns: ShortlistColumns | None = None,
        own: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One step of ``beams``: their scores, lengths, flags and history updated in place.

        logits: (A, W, V) float32 next-token logits of each sentence's first W hypotheses
        (W = 1 at a batch's first step, else K; may be overwritten with their log-probabilities),
        start: (A,) the step each sentence joined at, ``now`` the batch's step (a sentence has
        decoded now - start steps so far: the subtraction is the kernels', not a tensor
        operation a step), columns: a shortlist's (``model.engine.shortlist.ShortlistColumns``) when the
        logits cover one: then ``logits`` are (.., N) over the N columns every sentence shares and
        ``own`` (.., E) each row's over its sentence's own (-inf past its count); None: column i is
        token i.
        ``rows`` (A*W,) int64, only where ``advances_some_rows``: the step computed only some
        rows, and ``logits`` is (R', V): entry i*W + r is the logits row of sentence i's row r, or
        -1 for a row not computed, which must be at -inf (a joining sentence's copies of its first
        row at its first step: ``DecodeSession``); None: every row, logits (A, W, V)
        -> back-pointer rows (A*K,) into the A*W (None for greedy search: rows stay in
        place), and the tokens chosen (A, K).

        Every alive hypothesis of a sentence has step+1 tokens after this step, so its alive
        candidates share one length penalty and rank by raw log P; a finished hypothesis
        competes through its single (PAD) continuation, its normalized score mapped into that
        raw scale. The K best of a sentence's K x V candidates are among the K best of each of
        its rows, so each row is cut to K first (``top_k``) and only K x K survivors are ranked.
        """
        ...

    def candidates(self, shortlist: Shortlist, sources: torch.Tensor, real: torch.Tensor) -> list[torch.Tensor]:
        """sources (B, S) piece ids, real (B, S) True where a piece is the sentence's (not
        padding) -> each sentence's own candidates (C,) sorted unique, beyond the shortlist's
        ``always`` (``Shortlist.candidates_of``)."""
        ...

    # The KV cache's copy of the rows a reorder keeps (``KVCache.reorder``'s ``gather``): the
    # fused kernels' ``gather_rows_``, keys then values in one call; None: torch's.
    gather_rows: Gather | None

    # Whether ``advance`` takes the logits of only some rows (its ``rows``): a step whose layers
    # compute only some rows (``LayerOps.computes_some_rows``) needs it. The fused kernels' only.
    advances_some_rows: bool


class TensorSearchOps:
    """Beam search's update as tensor operations, the shortlist's own (``Shortlist.candidates_of``)
    and torch's copy for the KV cache's reorder.

    At one sentence a step's arithmetic is small and each tensor operation costs a few
    microseconds of dispatch, so ``advance`` takes shorter paths for the common cases: greedy
    search (one row per sentence, never finished here: a sentence leaves the step it ends) and
    beams with no finished hypothesis (the usual state until the first EOS), which need none of
    the finished hypotheses' bookkeeping."""

    gather_rows: Gather | None = None
    advances_some_rows = False

    def advance(
        self,
        beams: Beams,
        logits: torch.Tensor,
        start: torch.Tensor,
        now: int,
        alpha: float,
        eos_id: int,
        columns: ShortlistColumns | None = None,
        own: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        if rows is not None:
            raise ValueError("logits of some rows need the fused kernels' advance")
        k = beams.k
        beams.done = None
        step = now - start  # (A,)
        vocab = None  # (A, C): each sentence's token of each column
        if columns is not None and own is not None:
            index, valid = columns.padded  # (A, E)
            logits = torch.cat([logits, own.masked_fill(~valid[:, None, :], -math.inf)], dim=2)
            extra = torch.where(valid, columns.extra_ids[index], beams.pad_id)
            vocab = torch.cat([columns.always.expand(valid.shape[0], -1), extra], dim=1)
            if vocab.shape[1] < k:  # fewer columns than K (a tiny ``always``): the rest -inf, token PAD
                logits = F.pad(logits, (0, k - vocab.shape[1]), value=-math.inf)
                vocab = F.pad(vocab, (0, k - vocab.shape[1]), value=beams.pad_id)
        a, w, width = logits.shape
        logp = torch.log_softmax(logits, dim=-1, out=logits).view(a * w, width)  # in place: no second (R, V) buffer
        if k == 1:
            best, tok = logp.max(dim=-1, keepdim=True)  # (A, 1): argmax, the first of equals
            if vocab is not None:
                tok = vocab.gather(1, tok)
            beams.scores = beams.scores + best
            beams.length = (step + 1)[:, None]
            beams.eos = beams.finished = tok == eos_id
            beams.history.scatter_(2, step.view(a, 1, 1), tok.view(a, 1, 1))
            return None, tok
        logp, tok = top_k(logp, k)  # (A*W, K)
        if vocab is not None:
            tok = vocab.gather(1, tok.view(a, w * k)).view(a * w, k)
        candidates = logp.view(a, w, k) + beams.scores[:, :w, None]  # raw log P, (A, W, K)
        tok = tok.view(a, w, k)
        # reading the flags back costs a device sync every step on a GPU, where the general path
        # (the same results when nothing is finished) runs instead
        any_finished = logits.device.type != "cpu" or bool(beams.finished[:, :w].any())
        if any_finished:
            scale = length_penalty(step + 1, alpha)[:, None]  # (A, 1)
            done = (beams.scores[:, :w] / length_penalty(beams.length[:, :w], alpha) * scale)[..., None]
            finished = beams.finished[:, :w, None]  # (A, W, 1)
            candidates = torch.where(finished, done + beams.only_first, candidates)
            tok = torch.where(finished, beams.pad_id, tok)
        raw, flat = candidates.view(a, w * k).topk(k, dim=-1)  # (A, K), best first
        beam, tok = flat // k, tok.view(a, w * k).gather(1, flat)
        if any_finished:
            was_finished = beams.finished.gather(1, beam)
            beams.scores = torch.where(was_finished, beams.scores.gather(1, beam), raw)
            beams.length = torch.where(was_finished, beams.length.gather(1, beam), step[:, None] + 1)
            beams.eos = beams.eos.gather(1, beam) | (~was_finished & (tok == eos_id))
            beams.finished = was_finished | beams.eos
        else:
            beams.scores, beams.length = raw, (step + 1)[:, None].expand(a, k)
            beams.eos = beams.finished = tok == eos_id
        history = beams.history
        beams.history = history.gather(1, beam[..., None].expand(-1, -1, history.shape[2]))
        beams.history.scatter_(2, step.view(a, 1, 1).expand(a, k, 1), tok[..., None])
        return (beam + beams.row_offsets(a, w)).view(-1), tok

    def candidates(self, shortlist: Shortlist, sources: torch.Tensor, real: torch.Tensor) -> list[torch.Tensor]:
        return shortlist.candidates_of(sources, real)


class FusedSearchOps:
    """Beam search's update, the shortlist's candidates and the KV cache's row copy each in one
    call of the fused kernels (``model.engine.fused``), by the same rules as ``TensorSearchOps``.
    The kernels run on the CPU: a shortlist kept elsewhere takes the tensor operations."""

    advances_some_rows = True

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels
        self.gather_rows: Gather | None = kernels.gather_rows_

    def advance(
        self,
        beams: Beams,
        logits: torch.Tensor,
        start: torch.Tensor,
        now: int,
        alpha: float,
        eos_id: int,
        columns: ShortlistColumns | None = None,
        own: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """All of it in one call, which also says which sentences are done (``Beams.done``)."""
        state = (beams.scores, beams.length, beams.finished, beams.eos, beams.history)
        listed = (_NONE, _NONE, _NONE, _NONE) if columns is None or own is None else (
            own, columns.always, columns.extra_ids, columns.spans)  # fmt: skip
        state, beams.done = self.kernels.advance(
            logits, *listed, start, now, *state, alpha, eos_id, beams.pad_id, _NONE if rows is None else rows
        )  # fmt: skip
        beams.scores, tok, back, beams.history, beams.eos, beams.length, beams.finished = state
        return (back if beams.k > 1 else None), tok

    def candidates(self, shortlist: Shortlist, sources: torch.Tensor, real: torch.Tensor) -> list[torch.Tensor]:
        """One call, the same lists."""
        device = shortlist.targets.device
        if device.type != "cpu":
            return shortlist.candidates_of(sources, real)
        return list(self.kernels.candidates(sources.to(device), real.to(device), shortlist.offsets, shortlist.targets))


def search_ops(kernels: ModuleType | None, device: torch.device) -> SearchOps:
    """The fused kernels' operations for a session on the CPU that has them (``fused.load``), the
    tensor operations otherwise."""
    return FusedSearchOps(kernels) if kernels is not None and device.type == "cpu" else TensorSearchOps()
