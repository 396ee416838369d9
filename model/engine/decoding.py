"""Batched beam search (greedy: a beam of one) over a cached, incremental decoder.

A ``DecodeSession`` is a running batch. Sentences join it between decoder steps (``admit``:
the encoder runs once for them and their memory is projected to cross-attention K/V once,
reused by every step and every beam) and leave it at the step they are done (``step``
returns them), so the batch only pays for sentences still being decoded, and a server can
keep it full while requests come and go (continuous batching). Each sentence has its own
start step, positions and length limit; the self-attention keys cached before a sentence
joined are masked out of its rows. ``decode_stream`` is a session given one batch.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from model.engine import fused
from model.engine.beams import Beams, Hypothesis, cat_padded
from model.engine.binding import step_dtype
from model.engine.cache import KVCache, init_cache, moves_of
from model.engine.encoder import EncoderPass
from model.engine.kernels.tables import output_table
from model.engine.options import DecodingOptions
from model.engine.penalties import apply_penalties, penalized
from model.engine.search_ops import SearchOps, search_ops
from model.engine.shortlist import Shortlist, ShortlistColumns, Vocabulary
from model.engine.step import DecoderStep, bound_passes
from model.network.transformer import Transformer


def max_steps(src_lengths: list[int], options: DecodingOptions, cap: int) -> list[int]:
    """Per-sentence limit on generated tokens (EOS included): ceil(a x source length) + b, at
    least 1, at most ``cap`` (and ``options.max_length``). On the host: a handful of tensor
    operations per admission cost more than the arithmetic (one sentence at a time)."""
    if options.max_length is not None:
        cap = min(cap, options.max_length)
    a, b = options.max_length_a, options.max_length_b
    return [min(max(math.ceil(n * a) + b, 1), cap) for n in src_lengths]


@dataclass(frozen=True)
class Decoded:
    """Per sentence its n-best hypotheses (best first), and the most decoder steps any took."""

    hypotheses: list[list[Hypothesis]]
    steps: int


@dataclass(frozen=True)
class Finished:
    """One sentence, done: its tag (what ``admit`` named it; in ``decode_stream`` its row in
    the batch), its n-best, and the decoder steps it took."""

    tag: int
    hypotheses: list[Hypothesis]
    steps: int


def decode_stream(
    model: Transformer,
    src: torch.Tensor,
    options: DecodingOptions,
    shortlist: Shortlist | None = None,
    vocabulary: Vocabulary | None = None,
) -> Iterator[Finished]:
    """src: (B, S) padded ids, each row ending with EOS -> each sentence as soon as it is done
    (the batch goes on decoding the others), in the order they finish. ``vocabulary``: a
    previous session's shortlist columns to take over (``DecodeSession``)."""
    session = DecodeSession(model, options, shortlist, vocabulary)
    if src.shape[0]:
        session.admit(src, range(src.shape[0]))
    while session.active:
        yield from session.step()


def decode(
    model: Transformer, src: torch.Tensor, options: DecodingOptions, shortlist: Shortlist | None = None
) -> Decoded:
    """src: (B, S) padded ids, each row ending with EOS -> n_best hypotheses per sentence."""
    return collect(decode_stream(model, src, options, shortlist), src.shape[0])


def collect(stream: Iterator[Finished], batch_size: int) -> Decoded:
    """Put a stream's sentences back in batch order."""
    hypotheses: list[list[Hypothesis]] = [[] for _ in range(batch_size)]
    steps = 0
    for done in stream:
        hypotheses[done.tag] = done.hypotheses
        steps = max(steps, done.steps)
    return Decoded(hypotheses, steps)


def _compacted(kept: list[int]) -> list[int]:
    """The kept rows (ascending) in an order that moves few: those already in the first
    len(kept) places stay there, and the gaps take the ones from further back."""
    n = len(kept)
    order = list(range(n))
    gaps = sorted(set(order) - set(kept))
    for gap, row in zip(gaps, (i for i in kept if i >= n), strict=True):
        order[gap] = row
    return order


class _SentenceRows:
    """Everything a session keeps per active sentence, in batch order: sentence i is entry i of
    every per-sentence field and rows i*W .. i*W + W - 1 of the per-hypothesis ones (W =
    ``width``: 1 until the batch's first step, then K). Only ``append`` and ``select`` add and
    remove sentences, so the fields cannot fall out of step.

    The start steps are kept twice, on purpose: as a device tensor (``start``) that the step's
    vectorized ops read, and as a host list (``start_host``); the limits (``stop_host``) and
    ``source_lengths`` live on the host only. The session's control flow reads the host lists:
    how many cache positions to forget, whether anyone joined late, how much room a reorder
    leaves, who reached their limit, the source width.
    Reading a device tensor to take a branch costs a device sync (an ``.item()`` or
    ``.tolist()``) every step; the host lists answer min/max without touching the device.

    ``gather`` and ``added`` are what the KV cache owes these rows before the next step: the
    self-attention rows to gather (beam back-pointers, rows of sentences that left dropped;
    None: rows stay in place) and how many rows of sentences that joined since to add.
    """

    def __init__(self, k: int, pad_id: int, device: torch.device) -> None:
        self.tags: list[int] = []  # what ``step`` returns each sentence as
        self.start_host: list[int] = []  # the step each sentence joined at
        self.start = torch.zeros(0, dtype=torch.long, device=device)  # (A,) the same, on the device
        self.stop_host: list[int] = []  # the step each sentence is cut at (its length limit)
        self.source_lengths: list[int] = []  # source tokens (EOS included); host only
        self.memory_mask = torch.zeros(0, 1, 1, 0, dtype=torch.bool, device=device)  # (A, 1, 1, S)
        self.tokens = torch.zeros(0, 1, dtype=torch.long, device=device)  # (A, W) next step's input
        self.beams = Beams(k, pad_id, device)
        self.gather: torch.Tensor | None = None  # (A*W,) cache rows to gather before the next step
        # the same gather as (target, source) row moves, where it is only sentences leaving a greedy
        # batch (no back-pointers): the cache then moves those rows in place (``KVCache.compact``)
        self.moves: list[tuple[int, int]] | None = None
        self.added = 0  # cache rows to add before the next step

    def __len__(self) -> int:
        return len(self.tags)

    @property
    def width(self) -> int:
        """Rows (hypotheses) per sentence: 1 until the batch's first step, then K."""
        return self.tokens.shape[1]

    def row_start(self) -> torch.Tensor:
        """(A*W,) the step each row's sentence joined at (``start`` itself at width 1)."""
        w = self.width
        return self.start.repeat_interleave(w) if w > 1 else self.start

    @property
    def source_width(self) -> int:
        """The longest source (0 when empty)."""
        return max(self.source_lengths, default=0)

    def append(
        self,
        tags: Sequence[int],
        step: int,
        stop: list[int],
        source_lengths: list[int],
        mask: torch.Tensor,
        bos_id: int,
    ) -> None:
        """Sentences join at ``step``: stop (B) the step each is cut at, mask (B, 1, 1, S)."""
        b, w, first = len(tags), self.width, not self.tags  # (first: nothing to stack behind)
        self.tags.extend(tags)
        self.start_host.extend([step] * b)
        start, tokens = self.start.new_full((b,), step), self.tokens.new_full((b, w), bos_id)
        self.start = start if first else torch.cat([self.start, start])
        self.stop_host.extend(stop)
        self.source_lengths.extend(source_lengths)
        self.memory_mask = mask if first else cat_padded(self.memory_mask, mask, dim=3)
        self.tokens = tokens if first else torch.cat([self.tokens, tokens])
        self.beams.extend(b, max(stop, default=step) - step)  # room for the longest limit

    def cut(self, sentences: list[int], step: int) -> None:
        """These sentences stop at ``step`` at the latest."""
        for i in sentences:
            self.stop_host[i] = min(self.stop_host[i], step)

    def select(self, kept: list[int], keep: torch.Tensor) -> None:
        """Only sentences ``kept`` stay, in that order (keep: (A',), the same on the device);
        the memory mask narrows to the longest source left, and the cache rows to gather
        follow the sentences."""
        a, w = len(self.tags), self.width
        in_place = self.gather is None and w == 1
        self.moves = moves_of(kept) if in_place else None
        self.tags = [self.tags[i] for i in kept]
        self.start_host = [self.start_host[i] for i in kept]
        self.stop_host = [self.stop_host[i] for i in kept]
        self.source_lengths = [self.source_lengths[i] for i in kept]
        self.gather = keep if self.gather is None else self.gather.view(a, w)[keep].reshape(-1)
        self.memory_mask = self.memory_mask[keep, :, :, : self.source_width]
        self.start = self.start[keep]
        self.tokens = self.tokens[keep]
        self.beams.keep(keep)


class DecodeSession:
    """A running batch of beam searches (top-k over beam x vocabulary, GNMT length
    normalization) that sentences join and leave between steps.

    Finished hypotheses stay in the beam, extended only by PAD at no cost, so candidates of
    different lengths compete on normalized score; a sentence is done (and returned by
    ``step``) when all its beams are finished or truncated at its length limit. Greedy search
    is the beam of one. Model work only; the caller decides who joins when.

    The per-sentence state is one ``_SentenceRows``; ``step`` runs in phases: ``_sync_cache``
    (pending reorder, joined rows, forgotten positions), ``_mask_late_joiners``, ``_decode``
    (decoder step, beam advance, truncation), ``_harvest`` (the finished sentences) and
    ``_compact`` (the others close the gaps).

    With a ``shortlist`` (``model.engine.shortlist``) each row scores only its sentence's candidates:
    the ``always`` columns every sentence shares and its own beyond them (``shortlist.Vocabulary``),
    and the beams map the chosen columns back to token ids.
    """

    def __init__(
        self,
        model: Transformer,
        options: DecodingOptions,
        shortlist: Shortlist | None = None,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        """``vocabulary``: the shortlist's columns of the model's previous session, taken over
        (``Vocabulary.claim``) instead of made anew."""
        if shortlist is not None and shortlist.vocab_size != model.config.tgt_vocab_size:
            vocab = model.config.tgt_vocab_size
            raise ValueError(f"shortlist of {shortlist.vocab_size} pieces for a vocabulary of {vocab}")
        if shortlist is not None and model.output_bias is not None:
            raise ValueError("a shortlist scores the output projection's rows without a bias; this model has one")
        # the output projection's rows the shortlist's columns gather
        self._table = None if shortlist is None else output_table(model)
        if shortlist is not None and self._table is None:
            raise ValueError("a shortlist needs the output matrix's rows (this model's packed copy does not give them)")
        self.model, self.options, self.k = model, options, options.beam_size
        self.shortlist = shortlist
        self._passes: tuple[EncoderPass, DecoderStep] | None = None  # bound at first use, in inference mode
        device = model.device
        kernels = fused.load(model.fused_step) if device.type == "cpu" else None  # (never built for another device)
        # the beams' update, the shortlist's candidates and the cache's row copy (``model.engine.search_ops``)
        self._search: SearchOps = search_ops(kernels, device)
        self._vocab: Vocabulary | None = None  # with a shortlist: what the steps score, from the first admission
        if vocabulary is not None and shortlist is not None:
            vocabulary.claim(self)
            self._vocab = vocabulary
        self._reset()

    def _reset(self) -> None:
        """Empty: the state of a new session."""
        self.steps = 0  # decoder steps run since the session was last empty
        self._cache: KVCache | None = None
        device = self.model.device
        self._rows = _SentenceRows(self.k, self.model.config.pad_id, device)
        vocab = self._own_vocab()
        if vocab is not None:
            vocab.clear()  # kept across resets: the always-candidates' rows are gathered once
        self._vocab = vocab

    @property
    def active(self) -> int:
        """Sentences being decoded."""
        return len(self._rows)

    @property
    def tags(self) -> list[int]:
        """The active sentences' tags, in batch order (a copy)."""
        return list(self._rows.tags)

    @property
    def source_width(self) -> int:
        """Padded source length of the batch (0 when empty)."""
        return self._rows.source_width

    @torch.inference_mode()
    def admit(self, src: torch.Tensor, tags: Sequence[int]) -> None:
        """src: (B, S) padded ids, each row ending with EOS; ``tags`` (B) name the sentences in
        what ``step`` returns. They start decoding at the next step."""
        if len(tags) != src.shape[0]:
            raise ValueError(f"{len(tags)} tags for {src.shape[0]} sentences")
        model, cfg, rows = self.model, self.model.config, self._rows
        encoder, decoder = self._bound()
        memory, mask = encoder(src)  # (B, S, D), (B, 1, 1, S)
        cross_kv = decoder.project_memory(memory, mask)  # the tokens alone
        src_lengths = mask.sum(dim=(1, 2, 3)).tolist()
        limit = max_steps(src_lengths, self.options, cfg.max_tokens)
        if self._cache is None:  # one row per sentence, widened to K by the first step
            self._cache = init_cache(model, memory, max(limit), cross_kv)
        else:
            self._cache.extend_memory(cross_kv)
            rows.added += src.shape[0] * rows.width
        rows.append(tags, self.steps, [self.steps + n for n in limit], src_lengths, mask, cfg.bos_id)
        if self.shortlist is not None and self._table is not None:
            vocab = self._own_vocab()
            if vocab is None:  # the first admission, or a later session took the columns over
                vocab = self._vocab = Vocabulary(self.shortlist, self._table, step_dtype(model))
                vocab.claim(self)
            candidates = self._search.candidates(self.shortlist, src, mask[:, 0, 0])  # padding is no piece
            vocab.join(candidates)
        assert self._cache.source_length >= rows.source_width

    @torch.inference_mode()
    def cancel(self, tags: Collection[int]) -> int:
        """Cut these sentences at the next step: they leave the batch then (their rows freed),
        returned as unfinished hypotheses that the caller drops. -> how many were active."""
        sentences = [i for i, tag in enumerate(self._rows.tags) if tag in tags]
        self._rows.cut(sentences, self.steps + 1)
        return len(sentences)

    @torch.inference_mode()
    def step(self) -> list[Finished]:
        """One decoder step for every active sentence -> the sentences done at this step."""
        if not self._rows:
            return []
        cache = self._cache
        assert cache is not None
        origin = self._sync_cache(cache)
        self_mask, positions = self._mask_late_joiners(cache, origin)
        self._decode(cache, self_mask, positions)
        finished, out = self._harvest()
        if finished:
            self._compact(cache, finished)
        return out

    def _sync_cache(self, cache: KVCache) -> int:
        """Bring the cache's self-attention rows in line with the sentences: gather the pending
        rows (beam back-pointers, sentences that left), add the rows of those that joined, and
        forget positions from before the earliest active sentence joined, in one copy.
        -> the step of the cache's first position."""
        rows = self._rows
        origin = self.steps - cache.length
        drop = min(rows.start_host) - origin  # positions no active sentence can see
        if rows.moves is not None and not rows.added and drop == 0:  # greedy rows left: the rest stay in place
            cache.compact(rows.moves, len(rows), max(rows.stop_host) - origin)
            rows.gather, rows.moves = None, None
        elif rows.gather is not None or rows.added or drop > 0:
            gather = rows.gather
            if gather is None:  # rows in place, sentences joined or positions to forget
                gather = torch.arange(cache.batch_size, device=rows.start.device)
            origin += drop
            capacity = max(rows.stop_host) - origin  # the positions the longest-lived row needs
            room = 1 if self.k > 1 else None  # beams reorder every step (one more slot); greedy rows grow
            first, copy = None, self._search.gather_rows
            defer = copy is not None and self._bound()[1].ops.takes_reorder  # (``LayerOps.takes_reorder``)
            if defer and max(rows.start_host) > origin:
                # rows that joined after the cache's first position copy only their own positions:
                # the fused attention never reads the others (its mask hides them)
                first = (rows.row_start() - origin).clamp_(min=0)
            # on the fused kernels each layer's attention does its copy in the step (``defer``)
            cache.reorder(
                gather, room, drop, rows.added, capacity, width=rows.width, gather=copy, first=first, defer=defer
            )
            rows.gather, rows.moves, rows.added = None, None, 0
        return origin

    def _mask_late_joiners(self, cache: KVCache, origin: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """-> self-attention mask (R, 1, 1, L+1) hiding the cached keys from before a row's
        sentence joined, and each row's position (R,); None, None when every row sees the
        whole cache, at position ``cache.length`` (nobody joined after its first position)."""
        rows = self._rows
        if max(rows.start_host) <= origin:
            return None, None
        start = rows.row_start()  # (R,)
        keys = origin + torch.arange(cache.length + 1, device=start.device)
        self_mask = (keys[None, :] >= start[:, None])[:, None, None, :]  # (R, 1, 1, L+1)
        return self_mask, self.steps - start

    def _decode(self, cache: KVCache, self_mask: torch.Tensor | None, positions: torch.Tensor | None) -> None:
        """The decoder step and the beams' advance; hypotheses at their sentence's length limit
        are truncated (finished)."""
        rows, alpha = self._rows, self.options.length_penalty
        a, w = len(rows), rows.width
        _, decoder = self._bound()
        vocab = self._own_vocab()
        assert vocab is not None or self.shortlist is None, "the session's shortlist columns were taken over"
        tokens = rows.tokens.reshape(-1)
        computed, logits_rows = self._rows_to_compute(decoder)
        if computed is not None:  # joiners' copies left out
            tokens = tokens[computed]
            positions = None if positions is None else positions[computed]
            self_mask = None if self_mask is None else self_mask[computed]
        step_in = (tokens, cache, rows.memory_mask, positions, self_mask)
        columns = None if vocab is None else vocab.columns()  # each sentence's own candidates only
        own = None  # with a shortlist: each row's logits over its sentence's own columns
        if columns is None:
            logits = decoder(*step_in, rows=computed)
        else:
            logits, own = decoder.shortlisted(*step_in[:3], columns, *step_in[3:], rows=computed)
            own = own if own.dtype == torch.float32 else own.float()
        if logits.dtype != torch.float32:
            logits = logits.float()
        beams = rows.beams
        if penalized(self.options):
            self._penalize(logits, computed, columns, own)
        eos = self.model.config.eos_id
        scored = logits if computed is not None else logits.view(a, w, -1)
        own = own if own is None or computed is not None else own.view(a, w, -1)
        search = self._search
        back, tokens = search.advance(beams, scored, rows.start, self.steps, alpha, eos, columns, own, logits_rows)
        self.steps += 1
        truncated = [i for i, stop in enumerate(rows.stop_host) if stop <= self.steps]  # at the limit
        if truncated:
            beams.truncate(truncated)
        rows.tokens = tokens  # (A, K): every sentence has K rows from now on
        if back is not None:  # greedy rows stay in place
            rows.gather = back

    def _penalize(
        self,
        logits: torch.Tensor,
        computed: torch.Tensor | None,
        columns: ShortlistColumns | None = None,
        own: torch.Tensor | None = None,
    ) -> None:
        """The repetition options on this step's logits, in place: (R, V) by piece id, or with a
        shortlist's ``columns`` (R, N) over its ``always`` columns and ``own`` (R, E) over each
        row's sentence's own (``penalties.apply_penalties``); each computed row's hypothesis's
        pieces so far (``Beams.history``, by the steps since its sentence joined)."""
        rows, beams = self._rows, self._rows.beams
        a, w = len(rows), rows.width
        index = torch.arange(a * w, device=logits.device) if computed is None else computed
        generated = self.steps - rows.row_start()  # (A*W,)
        width = int(max(self.steps - s for s in rows.start_host))
        history = beams.history[:, :w, :width].reshape(a * w, width)
        if columns is None:
            apply_penalties(logits.view(-1, logits.shape[-1]), history[index], generated[index], self.options)
            return
        assert own is not None  # (R, N) and (R, E)
        apply_penalties(logits, history[index], generated[index], self.options, columns, own, index // w)

    def _rows_to_compute(self, decoder: DecoderStep) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """The rows this step computes where sentences joined the running beam batch since its
        last step: (R',) every row but a joiner's K - 1 copies of its first (a sentence joins with
        K identical rows, the copies at -inf, and all K of its next hypotheses extend the first
        row: its copies' keys and values at this position are never read), and for the beams'
        advance each row's logits row (A*K,), -1 for a copy. Computing the copies made a
        continuously fed beam batch decode more rows than sorted batches
        (docs/benchmarks/log/2026-11-29.md#a-joiners-first-step-on-one-row). (None, None): every
        row (no joiner, greedy search, the batch's first step at one row a sentence, or a step or an
        advance that takes every row: ``LayerOps.computes_some_rows``, ``SearchOps.advances_some_rows``)."""
        rows = self._rows
        w, now = rows.width, self.steps
        takes_some = decoder.ops.computes_some_rows and self._search.advances_some_rows
        if w == 1 or not takes_some or max(rows.start_host) < now:
            return None, None
        computed: list[int] = []
        logits_rows: list[int] = []
        for i, start in enumerate(rows.start_host):
            if start == now:  # joined since the last step: its first row only
                logits_rows.append(len(computed))
                logits_rows.extend([-1] * (w - 1))
                computed.append(i * w)
            else:
                logits_rows.extend(range(len(computed), len(computed) + w))
                computed.extend(range(i * w, i * w + w))
        device = rows.start.device
        return torch.tensor(computed, device=device), torch.tensor(logits_rows, device=device)

    def _bound(self) -> tuple[EncoderPass, DecoderStep]:
        """The model's encoder pass and decoder step (``step.bound_passes``), from the first use on."""
        if self._passes is None:
            self._passes = bound_passes(self.model)
        return self._passes

    def _own_vocab(self) -> Vocabulary | None:
        """The shortlist's columns while this session holds them (``Vocabulary.claim``)."""
        return self._vocab if self._vocab is not None and self._vocab.owner() is self else None

    def _harvest(self) -> tuple[list[int], list[Finished]]:
        """-> the sentences whose beams are all finished (their places in the batch) and them."""
        rows = self._rows
        finished = rows.beams.done_sentences()
        if not finished:
            return [], []
        n_best, alpha = self.options.n_best, self.options.length_penalty
        hypotheses = rows.beams.hypotheses(finished, n_best, alpha)
        out = [
            Finished(rows.tags[i], best, self.steps - rows.start_host[i])
            for i, best in zip(finished, hypotheses, strict=True)
        ]
        return finished, out

    def _compact(self, cache: KVCache, finished: list[int]) -> None:
        """The finished sentences leave: the others close the gaps (see ``_compacted``), and
        the encoder memory narrows to the longest source left."""
        rows = self._rows
        a = len(rows)
        if len(finished) == a:
            self._reset()
            return
        gone = set(finished)
        kept = _compacted([i for i in range(a) if i not in gone])
        keep = torch.tensor(kept, device=rows.start.device)
        columns = rows.memory_mask.shape[3]
        rows.select(kept, keep)
        vocab = self._own_vocab()
        if vocab is not None:
            vocab.leave(kept)
        width = rows.source_width
        cache.select_memory(kept, width if width < columns else None)
