"""A lexical shortlist: the target pieces worth scoring for a source sentence, so a decoder
step projects onto a few thousand rows of the output matrix instead of the whole vocabulary
(the output projection was a third of a step's arithmetic and almost half the bytes it reads
at one sentence; docs/benchmarks.md "The lexical shortlist").

The candidates of a sentence are the specials, the ``frequent`` most common target pieces of
the training data, the source's own pieces (names and numbers are copied through the joint
vocabulary), and for each source piece the ``per_source`` target pieces most associated with it
in the training pairs (Dice coefficient of co-occurrence in a sentence pair), as Marian's and
CTranslate2's vocabulary shortlists do with word alignments. A decoding session scores the
union of its active sentences' candidates, so the result is an approximation: a token the
model would choose that is outside the union cannot be chosen (and log-probabilities are
normalized over the union). How close it stays is measured per direction on the validation
split (docs/benchmarks.md): the parameters were chosen there, never on test.

Build it from a checkpoint's training data with

    python -m model.shortlist --weights weights/de-en [--per-source 100 --frequent 1000]

which writes ``shortlist.safetensors`` into the checkpoint folder (``model.train`` does the
same for each run it finishes); ``checkpoint.load_shortlist`` reads it.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FILE = "shortlist.safetensors"
PER_SOURCE, FREQUENT = 200, 2000


@dataclass(frozen=True)
class Shortlist:
    """Each source piece's associated target pieces, best first, in one flat tensor: piece s's
    are ``targets[offsets[s]:offsets[s + 1]]`` (none for a piece never seen in training; about
    40% of a dense V x per_source table, 1.2 MB for the shipped 8,000 x 200); ``always`` (N,)
    sorted: the pieces every sentence may produce (specials and the most frequent targets).
    offsets (V + 1,) int64, targets (E,) integer ids (int16 where they fit), ``per_source``
    the most any piece has."""

    offsets: torch.Tensor
    targets: torch.Tensor
    always: torch.Tensor
    per_source: int

    @classmethod
    def from_table(cls, table: torch.Tensor, always: torch.Tensor) -> Shortlist:
        """table (V, K): row s the targets of piece s, best first, 0 (pad) where it has no more."""
        kept = table != 0
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), kept.sum(dim=1).cumsum(0)])
        return cls(offsets, table[kept], always.long(), table.shape[1])

    @property
    def vocab_size(self) -> int:
        return self.offsets.numel() - 1

    def row(self, piece: int) -> torch.Tensor:
        """The targets associated with one source piece, best first."""
        return self.targets[int(self.offsets[piece]) : int(self.offsets[piece + 1])]

    def candidates(self, source: torch.Tensor) -> torch.Tensor:
        """source (S,) piece ids -> the sentence's own candidates (C,) sorted unique, beyond
        ``always``: its pieces and their associations."""
        return self.candidates_of(source[None], torch.ones(1, source.numel(), dtype=torch.bool))[0]

    def candidates_of(self, sources: torch.Tensor, real: torch.Tensor) -> list[torch.Tensor]:
        """sources (B, S) piece ids, real (B, S) True where a piece is the sentence's (not
        padding) -> each sentence's ``candidates``, computed for the batch at once (a handful of
        tensor operations, not a loop over pieces)."""
        device, v = self.targets.device, self.vocab_size
        sources, real = sources.to(device), real.to(device)
        b, s = sources.shape
        sentence = torch.arange(b, device=device)[:, None].expand(b, s)[real]  # (N,) of each real piece
        pieces = sources[real]  # (N,)
        start = self.offsets[pieces]
        lengths = self.offsets[pieces + 1] - start
        ends = lengths.cumsum(0)
        within = torch.arange(int(ends[-1]) if ends.numel() else 0, device=device)
        within -= torch.repeat_interleave(ends - lengths, lengths)
        targets = self.targets[torch.repeat_interleave(start, lengths) + within].long()
        owner = torch.repeat_interleave(sentence, lengths)
        keys = torch.cat([sentence * v + pieces, owner * v + targets]).unique()  # sorted: by sentence, then id
        per = torch.bincount(keys // v, minlength=b).tolist()
        return list((keys % v).split(per))

    def to(self, device: torch.device) -> Shortlist:
        return Shortlist(self.offsets.to(device), self.targets.to(device), self.always.to(device), self.per_source)


def build(
    pairs: Iterable[tuple[Sequence[int], Sequence[int]]],
    vocab_size: int,
    specials: int = 4,
    per_source: int = PER_SOURCE,
    frequent: int = FREQUENT,
) -> Shortlist:
    """Count, over aligned (source ids, target ids) pairs, in how many pairs each source piece
    s, target piece t and both occur, and keep for each s the (at most) ``per_source`` t of
    highest Dice coefficient 2 c(s, t) / (c(s) + c(t)) > 0. ``specials``: ids below it (pad,
    unk, bos, eos) are always candidates and never counted."""
    both = torch.zeros(vocab_size, vocab_size, dtype=torch.float32)  # (source, target) pair counts
    src_count = torch.zeros(vocab_size)
    tgt_count = torch.zeros(vocab_size)
    for src, tgt in pairs:
        s = torch.tensor(sorted({i for i in src if i >= specials}), dtype=torch.long)
        t = torch.tensor(sorted({i for i in tgt if i >= specials}), dtype=torch.long)
        src_count[s] += 1
        tgt_count[t] += 1
        both[s[:, None], t[None, :]] += 1
    dice = both.mul_(2).div_((src_count[:, None] + tgt_count[None, :]).clamp_(min=1))
    dice[:, :specials] = -1.0  # specials are in ``always``: keep the rows' places for others
    score, table = dice.topk(min(per_source, vocab_size), dim=1)
    table[score <= 0] = 0  # no association (pieces never seen): dropped by ``from_table``
    most = tgt_count.topk(min(frequent, vocab_size)).indices
    always = torch.cat([torch.arange(specials), most]).unique()
    return Shortlist.from_table(table, always)


class Vocabulary:
    """The union of the active sentences' candidates, kept by counting: each sentence that joins
    adds one to its candidates' counts, each that leaves takes one away. ``ids`` is a superset
    of the union (sorted): it is made again whenever a sentence joins with a candidate it lacks,
    but when sentences leave only once it is a quarter larger than the union (gathering the
    output matrix's rows for it again costs more than scoring a few extra rows at every step of
    a batch whose sentences finish one by one). ``version`` counts the times it was made."""

    SLACK = 1.25  # ids may hold this many times the union's size after sentences left

    def __init__(self, shortlist: Shortlist, device: torch.device) -> None:
        self.shortlist = shortlist.to(device)
        self.counts = torch.zeros(shortlist.vocab_size, dtype=torch.int32, device=device)
        self.counts[self.shortlist.always] = 1  # never taken away
        self._ids: torch.Tensor | None = None
        self._covered = torch.zeros_like(self.counts, dtype=torch.bool)  # the pieces in ``_ids``
        self._stale = True
        self.version = 0

    def add(self, sentences: list[torch.Tensor]) -> None:
        """Sentences join: each one's candidates (unique ids)."""
        candidates = torch.cat(sentences)
        self.counts.index_add_(0, candidates, torch.ones_like(candidates, dtype=torch.int32))
        self._stale = self._stale or not bool(self._covered[candidates].all())

    def remove(self, sentences: list[torch.Tensor]) -> None:
        """Sentences leave: each one's candidates, as they were added."""
        candidates = torch.cat(sentences)
        self.counts.index_add_(0, candidates, torch.full_like(candidates, -1, dtype=torch.int32))
        if not self._stale and self._ids is not None:
            self._stale = self._ids.numel() > self.SLACK * int(self.counts.count_nonzero())

    @property
    def ids(self) -> torch.Tensor:
        """(C,) sorted ids: every candidate of an active sentence and ``always``, and perhaps
        some of sentences that left (see the class's docstring)."""
        if self._stale or self._ids is None:
            self._covered = self.counts > 0
            self._ids = self._covered.nonzero()[:, 0]
            self._stale, self.version = False, self.version + 1
        return self._ids


def main(argv: list[str] | None = None) -> None:
    from model import checkpoint  # the command reads and writes checkpoint folders

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", required=True, type=Path, help="a one-direction checkpoint folder")
    parser.add_argument("--data-dir", type=Path, help="default: the folder its training config names")
    parser.add_argument("--per-source", type=int, default=PER_SOURCE)
    parser.add_argument("--frequent", type=int, default=FREQUENT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = checkpoint.write_shortlist(args.weights, args.data_dir, args.per_source, args.frequent)
    log.info("wrote %s", path)


if __name__ == "__main__":
    main()
