"""Text in, text out: tokenization, length-sorted batching and decoding around one model."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from model.engine.batches import pad, token_batches
from model.engine.binding import step_dtype
from model.engine.decoding import Decoded, DecodeSession, Finished, Hypothesis, collect, decode_stream
from model.engine.kernels.tables import output_table
from model.engine.options import DecodingOptions
from model.engine.shortlist import Shortlist, Vocabulary
from model.network.tokenizer import Tokenizer
from model.network.transformer import AttentionMaps, Transformer


@dataclass(frozen=True)
class TranslatedHypothesis:
    text: str
    pieces: tuple[str, ...]
    score: float
    finished: bool
    confidence: int  # 0-100 (``Hypothesis.confidence``)


@dataclass(frozen=True)
class Translation:
    """One source sentence and its n-best translations (best first)."""

    source_pieces: tuple[str, ...]
    hypotheses: tuple[TranslatedHypothesis, ...]

    @property
    def text(self) -> str:
        return self.hypotheses[0].text


@dataclass(frozen=True)
class AttentionResult:
    """Maps of one teacher-forced pass over (source, hypothesis); maps are (L, H, Q, K).

    Queries and keys: encoder source x source; decoder target x target_input;
    cross target x source. ``target`` is the hypothesis plus EOS (what each row predicts),
    ``target_input`` is BOS plus the hypothesis (what each decoder position reads).
    """

    source: tuple[str, ...]
    target: tuple[str, ...]
    target_input: tuple[str, ...]
    encoder: torch.Tensor
    decoder: torch.Tensor
    cross: torch.Tensor


def source_batch(model: Transformer, batch: Sequence[Sequence[int]], prefix: Sequence[int] = ()) -> torch.Tensor:
    """Source ids without specials -> (B, S) padded ids, each ``prefix`` (a many-to-many
    model's target tag) + ids + EOS (where the model's sources end with one,
    ``ModelConfig.source_suffix``), on the model's device."""
    cfg = model.config
    limit = cfg.max_tokens - len(prefix)
    too_long = [len(ids) for ids in batch if len(ids) > limit]
    if too_long:
        raise ValueError(f"source of {max(too_long)} tokens exceeds {limit}")
    end = cfg.source_suffix
    return pad([[*prefix, *ids, *end] for ids in batch], cfg.pad_id).to(model.device)


class IdsSession:
    """A ``DecodeSession`` fed source ids without specials: it adds the prefix and EOS, pads,
    and moves them to the model's device. The service's scheduler drives one per set of
    decoding options."""

    def __init__(
        self,
        model: Transformer,
        options: DecodingOptions,
        prefix: Sequence[int] = (),
        shortlist: Shortlist | None = None,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        self.session = DecodeSession(model, options, shortlist, vocabulary)
        self.model = model
        self.prefix = tuple(prefix)

    @property
    def active(self) -> int:
        return self.session.active

    @property
    def source_width(self) -> int:
        return self.session.source_width

    def admit(self, batch: Sequence[Sequence[int]], tags: Sequence[int]) -> None:
        """Sentences (ids, no specials) join; they are returned by ``step`` under their tags."""
        self.session.admit(source_batch(self.model, batch, self.prefix), tags)

    def step(self) -> list[Finished]:
        """One decoder step of every active sentence -> those done at it."""
        return self.session.step()

    def cancel(self, tags: Collection[int]) -> int:
        """Sentences that leave at the next step (their requests are gone)."""
        return self.session.cancel(tags)


class Translator:
    """A model and its tokenizer, on one device. ``prefix``: ids that lead every source (a
    many-to-many model's target tag, ``target_prefix``); sources, limits and attention maps are
    the text's own, without it. ``shortlist``: decoding scores only its candidates
    (``model.engine.shortlist``); None: the whole vocabulary."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        prefix: Sequence[int] = (),
        shortlist: Shortlist | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.prefix = tuple(prefix)
        self.shortlist = shortlist
        self._vocabulary: Vocabulary | None = None  # the shortlist's columns, handed from session to session

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def max_source_tokens(self) -> int:
        """Longest source (in pieces, before EOS) the model's positions can hold."""
        return self.config.max_tokens - len(self.prefix)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Texts -> ids (no specials)."""
        return self.tokenizer.encode(texts)

    def decode_ids(self, batch: Sequence[Sequence[int]], options: DecodingOptions) -> list[list[Hypothesis]]:
        """Decode one batch of source ids (no specials) as given; -> n-best per sentence."""
        return self.decode_batch(batch, options).hypotheses

    def decode_batch(self, batch: Sequence[Sequence[int]], options: DecodingOptions) -> Decoded:
        """Like ``decode_ids``, also reporting the number of decoder steps."""
        return collect(self.decode_stream(batch, options), len(batch))

    def decode_stream(self, batch: Sequence[Sequence[int]], options: DecodingOptions) -> Iterator[Finished]:
        """Decode one batch; each sentence (its index in ``batch``) as soon as it is done."""
        src = source_batch(self.model, batch, self.prefix)
        return self._stream(src, options)

    def _stream(self, src: torch.Tensor, options: DecodingOptions) -> Iterator[Finished]:
        """src: (B, S). The shortlist's columns are asked for when the stream starts, where its
        session claims them: a stream made while another has not started yet cannot share them."""
        yield from decode_stream(self.model, src, options, self.shortlist, self._free_vocabulary())

    def open_session(self, options: DecodingOptions) -> IdsSession:
        """A running batch that sentences can join between steps (continuous batching). With
        a shortlist, it takes over the previous session's columns when that one is done."""
        return IdsSession(self.model, options, self.prefix, self.shortlist, self._free_vocabulary())

    def _free_vocabulary(self) -> Vocabulary | None:
        """The shortlist's columns for a new session, unless a live one decodes with them (then
        the new session makes its own). Every session of the translator, batch by batch
        (``decode_stream``) or continuous (``open_session``), takes them over in turn: the
        always-candidates' rows are gathered once, not once a call (a gather that is a sizeable
        part of one sentence's decoding: docs/benchmarks/README.md#numbers-behind-the-code). A
        translator serves one thread at a time."""
        if self.shortlist is None:
            return None
        if self._vocabulary is None:
            table = output_table(self.model)
            if table is None:  # (no rows to gather: the session says so)
                return None
            with torch.inference_mode():
                self._vocabulary = Vocabulary(self.shortlist, table, step_dtype(self.model))
        return None if self._vocabulary.in_use else self._vocabulary

    def to_translation(self, src_ids: Sequence[int], hyps: Sequence[Hypothesis]) -> Translation:
        texts = self.tokenizer.decode([h.ids for h in hyps])
        return Translation(
            tuple(self.tokenizer.source_pieces(src_ids)),
            tuple(
                TranslatedHypothesis(t, tuple(self.tokenizer.pieces(h.ids)), h.score, h.finished, h.confidence)
                for t, h in zip(texts, hyps, strict=True)
            ),
        )

    def translate(
        self,
        texts: Sequence[str],
        options: DecodingOptions,
        max_batch_tokens: int | None = None,
        on_done: Callable[[int], object] | None = None,
    ) -> list[Translation]:
        """Translate many sentences: sort by length, decode in token-bounded batches, unsort.
        ``on_done(n)`` is told after each batch how many sentences it finished (progress).
        Batches hold at most ``max_batch_tokens`` padded source tokens: by default 4,096 on the
        CPU and 32,768 on a GPU, whose steps cost little more for many more sentences."""
        if max_batch_tokens is None:
            max_batch_tokens = 4096 if self.device.type == "cpu" else 32768
        ids = self.encode(texts)
        results: dict[int, Translation] = {}
        for chunk in token_batches([len(i) + 1 for i in ids], max_batch_tokens):  # (+ EOS)
            for i, hyps in zip(chunk, self.decode_ids([ids[i] for i in chunk], options), strict=True):
                results[i] = self.to_translation(ids[i], hyps)
            if on_done is not None:
                on_done(len(chunk))
        return [results[i] for i in range(len(ids))]

    @torch.inference_mode()
    def attention(self, src_ids: Sequence[int], hyp_ids: Sequence[int]) -> AttentionResult:
        """Exact attention maps for a returned hypothesis (one teacher-forced pass). With a
        prefix, its positions are left out of the maps (the source is the text's pieces)."""
        cfg, n = self.config, len(self.prefix)
        src = torch.tensor([[*self.prefix, *src_ids, *cfg.source_suffix]], device=self.device)
        tgt_in = torch.tensor([[cfg.bos_id, *hyp_ids]], device=self.device)
        _, maps = self.model.attention_maps(src, tgt_in)
        pieces = self.tokenizer.pieces
        return AttentionResult(
            source=(*self.tokenizer.source_pieces(src_ids), *["</s>"] * len(cfg.source_suffix)),
            target=(*pieces(hyp_ids), "</s>"),
            target_input=("<s>", *pieces(hyp_ids)),
            encoder=_first(maps.encoder)[:, :, n:, n:],
            decoder=_first(maps.decoder),
            cross=_first(maps.cross)[..., n:],
        )


def _first(maps: torch.Tensor) -> torch.Tensor:
    """(L, 1, H, Q, K) -> (L, H, Q, K) float32 on CPU."""
    return maps[:, 0].float().cpu()


__all__ = ["AttentionMaps", "AttentionResult", "IdsSession", "TranslatedHypothesis", "Translation", "Translator"]
