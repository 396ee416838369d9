"""A lexical shortlist: the target pieces worth scoring for a source sentence, so a decoder
step projects onto a few thousand rows of the output matrix instead of the whole vocabulary
(the output projection was a third of a step's arithmetic and almost half the bytes it reads
at one sentence; docs/benchmarks.md "The lexical shortlist").

The candidates of a sentence are the specials, the ``frequent`` most common target pieces of
the training data, the source's own pieces (names and numbers are copied through the joint
vocabulary), and for each source piece the ``per_source`` target pieces most associated with it
in the training pairs (Dice coefficient of co-occurrence in a sentence pair), as Marian's and
CTranslate2's vocabulary shortlists do with word alignments. A decoding session scores the
union of its active sentences' candidates and keeps each sentence to its own (``Vocabulary``),
so a sentence's translation does not depend on its batch; it is an approximation all the same:
a token the model would choose that is outside a sentence's candidates cannot be chosen (and
log-probabilities are normalized over its candidates). How close it stays is measured per direction on the validation
split (docs/benchmarks.md): the parameters were chosen there, never on test.

Build it from a checkpoint's training data with

    python -m model.shortlist --weights weights/de-en [--per-source 200 --frequent 2000]

which writes ``shortlist.safetensors`` into the checkpoint folder (``model.train`` does the
same for each run it finishes); ``checkpoint.load_shortlist`` reads it.
"""

from __future__ import annotations

import argparse
import logging
import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

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

    def candidates_of(
        self, sources: torch.Tensor, real: torch.Tensor, kernels: ModuleType | None = None
    ) -> list[torch.Tensor]:
        """sources (B, S) piece ids, real (B, S) True where a piece is the sentence's (not
        padding) -> each sentence's ``candidates``, computed for the batch at once (a handful of
        tensor operations, not a loop over pieces), or by the fused kernels (``model.fused``:
        one call, the same lists) when given and on the CPU."""
        device, v = self.targets.device, self.vocab_size
        if kernels is not None and device.type == "cpu":
            return list(kernels.candidates(sources.to(device), real.to(device), self.offsets, self.targets))
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
        mark = torch.zeros(b, v, dtype=torch.bool, device=device)  # (sentence, piece): a candidate
        mark[sentence, pieces] = True
        mark[owner, targets] = True
        found = mark.nonzero()  # (N, 2) by sentence, then id (no sort: unique() sorted 10x slower)
        return list(found[:, 1].split(mark.sum(dim=1).tolist()))

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


_WIDE = (torch.float32, torch.float16)  # output matrices the kernels' ``join_columns`` reads (into float32 rows)


class Vocabulary:
    """What a decoding session's steps score with a shortlist: columns (``ids``: the union of its
    active sentences' candidates, perhaps more), the output matrix's rows for them (``rows``),
    and which columns are each sentence's own (``bias``: 0 there, -inf elsewhere, so a sentence
    is translated from its own candidates whatever sentences are decoded beside it).

    Kept up to date at small cost as sentences come and go, by counting (each candidate counts
    the active sentences that have it): a joining sentence's new candidates are appended as
    columns (their rows gathered, the other sentences' bias -inf there) and its bias row added;
    leaving sentences take their bias rows along, and their columns stay until the columns are a
    quarter more than the union (``SLACK``) and the unused ones cost the rows still decoding
    enough products to pay for a remake (``remake_work``); then everything is made again from the
    union. Sentences are in the session's batch order."""

    SLACK = 1.25
    # Unused columns x rows still decoding before a remake pays (each such column costs a step 2 x
    # D flops a row; a remake and the panels packed again ~2 ms on two Zen 3 cores): the last
    # sentences of a greedy batch of 64 remade 29 times a pass of test_2016 for products that were
    # already small, and never remaking on leave ran that pass 8% faster (docs/benchmarks.md "Greedy
    # rows leave in place"). A continuously fed batch at beam 4 (~230 rows) remakes as before.
    REMAKE_WORK = 32768

    def __init__(
        self, shortlist: Shortlist, matrix: torch.Tensor, dtype: torch.dtype, remake_work: int = REMAKE_WORK
    ) -> None:
        """matrix (V, D) the output projection; its rows are scored in ``dtype``. ``remake_work``:
        unused columns x rows left, at least, before leaving sentences make the columns again."""
        self.shortlist = shortlist.to(matrix.device)
        self.remake_work = remake_work
        self.matrix, self.dtype, self.device = matrix, dtype, matrix.device
        self.counts = torch.zeros(shortlist.vocab_size, dtype=torch.int32, device=self.device)
        self.counts[self.shortlist.always] = 1  # never taken away
        self._empty = self.counts.clone()  # the counts with no sentence
        self.sentences: list[torch.Tensor] = []  # each active sentence's candidates
        self.remade = 0  # how many times the columns were made from the union (tests read it)
        self.owner: Callable[[], object] = lambda: None  # the session using it (``claim``)
        self.column = torch.full_like(self.counts, -1, dtype=torch.long)  # each id's column (-1: none)
        self._ids = torch.empty(0, dtype=torch.long, device=self.device)
        self._rows = torch.empty(0, matrix.shape[1], dtype=dtype, device=self.device)
        self.size = 0
        self._set_bias(torch.empty(0, 0, device=self.device))
        self._clean = False  # cleared since the last join (``clear`` has nothing to do)
        # ``panels``: the columns' rows packed for the fused kernels, in a buffer with room to grow;
        # the first ``_packed`` columns are packed (columns only ever join at the end, so a join
        # packs its new ones alone), and ``packed`` counts every column packed (tests read it)
        self._panel_buffer: torch.Tensor | None = None  # (panels, D, width)
        self._panel_view: torch.Tensor | None = None  # its first ceil(C / width) panels
        self._packed = 0
        self.packed = 0
        self._remake()

    @property
    def ids(self) -> torch.Tensor:
        """(C,) the token id of each column (not sorted)."""
        return self._views[0]

    @property
    def rows(self) -> torch.Tensor:
        """(C, D) the output matrix's rows of ``ids``."""
        return self._views[1]

    @property
    def bias(self) -> torch.Tensor:
        """(A, 1, C) 0 at a sentence's own columns (its candidates and ``always``), -inf elsewhere."""
        return self._views[2]

    def _set_bias(self, bias: torch.Tensor) -> None:
        """Every change of the columns or sentences ends here: the new bias (A, C), and the views
        a decoder step reads (``ids``, ``rows``, ``bias``), made once per change, not every step."""
        self._bias = bias
        self._views = (self._ids[: self.size], self._rows[: self.size], bias[:, None, :])

    @torch.inference_mode()
    def panels(self, kernels: ModuleType) -> torch.Tensor:
        """``rows`` packed into the fused kernels' panels (``pack_panels``' layout: (ceil(C / w), D,
        w), the last panel padded with zeros), for ``panel_product`` over the C columns: on an AMD
        EPYC Zen 3 the logits of 64 rows over 3,000 columns take 0.7 ms there against MKL's
        1.3 (docs/benchmarks.md "The panels on a real AVX2 CPU"). Columns only ever join at the
        end, so only those not packed yet are (from the start of the panel the first of them
        falls in): a continuously fed batch, whose every admission adds a few columns, packed all
        of them again each time (docs/benchmarks.md "Admissions without padding"); a remake packs
        everything. float32 rows only. The returned view is valid until the columns next change."""
        width = kernels.panel_width()
        count = -(-self.size // width)
        buffer = self._panel_buffer
        if buffer is None or buffer.shape[0] < count or buffer.shape[2] != width:
            self._grow_panels(count, width)
            buffer = self._panel_buffer
            assert buffer is not None
        if self._packed < self.size:
            first = self._packed // width  # (a partly packed panel is packed again whole)
            chunk = self._rows[first * width : self.size]
            short = (count - first) * width - chunk.shape[0]
            if short:
                chunk = F.pad(chunk, (0, 0, 0, short))
            buffer[first:count].copy_(chunk.view(count - first, width, -1).transpose(1, 2))
            self.packed += self.size - first * width
            self._packed = self.size
            self._panel_view = None
        if self._panel_view is None or self._panel_view.shape[0] != count:
            self._panel_view = buffer[:count]
        return self._panel_view

    def _grow_panels(self, count: int, width: int) -> None:
        """A panel buffer for at least ``count`` panels (a quarter more, at most the vocabulary's),
        keeping the whole panels packed so far."""
        most = -(-self.shortlist.vocab_size // width)
        grown = torch.empty(min(most, max(count, count + count // 4)), self.matrix.shape[1], width, device=self.device)
        old = self._panel_buffer
        whole = self._packed // width if old is not None and old.shape[2] == width else 0
        if old is not None and whole:
            grown[:whole] = old[:whole]
        self._panel_buffer, self._panel_view, self._packed = grown, None, whole * width

    @property
    def in_use(self) -> bool:
        """A live session holds it with sentences being decoded (so it cannot be handed on)."""
        return self.owner() is not None and bool(self.sentences)

    def claim(self, session: object) -> None:
        """A new session takes it over (a model's sessions come one after another: the
        always-candidates' rows are gathered once, not by every session on freshly trimmed
        memory) and empties it (``clear``) as it starts; the session that had it must make its
        own from then on (``owner``)."""
        self.owner = weakref.ref(session)

    @torch.inference_mode()
    def clear(self) -> None:
        """Every sentence left (a session that emptied): back to ``always``'s columns, which
        come first after a remake from no sentences, without gathering their rows again."""
        if self._clean:  # nothing joined since the last clear (a session's end, then the next one's start)
            return
        self.counts.copy_(self._empty)
        self.sentences = []
        base = self.shortlist.always.numel()
        if self.size >= base and torch.equal(self._ids[:base], self.shortlist.always):
            self.column[self._ids[base : self.size]] = -1
            self.size = base
            self._packed = min(self._packed, base)
            if self._ids.numel() > 2 * base:  # grown by large batches: hold no more than twice ``always``
                self._ids, self._rows = self._ids[:base].clone(), self._rows[:base].clone()
                if self._panel_buffer is not None:  # (and the panels that hold them)
                    width = self._panel_buffer.shape[2]
                    self._panel_buffer, self._panel_view = self._panel_buffer[: -(-base // width)].clone(), None
            self._set_bias(self._own([]))
        else:
            self._remake()
        self._clean = True  # (last: a clear that raised half-way is done again next time)

    def join(self, candidates: list[torch.Tensor], kernels: ModuleType | None = None) -> None:
        """Sentences join, behind the others: each one's candidates (unique ids). ``kernels``:
        the fused kernels (``model.fused``), which make their bias rows in one call."""
        self._clean = False
        m = self.matrix
        if kernels is not None and m.is_cpu and m.is_contiguous() and self.dtype == torch.float32 and m.dtype in _WIDE:
            # one call instead of ~10 tensor operations (~0.15 ms of a lone sentence's admission)
            self._reserve(self.size + sum(c.numel() for c in candidates))
            self.size = kernels.join_columns(self.counts, self.column, self._ids, self._rows, self.size, m, candidates)
        else:
            added = torch.cat(candidates)
            self.counts.index_add_(0, added, torch.ones_like(added, dtype=torch.int32))
            new = added[self.column[added] < 0].unique()  # (few: most candidates have columns already)
            if new.numel():
                self._append(new)
        own = self._own(candidates, kernels)
        if self._bias.shape[0] == 0:  # the first sentences of a session
            self._set_bias(own)
        else:
            bias = torch.full((len(self.sentences) + len(candidates), self.size), -math.inf, device=self.device)
            bias[: self._bias.shape[0], : self._bias.shape[1]] = self._bias
            bias[self._bias.shape[0] :] = own
            self._set_bias(bias)
        self.sentences.extend(candidates)

    def leave(self, gone: list[int], kept: list[int], keep: torch.Tensor, width: int = 1) -> None:
        """Sentences ``gone`` leave; ``kept`` (keep: the same on the device) stay, in that order,
        each decoded on ``width`` rows (its hypotheses)."""
        removed = torch.cat([self.sentences[i] for i in gone])
        self.counts.index_add_(0, removed, torch.full_like(removed, -1, dtype=torch.int32))
        self.sentences = [self.sentences[i] for i in kept]
        used = int(self.counts.count_nonzero())
        if self.size > self.SLACK * used and (self.size - used) * len(kept) * width >= self.remake_work:
            self._remake()
        else:
            self._set_bias(self._bias[keep])

    def _remake(self) -> None:
        """Columns from the union (sorted), their rows, every sentence's bias row."""
        ids = (self.counts > 0).nonzero()[:, 0]
        self.column = torch.full_like(self.counts, -1, dtype=torch.long)  # each id's column (-1: none)
        self._ids = torch.empty(0, dtype=torch.long, device=self.device)
        self._rows = torch.empty(0, self.matrix.shape[1], dtype=self.dtype, device=self.device)
        self.size = self._packed = 0
        self._append(ids)
        self._set_bias(self._own(self.sentences))
        self.remade += 1

    def _append(self, ids: torch.Tensor) -> None:
        """New columns at the end, their rows gathered."""
        size = self.size + ids.numel()
        self._reserve(size)
        self._ids[self.size : size] = ids
        self._rows[self.size : size] = self.matrix[ids]
        self.column[ids] = torch.arange(self.size, size, device=self.device)
        self.size = size

    def _reserve(self, size: int) -> None:
        """Room for ``size`` columns (at most the vocabulary's) in the buffers: they grow by doubling."""
        size = min(size, self.shortlist.vocab_size)
        if size > self._ids.numel():
            capacity = min(max(size, 2 * self._ids.numel()), self.shortlist.vocab_size)
            grown_ids = torch.empty(capacity, dtype=torch.long, device=self.device)
            grown_rows = torch.empty(capacity, self.matrix.shape[1], dtype=self.dtype, device=self.device)
            grown_ids[: self.size], grown_rows[: self.size] = self._ids[: self.size], self._rows[: self.size]
            self._ids, self._rows = grown_ids, grown_rows

    def _own(self, candidates: list[torch.Tensor], kernels: ModuleType | None = None) -> torch.Tensor:
        """(B, C) float: each sentence's bias row over the current columns."""
        if kernels is not None and self.device.type == "cpu":
            return kernels.own_bias(self.column, self.shortlist.always, candidates, self.size)
        allowed = torch.zeros(len(candidates), self.size, dtype=torch.bool, device=self.device)
        allowed[:, self.column[self.shortlist.always]] = True
        if candidates:
            lengths = torch.tensor([c.numel() for c in candidates], device=self.device)
            sentence = torch.repeat_interleave(torch.arange(len(candidates), device=self.device), lengths)
            allowed[sentence, self.column[torch.cat(candidates)]] = True
        return torch.zeros(allowed.shape, device=self.device).masked_fill_(~allowed, -math.inf)


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
