"""Batched greedy and beam search over a cached, incremental decoder.

The encoder runs once per batch; its memory is projected to cross-attention K/V once and
reused by every step and every beam. Sentences that finish leave the batch, so the last
steps of a batch only pay for the sentences still being decoded.
"""

from __future__ import annotations

import math
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


@torch.inference_mode()
def decode(model: Transformer, src: torch.Tensor, options: DecodingOptions) -> Decoded:
    """src: (B, S) padded ids, each row ending with EOS -> n_best hypotheses per sentence."""
    if src.shape[0] == 0:
        return Decoded([], 0)
    if options.beam_size == 1:
        return greedy_search(model, src, options)
    return beam_search(model, src, options)


class _Batch:
    """Decoding state shared by greedy and beam search: cache, mask and the active rows."""

    def __init__(self, model: Transformer, src: torch.Tensor, options: DecodingOptions, width: int):
        cfg = model.config
        memory, self.mask, _ = model.encode(src)  # (B, S, D), (B, 1, 1, S)
        src_lengths = self.mask.sum(dim=(1, 2, 3))
        self.limit = max_steps(src_lengths, options, cfg.max_positions - 1)  # (B,)
        self.capacity = int(self.limit.max())
        self.cache: KVCache = model.init_cache(memory, self.capacity)
        self.alive = torch.arange(src.shape[0], device=src.device)  # sentence ids still decoding
        self.width = width
        if width > 1:  # every sentence gets `width` rows: expand memory K/V and mask once
            rows = self.alive.repeat_interleave(width)
            self.cache.select(rows)
            self.mask = self.mask.index_select(0, rows)

    def keep(self, keep: torch.Tensor) -> None:
        """Keep the active sentences at positions ``keep`` (A',) of the active set."""
        rows = keep
        if self.width > 1:
            offsets = torch.arange(self.width, device=keep.device)
            rows = (keep[:, None] * self.width + offsets).reshape(-1)
        self.cache.select(rows)
        self.mask = self.mask.index_select(0, rows)
        self.alive = self.alive[keep]


@torch.inference_mode()
def greedy_search(model: Transformer, src: torch.Tensor, options: DecodingOptions) -> Decoded:
    """Batched greedy decoding; sentences leave the batch when they emit EOS."""
    cfg = model.config
    b = src.shape[0]
    state = _Batch(model, src, options, width=1)
    out = torch.full((b, state.capacity), cfg.pad_id, dtype=torch.long, device=src.device)
    log_prob = torch.zeros(b, device=src.device)
    length = torch.zeros(b, dtype=torch.long, device=src.device)
    finished = torch.zeros(b, dtype=torch.bool, device=src.device)
    tokens = torch.full((b,), cfg.bos_id, dtype=torch.long, device=src.device)
    for step in range(state.capacity):
        logits = model.decode_step(tokens, state.cache, state.mask)  # (A, V)
        step_logp, tokens = torch.log_softmax(logits.float(), dim=-1).max(dim=-1)  # (A,)
        ids = state.alive
        out[ids, step] = tokens
        log_prob[ids] += step_logp
        length[ids] += 1
        eos = tokens == cfg.eos_id
        finished[ids] = eos
        done = eos | (state.limit[ids] <= step + 1)
        if bool(done.all()):
            break
        if bool(done.any()):
            keep = (~done).nonzero()[:, 0]
            state.keep(keep)
            tokens = tokens[keep]
    score = log_prob / length_penalty(length, options.length_penalty)
    hyps = [
        [_hypothesis(out[i], int(length[i]), float(score[i]), float(log_prob[i]), bool(finished[i]))] for i in range(b)
    ]
    return Decoded(hyps, step + 1)


def _hypothesis(row: torch.Tensor, length: int, score: float, log_prob: float, finished: bool) -> Hypothesis:
    """row: (capacity,) generated ids; drop the EOS of a finished hypothesis."""
    n = length - 1 if finished else length
    return Hypothesis(tuple(row[:n].tolist()), score, log_prob, finished)


@torch.inference_mode()
def beam_search(model: Transformer, src: torch.Tensor, options: DecodingOptions) -> Decoded:
    """Vectorized beam search (top-k over beam x vocabulary) with GNMT length normalization.

    Finished hypotheses stay in the beam, extended only by PAD at no cost, so candidates of
    different lengths compete on normalized score; a sentence is done when all its beams
    are finished (or truncated at its length limit).
    """
    cfg = model.config
    k, dev = options.beam_size, src.device
    b = src.shape[0]
    state = _Batch(model, src, options, width=k)
    vocab = cfg.tgt_vocab_size
    scores = torch.full((b, k), -math.inf, device=dev)
    scores[:, 0] = 0.0  # all beams start identical: only the first may expand at step 0
    length = torch.zeros(b, k, dtype=torch.long, device=dev)
    finished = torch.zeros(b, k, dtype=torch.bool, device=dev)
    eos_seen = torch.zeros(b, k, dtype=torch.bool, device=dev)
    history = torch.full((b, k, state.capacity), cfg.pad_id, dtype=torch.long, device=dev)
    pad_only = torch.full((vocab,), -math.inf, device=dev)
    pad_only[cfg.pad_id] = 0.0
    tokens = torch.full((b * k,), cfg.bos_id, dtype=torch.long, device=dev)
    results: list[list[Hypothesis]] = [[] for _ in range(b)]
    for step in range(state.capacity):
        a = state.alive.numel()
        logits = model.decode_step(tokens, state.cache, state.mask)  # (A*K, V)
        logp = torch.log_softmax(logits.float(), dim=-1).view(a, k, vocab)
        logp = torch.where(finished[..., None], pad_only, logp)
        candidates = scores[..., None] + logp  # (A, K, V) raw log-probabilities
        new_length = length + (~finished).long()  # (A, K)
        normalized = candidates / length_penalty(new_length, options.length_penalty)[..., None]
        _, flat = normalized.view(a, k * vocab).topk(k, dim=-1)  # (A, K), best first
        beam, tok = flat // vocab, flat % vocab
        scores = candidates.view(a, k * vocab).gather(1, flat)
        length = new_length.gather(1, beam)
        was_finished = finished.gather(1, beam)
        eos_seen = eos_seen.gather(1, beam) | (~was_finished & (tok == cfg.eos_id))
        history = history.gather(1, beam[..., None].expand_as(history))
        history[:, :, step] = tok
        rows = (beam + torch.arange(a, device=dev)[:, None] * k).view(-1)  # (A*K,)
        state.cache.reorder(rows)
        at_limit = (state.limit[state.alive] <= step + 1)[:, None]
        finished = was_finished | eos_seen | at_limit
        tokens = tok.view(-1)
        done = finished.all(dim=1)  # (A,)
        if bool(done.any()):
            lp = length_penalty(length, options.length_penalty)
            for i in done.nonzero()[:, 0].tolist():
                results[int(state.alive[i])] = [
                    _hypothesis(
                        history[i, j],
                        int(length[i, j]),
                        float(scores[i, j] / lp[i, j]),
                        float(scores[i, j]),
                        bool(eos_seen[i, j]),
                    )
                    for j in range(options.n_best)
                ]
            if bool(done.all()):
                break
            keep = (~done).nonzero()[:, 0]
            state.keep(keep)
            scores, length, finished, eos_seen, history = (
                t[keep] for t in (scores, length, finished, eos_seen, history)
            )
            tokens = tokens.view(a, k)[keep].reshape(-1)
    return Decoded(results, step + 1)
