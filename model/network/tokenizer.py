"""Sentencepiece tokenizer with a joint source+target vocabulary and fixed special ids."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm

log = logging.getLogger(__name__)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class TokenizerError(ValueError):
    """The sentencepiece model is missing, corrupt or has the wrong special ids."""


class Tokenizer:
    """Wraps a sentencepiece model: text <-> ids (no BOS/EOS added) and <-> pieces."""

    def __init__(self, model_proto: bytes) -> None:
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model_proto)
        except (RuntimeError, OSError) as err:
            raise TokenizerError(f"not a valid sentencepiece model: {err}") from err
        expected = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}
        actual = {"pad": self.sp.pad_id(), "unk": self.sp.unk_id(), "bos": self.sp.bos_id(), "eos": self.sp.eos_id()}
        if actual != expected:
            raise TokenizerError(f"sentencepiece special ids {actual} differ from {expected}")
        self.model_proto = model_proto

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"sentencepiece model not found: {path}")
        return cls(path.read_bytes())

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    # One call per text: sentencepiece's list API starts a thread pool on every call, which
    # costs far more than the encoding itself and competes with the model's threads in the
    # service (docs/benchmarks/README.md#numbers-behind-the-code).
    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode texts to ids (no BOS/EOS)."""
        return [list(self.sp.encode(text, out_type=int)) for text in texts]

    def sample(self, texts: Sequence[str], alpha: float, nbest: int, seed: int) -> list[list[int]]:
        """Encode texts to ids, each segmentation drawn from the unigram model (subword
        regularization; ``TokenizerConfig.sampling_alpha``): the same seed gives the same draws.
        Seeds sentencepiece's process-wide generator, so it is for training, not for serving."""
        spm.set_random_generator_seed(seed)
        return [
            list(self.sp.encode(text, out_type=int, enable_sampling=True, alpha=alpha, nbest_size=nbest))
            for text in texts
        ]

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Decode ids to detokenized, cased text (special ids are dropped)."""
        return [str(self.sp.decode(list(x))) for x in ids]

    def piece_spans(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``text``'s ids (as ``encode`` gives them) and each piece's (start, end) character span
        in ``text``, the whitespace before a word not included."""
        pieces = self.sp.encode(text, return_type="proto").pieces
        return [int(piece.id) for piece in pieces], piece_spans(pieces, text)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Target ids to sentencepiece pieces (word starts carry the '▁' marker)."""
        return [str(self.sp.id_to_piece(int(i))) for i in ids]

    def source_pieces(self, ids: Sequence[int]) -> list[str]:
        """Source ids to pieces: the same as ``pieces`` for a joint vocabulary (a tokenizer with a
        source vocabulary of its own, ``model.network.vocabulary``, says otherwise)."""
        return self.pieces(ids)

    def files(self) -> dict[str, bytes]:
        """What a checkpoint folder stores of it, by file name (``model.checkpoint.save``)."""
        return {"spm.model": self.model_proto}

    def describe(self) -> dict[str, Any]:
        """config.json's "tokenizer" section (``model.checkpoint.save``; ``load_tokenizer`` reads it)."""
        return {"type": "sentencepiece", "file": "spm.model", "vocab_size": self.vocab_size}


def piece_spans(pieces: Sequence[Any], text: str) -> list[tuple[int, int]]:
    """Each piece's (start, end) character span in ``text`` (pieces of sentencepiece's proto answer,
    which count bytes), the whitespace before a word not included."""
    raw = text.encode("utf-8")
    spans = []
    for piece in pieces:
        start = len(raw[: piece.begin].decode("utf-8", errors="ignore"))
        end = len(raw[: piece.end].decode("utf-8", errors="ignore"))
        while start < end and text[start].isspace():
            start += 1
        spans.append((start, end))
    return spans


def target_tag(lang: str) -> str:
    """The token that leads a source sentence to ask a many-to-many model for ``lang``; such
    a model's tokenizer holds it as one piece (``train_tokenizer``'s ``user_symbols``)."""
    return f"<2{lang}>"


def target_prefix(tokenizer: Tokenizer, lang: str) -> tuple[int, ...]:
    """The ids that lead a source asking a many-to-many model for ``lang``: what the tokenizer
    makes of the tag at the start of a text (a word-start piece, then the tag), so that
    prefix + encode(text) == encode(tag + " " + text), as in training."""
    ids = tokenizer.encode([target_tag(lang)])[0]
    if tokenizer.pieces(ids)[-1] != target_tag(lang):
        raise ValueError(f"the tokenizer has no {target_tag(lang)} piece: not a many-to-many model for {lang}")
    return tuple(ids)


def train_tokenizer(
    sentences: Iterable[str],
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    seed_sentences: int = 0,
    user_symbols: Sequence[str] = (),
) -> Tokenizer:
    """Train a sentencepiece model in memory on the given (joint) corpus; ``user_symbols``
    (e.g. target-language tags) are kept whole wherever they occur."""
    buffer = io.BytesIO()
    extra: dict[str, Any] = {"user_defined_symbols": list(user_symbols)} if user_symbols else {}
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=buffer,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        input_sentence_size=seed_sentences,
        shuffle_input_sentence=True,
        num_threads=2,
        minloglevel=2,
        **extra,
    )
    log.info("trained a %s sentencepiece model with %d pieces", model_type, vocab_size)
    return Tokenizer(buffer.getvalue())
