"""A lexical shortlist: the target pieces worth scoring for a source sentence, so a decoder
step projects onto a few thousand rows of the output matrix instead of the whole vocabulary
(at one sentence the output projection is a large share of the bytes a step reads:
docs/benchmarks/README.md#shortlist).

The candidates of a sentence are the specials, the ``frequent`` most common target pieces of
the training data, the source's own pieces (names and numbers are copied through the joint
vocabulary), and for each source piece the ``per_source`` target pieces most associated with it
in the training pairs (Dice coefficient of co-occurrence in a sentence pair), as Marian's and
CTranslate2's vocabulary shortlists do with word alignments. Each row of a decoding session
scores ``always`` and its own sentence's other candidates, nothing else (``Vocabulary``), so a
sentence's translation does not depend on its batch; it is an approximation all the same:
a token the model would choose that is outside a sentence's candidates cannot be chosen (and
log-probabilities are normalized over its candidates). The parameters were chosen per direction
on the validation split, never on test (docs/benchmarks/README.md#shortlist).

``model.training.shortlists`` builds it from a checkpoint's training data;
``model.engine.loading.load_shortlist`` reads it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from model.engine.kernels.tables import TokenTable

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
        tensor operations, not a loop over pieces). The fused kernels compute the same lists in
        one call (``model.engine.search_ops.FusedSearchOps.candidates``)."""
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
        mark = torch.zeros(b, v, dtype=torch.bool, device=device)  # (sentence, piece): a candidate
        mark[sentence, pieces] = True
        mark[owner, targets] = True
        found = mark.nonzero()  # (N, 2) by sentence, then id (no sort: unique() sorts, which costs more)
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


@dataclass(frozen=True)
class ShortlistColumns:
    """What a decoder step scores with a shortlist (``Vocabulary.columns``): the ``always`` columns
    every sentence shares, then each sentence's own, those of its candidates beyond ``always``.
    A step's logits are (R, N + E): columns [0, N) the tokens ``always`` for every row, and column
    N + j of a row of sentence i the token ``extra_ids[first + j]`` for j < count, (first, count)
    = ``spans[i]``, no candidate after (-inf). Each row thus scores its own candidates alone (about
    2,100 of them on test_2016, where the union of 64 sentences' has ~4,000 columns).

    always (N,) ids; always_rows (N, D) their rows of the output matrix, and ``panels`` the same
    packed for the fused kernels; extra_ids (T,) and extra_rows (T, D) every active sentence's own
    ids and rows laid end to end (with unused ones between), spans (A, 2) int64, width E the
    largest count."""

    always: torch.Tensor
    always_rows: torch.Tensor
    panels: Callable[[ModuleType], torch.Tensor]
    extra_ids: torch.Tensor
    extra_rows: torch.Tensor
    spans: torch.Tensor
    width: int

    @functools.cached_property
    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sentence's own columns as (A, E) indices into ``extra_ids`` and ``extra_rows`` (0
        past its count) and (A, E) bool, true where a column is its own: for the tensor
        operations' path (``DecoderStep``, ``Beams.advance``), made once per change."""
        j = torch.arange(self.width, device=self.spans.device)
        own = j < self.spans[:, 1:]
        return torch.where(own, self.spans[:, :1] + j, 0), own

    @functools.cached_property
    def padded_rows(self) -> torch.Tensor:
        """(A, E, D) each sentence's own rows, zeros past its count, in ``always_rows``' dtype:
        the tensor operations' batched product (``DecoderStep``), made once per change."""
        return self.extra_rows[self.padded[0]].to(self.always_rows.dtype)

    @functools.cached_property
    def always_column(self) -> torch.Tensor:
        """(max(always) + 1,) int64: each piece's column among ``always``, -1 for a piece not in
        it (pieces past the end are in none), made once per change (``column_of``)."""
        size = int(self.always.max()) + 1 if self.always.numel() else 0
        lookup = torch.full((size,), -1, dtype=torch.long, device=self.always.device)
        lookup[self.always] = torch.arange(self.always.numel(), device=self.always.device)
        return lookup

    @functools.cached_property
    def own_ids(self) -> torch.Tensor:
        """(A, E) int64: each sentence's own ids by column, -1 past its count, made once per change."""
        index, own = self.padded
        return torch.where(own, self.extra_ids[index], -1)

    def column_of(self, sentence: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sentence (M,) a sentence's place in ``spans`` and ids (M,) a piece of it -> (M,) the
        piece's column in that sentence's rows: c < N the ``always`` column c, N + j its own
        column j, -1 for a piece that is neither (a row never scores it)."""
        lookup, n = self.always_column, self.always.numel()
        inside = ids < lookup.numel()
        column = torch.where(inside, lookup[torch.where(inside, ids, 0)], -1) if n else torch.full_like(ids, -1)
        rest = (column < 0).nonzero()[:, 0]
        if rest.numel() and self.width:  # the others: among the sentence's own ids
            match = self.own_ids[sentence[rest]] == ids[rest, None]  # (M', E)
            found = match.any(dim=1)
            column[rest] = torch.where(found, n + match.long().argmax(dim=1), -1)
        return column


class Vocabulary:
    """A decoding session's shortlist columns (``ShortlistColumns``): the rows of the output
    matrix for ``always``, gathered once (and packed once for the fused kernels), and each active
    sentence's own candidates beyond them, their rows gathered when it joins and laid end to end
    in a buffer that grows by doubling and is compacted when it runs out of room. Sentences keep
    the session's batch order: ``join`` adds them behind the others, ``leave`` keeps the ones
    that stay, in their new order, without moving their rows.

    Before, the columns were the union of the active sentences' candidates, every row scoring
    every sentence's columns (a -inf bias kept each to its own), far more columns a row than its
    own in a large batch, and in a continuously fed batch the columns of sentences that had left
    lingered until a remake paid (docs/benchmarks/README.md#shortlist)."""

    def __init__(self, shortlist: Shortlist, table: TokenTable, dtype: torch.dtype) -> None:
        """table: the output projection's rows (V, D) (``tables.output_table``: its float rows, or
        the packed copy that holds them); its rows are scored in ``dtype``."""
        self.shortlist = shortlist.to(table.data.device)
        self.table, self.dtype, self.device = table, dtype, table.data.device
        self.is_always = torch.zeros(shortlist.vocab_size, dtype=torch.bool, device=self.device)
        self.is_always[self.shortlist.always] = True
        self.always_rows = table(self.shortlist.always).to(dtype)  # (N, D)
        self._panels: torch.Tensor | None = None
        self.owner: Callable[[], object] = lambda: None  # the session using it (``claim``)
        # the sentences' own rows stay in float16 where the matrix is (the shipped ones: exact), read
        # by the fused kernels at half the bytes (``span_logits`` is bound by them)
        self.rows_dtype = torch.float16 if table.data.dtype == torch.float16 and dtype == torch.float32 else dtype
        self._ids = torch.empty(0, dtype=torch.long, device=self.device)  # (capacity,) own ids laid end to end
        self._rows = torch.empty(0, table.width, dtype=self.rows_dtype, device=self.device)  # (capacity, D)
        self.end = 0  # the first unused place in the buffers
        self.first: list[int] = []  # each active sentence's first place, in batch order
        self.count: list[int] = []  # and how many it has
        self.compacted = 0  # how many times the buffers were compacted or grown (tests read it)
        self._columns: ShortlistColumns | None = None

    @property
    def sentences(self) -> int:
        return len(self.first)

    @torch.inference_mode()
    def panels(self, kernels: ModuleType) -> torch.Tensor:
        """``always_rows`` packed into the fused kernels' panels (``pack_panels``' layout: (ceil(N /
        w), D, w), the last panel padded with zeros), for ``panel_product`` over the N columns:
        packed once. float32 rows only."""
        width = kernels.panel_width()
        if self._panels is None or self._panels.shape[2] != width:
            self._panels = kernels.pack_panels(self.always_rows.contiguous())
        return self._panels

    def columns(self) -> ShortlistColumns:
        """What the next decoder step scores (made once per change of the sentences)."""
        if self._columns is None:
            spans = torch.tensor([self.first, self.count], dtype=torch.long).T.contiguous().to(self.device)
            width = max(self.count, default=0)
            always = self.shortlist.always
            self._columns = ShortlistColumns(always, self.always_rows, self.panels, self._ids, self._rows, spans, width)
        return self._columns

    @property
    def in_use(self) -> bool:
        """A live session holds it with sentences being decoded (so it cannot be handed on)."""
        return self.owner() is not None and bool(self.first)

    def claim(self, session: object) -> None:
        """A new session takes it over (a model's sessions come one after another: the
        always-candidates' rows are gathered once, not by every session) and empties it
        (``clear``) as it starts; the session that had it must make its own from then on (``owner``)."""
        self.owner = weakref.ref(session)

    # Places a session's buffers keep once it ends (64 sentences' worth); a larger batch's are let go.
    KEPT = 8192

    def clear(self) -> None:
        """Every sentence left (a session that emptied)."""
        self.first, self.count, self.end, self._columns = [], [], 0, None
        if self._ids.numel() > self.KEPT:
            self._ids, self._rows = self._ids[: self.KEPT].clone(), self._rows[: self.KEPT].clone()

    @torch.inference_mode()
    def join(self, candidates: list[torch.Tensor]) -> None:
        """Sentences join, behind the others: each one's candidates (unique ids)."""
        if not candidates:
            return
        lengths = [c.numel() for c in candidates]
        flat = torch.cat(candidates)
        own = ~self.is_always[flat]
        sentence = torch.repeat_interleave(torch.arange(len(candidates)), torch.tensor(lengths)).to(self.device)
        counts = torch.zeros(len(candidates), dtype=torch.long, device=self.device).index_add_(0, sentence, own.long())
        ids = flat[own]
        n = ids.numel()
        if self.end + n > self._ids.numel():
            self._make_room(n)
        self._ids[self.end : self.end + n] = ids
        self._rows[self.end : self.end + n] = self.table(ids)
        for count in counts.tolist():
            self.first.append(self.end)
            self.count.append(count)
            self.end += count
        self._columns = None

    def leave(self, kept: list[int]) -> None:
        """Only the sentences ``kept`` stay, in that order; the others' places are free."""
        self.first = [self.first[i] for i in kept]
        self.count = [self.count[i] for i in kept]
        if not kept:
            self.end = 0
        self._columns = None

    def _make_room(self, n: int) -> None:
        """Room for ``n`` more places after ``end``: the active sentences' rows moved to the front
        (in batch order), into buffers twice what they and the ``n`` need when these are too small."""
        live = sum(self.count)
        capacity = self._ids.numel()
        if live + n > capacity // 2:
            capacity = max(2 * (live + n), 1024)
        index = torch.cat([torch.arange(f, f + c) for f, c in zip(self.first, self.count, strict=True)] or
                          [torch.empty(0, dtype=torch.long)]).to(self.device)  # fmt: skip
        ids, rows = self._ids[index], self._rows[index]
        if capacity != self._ids.numel():
            self._ids = torch.empty(capacity, dtype=torch.long, device=self.device)
            self._rows = torch.empty(capacity, self.table.width, dtype=self.rows_dtype, device=self.device)
        self._ids[:live], self._rows[:live] = ids, rows
        self.first = list(itertools.accumulate([0, *self.count[:-1]])) if self.count else []
        self.end = live
        self.compacted += 1
