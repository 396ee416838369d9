"""Beam search's bookkeeping: the hypotheses of every active sentence, their scores and
lengths, and the top-k that ranks the candidates (greedy search is the beam of one).
``model.engine.decoding.DecodeSession`` owns one ``Beams`` per running batch; a step's update of
them is its search operations' (``model.engine.search_ops``: ``SearchOps.advance``)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Hypothesis:
    """One output sequence. ``ids`` exclude BOS and EOS; ``score`` is length-normalized."""

    ids: tuple[int, ...]
    score: float
    log_prob: float
    finished: bool

    @property
    def confidence(self) -> int:
        """How sure the model was, 0-100: the geometric mean of its pieces' probabilities (EOS
        included), 100 * exp(log P / pieces), as decoding scored them. How it relates to quality
        (sentence chrF): docs/decoding.md#confidence."""
        pieces = len(self.ids) + int(self.finished)
        return round(100 * math.exp(self.log_prob / pieces)) if pieces else 100


# top_k splits each row into blocks of this many scores (see there), from this many rows on.
TOP_K_BLOCK = 64
TOP_K_BLOCK_ROWS = 32


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row and their columns, best first. x: (R, V) -> (R, k), (R, k).

    ``torch.topk`` (and ``argmax``) over an 8,000-way row cost many times a row's ``amax`` on the
    CPU (docs/benchmarks/README.md#numbers-behind-the-code). So rows are cut into blocks of
    ``TOP_K_BLOCK``: the k blocks with the largest maxima hold the k largest values (any value
    outside them is beaten by k block maxima), and ``topk`` only ranks those k blocks' scores
    (ties between equal values may break differently from ``torch.topk``). Other devices,
    rows too short for it to pay off, and fewer than ``TOP_K_BLOCK_ROWS`` rows (its dozen
    operations cost more than ``topk`` itself there: docs/benchmarks/README.md#numbers-behind-the-code)
    use ``torch.topk``.
    """
    r, v = x.shape
    blocks, tail = divmod(v, TOP_K_BLOCK)
    if x.device.type != "cpu" or blocks < 4 * k or r < TOP_K_BLOCK_ROWS:
        return x.topk(k, dim=-1)
    main = x[:, : blocks * TOP_K_BLOCK].view(r, blocks, TOP_K_BLOCK)
    chosen = main.amax(dim=-1).topk(k, dim=-1).indices  # (R, k) block ids
    candidates = main.gather(1, chosen[..., None].expand(-1, -1, TOP_K_BLOCK)).view(r, k * TOP_K_BLOCK)
    columns = (chosen[..., None] * TOP_K_BLOCK + torch.arange(TOP_K_BLOCK, device=x.device)).view(r, -1)
    if tail:  # the last, partial block always competes
        candidates = torch.cat([candidates, x[:, blocks * TOP_K_BLOCK :]], dim=1)
        columns = torch.cat([columns, torch.arange(blocks * TOP_K_BLOCK, v, device=x.device).expand(r, -1)], dim=1)
    values, j = candidates.topk(k, dim=-1)
    return values, columns.gather(1, j)


def length_penalty(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """GNMT length penalty ((5 + |Y|) / 6) ** alpha, elementwise."""
    if alpha == 0:
        return torch.ones_like(lengths, dtype=torch.float32)
    return ((5.0 + lengths.float()) / 6.0) ** alpha


def _hypothesis(row: list[int], length: int, score: float, log_prob: float, finished: bool) -> Hypothesis:
    """row: (capacity,) generated ids; drop the EOS of a finished hypothesis."""
    n = length - 1 if finished else length
    return Hypothesis(tuple(row[:n]), score, log_prob, finished)


def cat_padded(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """Stack a (A, ...) and b (B, ...) along dim 0 -> (A + B, ...), zero-padding dimension
    ``dim`` to the longer of the two (False in a mask: padding)."""
    size = list(a.shape)
    size[0] += b.shape[0]
    size[dim] = max(a.shape[dim], b.shape[dim])
    out = a.new_zeros(size)
    out[: a.shape[0]].narrow(dim, 0, a.shape[dim]).copy_(a)
    out[a.shape[0] :].narrow(dim, 0, b.shape[dim]).copy_(b)
    return out


class Beams:
    """K hypotheses per active sentence: raw log-probabilities, lengths, flags and tokens.

    A sentence joins with one live hypothesis (BOS, score 0) and K - 1 at -inf, so its first
    step's K best candidates all extend the live one. A batch's first step runs one row per
    sentence (the others would be copies of it; K rows cost more row-steps:
    docs/benchmarks/README.md#numbers-behind-the-code);
    sentences that join a running batch get K rows, like everyone else in it by then (with the fused
    kernels their first step computes only the first of them: ``SearchOps.advance``'s ``rows``).
    """

    def __init__(self, k: int, pad_id: int, device: torch.device) -> None:
        self.k, self.pad_id = k, pad_id
        # the sentences all of whose hypotheses are finished, when the fused kernels' advance said
        # (None: not known; sentences joining or leaving make it unknown)
        self.done: list[int] | None = None
        self.scores = torch.zeros(0, k, device=device)  # raw cumulative log P, (A, K)
        self.length = torch.zeros(0, k, dtype=torch.long, device=device)  # tokens, EOS included
        self.finished = torch.zeros(0, k, dtype=torch.bool, device=device)
        self.eos = torch.zeros(0, k, dtype=torch.bool, device=device)  # finished by EOS (not truncated)
        self.history = torch.full((0, k, 0), pad_id, dtype=torch.long, device=device)  # (A, K, steps)
        # a finished hypothesis's K candidates: its score once (the PAD continuation), then nothing
        self.only_first = torch.full((k,), -math.inf, device=device)
        self.only_first[0] = 0.0
        self._offsets, self._offsets_width = torch.zeros(0, 1, dtype=torch.long, device=device), 0

    def extend(self, b: int, steps: int) -> None:
        """b sentences join, each decoded for at most ``steps`` steps."""
        self.done = None
        scores = self.only_first.expand(b, -1)
        history = self.history.new_full((b, self.k, steps), self.pad_id)
        if self.scores.shape[0] == 0:  # no sentence yet (one at a time: each joins an empty batch)
            self.scores, self.history = scores.clone(), history  # (not a view of only_first)
            self.length = self.length.new_zeros(b, self.k)
            self.finished, self.eos = self.finished.new_zeros(b, self.k), self.eos.new_zeros(b, self.k)
            return
        self.scores = torch.cat([self.scores, scores])
        self.length = torch.cat([self.length, self.length.new_zeros(b, self.k)])
        self.finished = torch.cat([self.finished, self.finished.new_zeros(b, self.k)])
        self.eos = torch.cat([self.eos, self.eos.new_zeros(b, self.k)])
        # (positions past a sentence's own limit are never read, whatever cat_padded put there)
        self.history = cat_padded(self.history, history, dim=2)

    def row_offsets(self, a: int, w: int) -> torch.Tensor:
        """(A, 1): the first of each sentence's W rows, kept while the batch keeps its shape."""
        if self._offsets.shape[0] != a or self._offsets_width != w:
            self._offsets = torch.arange(a, device=self._offsets.device)[:, None] * w
            self._offsets_width = w
        return self._offsets

    def truncate(self, sentences: list[int]) -> None:
        """These sentences reached their length limit: every hypothesis of theirs is finished
        (the live ones unfinished, ``eos`` False)."""
        self.finished = self.finished.clone()  # (after a step ``finished`` may be ``eos`` itself)
        self.finished[sentences] = True
        if self.done is not None:
            self.done = sorted(set(self.done).union(sentences))

    def done_sentences(self) -> list[int]:
        """The sentences all of whose hypotheses are finished, ascending: as the fused kernels'
        advance (and ``truncate`` since) said, without reading the device, else from ``finished``."""
        if self.done is not None:
            return self.done
        done = self.finished.all(dim=1).tolist()  # one read from the device (``nonzero`` would take two)
        return [i for i, flag in enumerate(done) if flag]

    def hypotheses(self, sentences: list[int], n_best: int, alpha: float) -> list[list[Hypothesis]]:
        """The n best of each of these active sentences (already sorted by normalized score),
        read from the device in one go for all of them (a greedy batch of 64 finishes a sentence
        or two at most steps, and each read from the device has a fixed cost:
        docs/benchmarks/log/2026-11-29.md#greedy-rows-leave-in-place-session-of-2026-11-29-0048)."""
        index = torch.tensor(sentences, device=self.scores.device)
        lengths = self.length[index, :n_best].tolist()
        # each penalty on its own, as one element (torch's pow takes a vectorized path for longer
        # tensors, whose last bit may differ): a score does not depend on who finished beside it
        lp = torch.tensor([[self._penalty(n, alpha) for n in row] for row in lengths], device=index.device)
        scores = self.scores[index, :n_best]
        raw, normalized = scores.tolist(), (scores / lp).tolist()
        rows, eos = self.history[index, :n_best].tolist(), self.eos[index, :n_best].tolist()
        return [
            [_hypothesis(rows[s][j], lengths[s][j], normalized[s][j], raw[s][j], eos[s][j]) for j in range(n_best)]
            for s in range(len(sentences))
        ]

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def _penalty(length: int, alpha: float) -> float:
        """``length_penalty`` of one length, a float32 value."""
        return float(length_penalty(torch.tensor([length]), alpha))

    def keep(self, keep: torch.Tensor) -> None:
        self.done = None
        for name in ("scores", "length", "finished", "eos", "history"):
            setattr(self, name, getattr(self, name)[keep])
