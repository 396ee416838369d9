"""Batched greedy and beam search over a cached, incremental decoder.

The encoder runs once per batch; its memory is projected to cross-attention K/V once and
reused by every step and every beam. Sentences that finish leave the batch, so the last
steps of a batch only pay for the sentences still being decoded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from model.cache import KVCache
from model.transformer import Transformer


@dataclass(frozen=True)
class DecodingOptions:
    """How to decode. ``beam_size`` 1 with ``n_best`` 1 is greedy search.

    The number of generated tokens (EOS included) is at most
    ``min(ceil(max_length_a * source_tokens + max_length_b), max_length, model cap)``;
    a hypothesis that reaches it without EOS is returned with ``finished=False``.
    ``length_penalty`` is GNMT's alpha: scores are log P / ((5 + length) / 6) ** alpha.
    """

    beam_size: int = 4
    n_best: int = 1
    length_penalty: float = 0.6
    max_length_a: float = 1.5
    max_length_b: int = 10
    max_length: int | None = None

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError("beam_size must be >= 1")
        if not 1 <= self.n_best <= self.beam_size:
            raise ValueError("n_best must be between 1 and beam_size")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError("max_length must be >= 1")
        if self.length_penalty < 0 or self.max_length_a < 0 or self.max_length_b < 0:
            raise ValueError("length_penalty, max_length_a and max_length_b must be >= 0")


@dataclass(frozen=True)
class Hypothesis:
    """One output sequence. ``ids`` exclude BOS and EOS; ``score`` is length-normalized."""

    ids: tuple[int, ...]
    score: float
    log_prob: float
    finished: bool


def max_steps(src_lengths: torch.Tensor, options: DecodingOptions, cap: int) -> torch.Tensor:
    """Per-sentence limit on generated tokens (EOS included). src_lengths: (B,) -> (B,)."""
    limit = torch.ceil(src_lengths.double() * options.max_length_a).long() + options.max_length_b
    if options.max_length is not None:
        cap = min(cap, options.max_length)
    return limit.clamp(min=1, max=cap)


# top_k splits each row into blocks of this many scores (see there).
TOP_K_BLOCK = 64


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row and their columns, best first. x: (R, V) -> (R, k), (R, k).

    ``torch.topk`` over an 8,000-way row took ~5 us per row on the CPU (and ``argmax`` ~3 us),
    against ~0.2 us for a row's ``amax``. So rows are cut into blocks of ``TOP_K_BLOCK``: the k
    blocks with the largest maxima hold the k largest values (any value outside them is beaten
    by k block maxima), and ``topk`` only ranks those k blocks' scores (3-4x faster overall;
    ties between equal values may break differently from ``torch.topk``). Other devices,
    and rows too short for it to pay off, use ``torch.topk``.
    """
    r, v = x.shape
    blocks, tail = divmod(v, TOP_K_BLOCK)
    if x.device.type != "cpu" or blocks < 4 * k:
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


@dataclass(frozen=True)
class Decoded:
    """Per sentence its n-best hypotheses (best first), and the decoder steps the batch took."""

    hypotheses: list[list[Hypothesis]]
    steps: int


@dataclass(frozen=True)
class Finished:
    """One sentence of a batch, done: its row in the batch, its n-best, and the decoder steps
    the batch had run when it finished."""

    index: int
    hypotheses: list[Hypothesis]
    steps: int


def decode_stream(model: Transformer, src: torch.Tensor, options: DecodingOptions) -> Iterator[Finished]:
    """src: (B, S) padded ids, each row ending with EOS -> each sentence as soon as it is done
    (the batch goes on decoding the others), in the order they finish."""
    if src.shape[0] == 0:
        return iter(())
    if options.beam_size == 1:
        return greedy_stream(model, src, options)
    return beam_stream(model, src, options)


def decode(model: Transformer, src: torch.Tensor, options: DecodingOptions) -> Decoded:
    """src: (B, S) padded ids, each row ending with EOS -> n_best hypotheses per sentence."""
    return collect(decode_stream(model, src, options), src.shape[0])


def greedy_search(model: Transformer, src: torch.Tensor, options: DecodingOptions) -> Decoded:
    """Batched greedy decoding (``greedy_stream``, collected)."""
    return collect(greedy_stream(model, src, options), src.shape[0])


def beam_search(model: Transformer, src: torch.Tensor, options: DecodingOptions) -> Decoded:
    """Batched beam search (``beam_stream``, collected)."""
    return collect(beam_stream(model, src, options), src.shape[0])


def collect(stream: Iterator[Finished], batch_size: int) -> Decoded:
    """Put a stream's sentences back in batch order."""
    hypotheses: list[list[Hypothesis]] = [[] for _ in range(batch_size)]
    steps = 0
    for done in stream:
        hypotheses[done.index] = done.hypotheses
        steps = max(steps, done.steps)
    return Decoded(hypotheses, steps)


class _Batch:
    """Decoding state shared by greedy and beam search: cache, mask and the active sentences.

    Each active sentence owns ``width`` consecutive cache rows (its hypotheses); its encoder
    memory and mask are stored once and shared by those rows.
    """

    def __init__(self, model: Transformer, src: torch.Tensor, options: DecodingOptions, width: int):
        cfg = model.config
        memory, self.mask, _ = model.encode(src)  # (B, S, D), (B, 1, 1, S)
        src_lengths = self.mask.sum(dim=(1, 2, 3))
        self.limit = max_steps(src_lengths, options, cfg.max_positions - 1)  # (B,)
        self.capacity = int(self.limit.max())
        self.cache: KVCache = model.init_cache(memory, self.capacity, width)
        self.alive = torch.arange(src.shape[0], device=src.device)  # sentence ids still decoding
        self.model = model

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (R,) last ids of the live rows -> next-token logits (R, V) as float32."""
        return self.model.decode_step(tokens, self.cache, self.mask).float()

    def keep(self, keep: torch.Tensor, rows: torch.Tensor, room: int | None = None) -> None:
        """Keep the active sentences at positions ``keep`` (A',) of the active set; their cache
        rows become ``rows`` (A' * width,) of the current ones (beam back-pointers included)."""
        self.cache.reorder(rows, room)
        self.cache.select_memory(keep)
        self.mask = self.mask.index_select(0, keep)
        self.alive = self.alive[keep]


@torch.inference_mode()
def greedy_stream(model: Transformer, src: torch.Tensor, options: DecodingOptions) -> Iterator[Finished]:
    """Batched greedy decoding; sentences leave the batch (and are yielded) when they emit EOS."""
    cfg = model.config
    b = src.shape[0]
    state = _Batch(model, src, options, width=1)
    out = torch.full((b, state.capacity), cfg.pad_id, dtype=torch.long, device=src.device)
    log_prob = torch.zeros(b, device=src.device)
    length = torch.zeros(b, dtype=torch.long, device=src.device)
    finished = torch.zeros(b, dtype=torch.bool, device=src.device)
    tokens = torch.full((b,), cfg.bos_id, dtype=torch.long, device=src.device)
    for step in range(state.capacity):
        logp = torch.log_softmax(state.step(tokens), dim=-1)  # (A, V)
        step_logp, best = top_k(logp, 1)
        step_logp, tokens = step_logp[:, 0], best[:, 0]  # (A,)
        ids = state.alive
        out[ids, step] = tokens
        log_prob[ids] += step_logp
        length[ids] += 1
        eos = tokens == cfg.eos_id
        finished[ids] = eos
        done = eos | (state.limit[ids] <= step + 1)
        if not bool(done.any()):
            continue
        for i in ids[done].tolist():
            score = float(log_prob[i] / length_penalty(length[i], options.length_penalty))
            hyp = _hypothesis(out[i], int(length[i]), score, float(log_prob[i]), bool(finished[i]))
            yield Finished(i, [hyp], step + 1)
        if bool(done.all()):
            return
        keep = (~done).nonzero()[:, 0]
        state.keep(keep, keep)
        tokens = tokens[keep]


def _hypothesis(row: torch.Tensor, length: int, score: float, log_prob: float, finished: bool) -> Hypothesis:
    """row: (capacity,) generated ids; drop the EOS of a finished hypothesis."""
    n = length - 1 if finished else length
    return Hypothesis(tuple(row[:n].tolist()), score, log_prob, finished)


class _Beams:
    """Up to K hypotheses per active sentence: raw log-probabilities, lengths, flags and tokens.

    Every sentence starts with one hypothesis (BOS), so the first step runs one row per
    sentence instead of K identical ones; from the second step on there are K.
    """

    def __init__(self, b: int, k: int, capacity: int, pad_id: int, device: torch.device) -> None:
        self.k, self.pad_id = k, pad_id
        self.scores = torch.zeros(b, 1, device=device)  # raw cumulative log P, (A, W)
        self.length = torch.zeros(b, 1, dtype=torch.long, device=device)  # tokens, EOS included
        self.finished = torch.zeros(b, 1, dtype=torch.bool, device=device)
        self.eos = torch.zeros(b, 1, dtype=torch.bool, device=device)  # finished by EOS (not truncated)
        self.history = torch.full((b, 1, capacity), pad_id, dtype=torch.long, device=device)
        # a finished hypothesis's K candidates: its score once (the PAD continuation), then nothing
        self.only_first = torch.full((k,), -math.inf, device=device)
        self.only_first[0] = 0.0

    def advance(self, logits: torch.Tensor, step: int, alpha: float, eos_id: int) -> torch.Tensor:
        """logits: (A, W, V) float32 next-token logits -> back-pointer rows (A*K,).

        Every alive hypothesis has step+1 tokens after this step, so all alive candidates share
        one length penalty and rank by raw log P; a finished hypothesis competes through its
        single (PAD) continuation, its normalized score mapped into that raw scale. The K best
        of a sentence's W x V candidates are among the K best of each of its W rows, so each row
        is cut to K first (``top_k``) and only the sentence's W x K survivors are ranked.
        """
        a, w, vocab = logits.shape
        k = self.k
        logp, tok = top_k(torch.log_softmax(logits, dim=-1).view(a * w, vocab), k)
        candidates = logp.view(a, w, k) + self.scores[..., None]  # raw log P, (A, W, K)
        scale = float(length_penalty(torch.tensor(step + 1), alpha))
        done = (self.scores / length_penalty(self.length, alpha) * scale)[..., None]  # (A, W, 1)
        finished = self.finished[..., None]
        candidates = torch.where(finished, done + self.only_first, candidates)
        tok = torch.where(finished, self.pad_id, tok.view(a, w, k))
        raw, flat = candidates.view(a, w * k).topk(k, dim=-1)  # (A, K), best first
        beam, tok = flat // k, tok.view(a, w * k).gather(1, flat)
        was_finished = self.finished.gather(1, beam)
        self.scores = torch.where(was_finished, self.scores.gather(1, beam), raw)
        self.length = torch.where(was_finished, self.length.gather(1, beam), step + 1)
        self.eos = self.eos.gather(1, beam) | (~was_finished & (tok == eos_id))
        self.finished = was_finished | self.eos
        self.history = self.history.gather(1, beam[..., None].expand(-1, -1, self.history.shape[2]))
        self.history[:, :, step] = tok
        return (beam + torch.arange(a, device=beam.device)[:, None] * w).view(-1)

    def hypotheses(self, i: int, n_best: int, alpha: float) -> list[Hypothesis]:
        """The n best of active sentence i (already sorted by normalized score)."""
        lp = length_penalty(self.length[i, :n_best], alpha)
        rows, lengths = self.history[i, :n_best].cpu(), self.length[i, :n_best].tolist()
        raw, eos = self.scores[i, :n_best].tolist(), self.eos[i, :n_best].tolist()
        normalized = (self.scores[i, :n_best] / lp).tolist()
        return [_hypothesis(rows[j], lengths[j], normalized[j], raw[j], eos[j]) for j in range(n_best)]

    def keep(self, keep: torch.Tensor) -> None:
        for name in ("scores", "length", "finished", "eos", "history"):
            setattr(self, name, getattr(self, name)[keep])


@torch.inference_mode()
def beam_stream(model: Transformer, src: torch.Tensor, options: DecodingOptions) -> Iterator[Finished]:
    """Vectorized beam search (top-k over beam x vocabulary) with GNMT length normalization.

    Finished hypotheses stay in the beam, extended only by PAD at no cost, so candidates of
    different lengths compete on normalized score; a sentence is done (and yielded) when all
    its beams are finished (or truncated at its length limit).
    """
    cfg, k, alpha = model.config, options.beam_size, options.length_penalty
    state = _Batch(model, src, options, width=k)
    beams = _Beams(src.shape[0], k, state.capacity, cfg.pad_id, src.device)
    tokens = torch.full((src.shape[0],), cfg.bos_id, dtype=torch.long, device=src.device)
    for step in range(state.capacity):
        a = state.alive.numel()
        logits = state.step(tokens)  # (A*W, V), W = 1 at step 0, then K
        back = beams.advance(logits.view(a, -1, logits.shape[-1]), step, alpha, cfg.eos_id)  # (A*K,)
        beams.finished |= (state.limit[state.alive] <= step + 1)[:, None]  # truncated at the limit
        tokens = beams.history[:, :, step].reshape(-1)
        done = beams.finished.all(dim=1)  # (A,)
        if not bool(done.any()):
            state.cache.reorder(back, room=1)  # reordered again after the next step
            continue
        for i in done.nonzero()[:, 0].tolist():
            yield Finished(int(state.alive[i]), beams.hypotheses(i, options.n_best, alpha), step + 1)
        if bool(done.all()):
            return
        keep = (~done).nonzero()[:, 0]
        state.keep(keep, back.view(a, k)[keep].reshape(-1), room=1)  # one copy: reorder and drop
        beams.keep(keep)
        tokens = tokens.view(a, k)[keep].reshape(-1)
