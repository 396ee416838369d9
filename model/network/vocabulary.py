"""Sentencepiece segmentation with a vocabulary of its own: how OPUS-MT (Marian) models and Argos
Translate (CTranslate2) packages tokenize. Their sentencepiece models cut text into pieces, and
the model's ids are the pieces' places in a separate list (Marian's ``vocab.json``, a
CTranslate2 model's vocabulary), not the sentencepiece ids; a piece the list lacks is UNK.
Source and target may have a sentencepiece model and a list each.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

import sentencepiece as spm

from model.network.tokenizer import Tokenizer, TokenizerError, piece_spans

SOURCE_SPM, TARGET_SPM, VOCABULARY = "source.spm", "target.spm", "vocabulary.json"
WORD_START = "\u2581"


def _processor(proto: bytes, which: str) -> spm.SentencePieceProcessor:
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto)
    except (RuntimeError, OSError) as err:
        raise TokenizerError(f"{which}: not a valid sentencepiece model: {err}") from err
    return sp


def language_code(text: str) -> tuple[str | None, str]:
    """A leading ``>>xx<<`` (a multi-target OPUS-MT model's target language) and the rest of
    the text, as transformers' ``MarianTokenizer.remove_language_code`` splits them."""
    if text.startswith(">>") and (end := text.find("<<")) != -1:
        return text[: end + 2], text[end + 2 :]
    return None, text


class VocabularyTokenizer(Tokenizer):
    """Source text -> the source sentencepiece model's pieces -> their places in the source
    vocabulary (UNK where absent); target ids -> the target vocabulary's pieces -> text, the
    ``specials`` (PAD, EOS, ...) dropped. The ``Tokenizer`` interface, so the engine and the
    service use either."""

    def __init__(
        self,
        source_spm: bytes,
        target_spm: bytes,
        source_vocab: Sequence[str],
        target_vocab: Sequence[str] | None = None,
        unk: str = "<unk>",
        specials: Collection[str] = (),
    ) -> None:
        self.source_sp = self.sp = _processor(source_spm, "source")
        self.target_sp = _processor(target_spm, "target")
        self.source_spm, self.target_spm = source_spm, target_spm
        self.source_vocab = list(source_vocab)
        self.target_vocab = list(source_vocab if target_vocab is None else target_vocab)
        self.joint = target_vocab is None
        self._source_ids: dict[str, int] = {}
        for i, piece in enumerate(self.source_vocab):
            self._source_ids.setdefault(piece, i)
        if unk not in self._source_ids:
            raise TokenizerError(f"the source vocabulary has no {unk} piece")
        self.unk, self.unk_id = unk, self._source_ids[unk]
        self.specials = tuple(specials)
        self._dropped = {i for i, piece in enumerate(self.target_vocab) if piece in set(specials)}
        self.model_proto = source_spm

    @property
    def vocab_size(self) -> int:
        """The target vocabulary's size (what the output projection scores)."""
        return len(self.target_vocab)

    @property
    def source_vocab_size(self) -> int:
        return len(self.source_vocab)

    def _ids(self, pieces: Sequence[str]) -> list[int]:
        get, unk = self._source_ids.get, self.unk_id
        return [get(piece, unk) for piece in pieces]

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        out = []
        for text in texts:
            code, rest = language_code(text)
            pieces = [] if code is None else [code]
            out.append(self._ids([*pieces, *self.source_sp.encode(rest, out_type=str)]))
        return out

    def sample(self, texts: Sequence[str], alpha: float, nbest: int, seed: int) -> list[list[int]]:
        raise TokenizerError("an imported vocabulary is for inference: no subword sampling")

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Target ids -> text: the pieces through the target sentencepiece model, specials dropped;
        where the model lacks a piece (a joint vocabulary's source-only pieces), the pieces joined
        with their word-start markers as spaces."""
        out = []
        for row in ids:
            pieces = [self.target_vocab[int(i)] for i in row if int(i) not in self._dropped]
            sp = self.target_sp
            known = all(sp.piece_to_id(p) != sp.unk_id() or p == sp.id_to_piece(sp.unk_id()) for p in pieces)
            text = sp.decode_pieces(pieces) if known else "".join(pieces).replace(WORD_START, " ").strip()
            out.append(str(text))
        return out

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.target_vocab[int(i)] for i in ids]

    def source_pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.source_vocab[int(i)] for i in ids]

    def piece_spans(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        code, rest = language_code(text)
        offset = 0 if code is None else len(code)
        ids, spans = ([], []) if code is None else (self._ids([code]), [(0, offset)])
        pieces = self.source_sp.encode(rest, return_type="proto").pieces
        ids += self._ids([piece.piece for piece in pieces])
        spans += [(start + offset, end + offset) for start, end in piece_spans(pieces, rest)]
        return ids, spans

    def files(self) -> dict[str, bytes]:
        vocab = {"source": self.source_vocab, "target": None if self.joint else self.target_vocab}
        data = {**vocab, "unk": self.unk, "specials": list(self.specials)}
        return {
            SOURCE_SPM: self.source_spm,
            TARGET_SPM: self.target_spm,
            VOCABULARY: (json.dumps(data, ensure_ascii=False, indent=0) + "\n").encode(),
        }

    def describe(self) -> dict[str, Any]:
        return {
            "type": "vocabulary",
            "source_spm": SOURCE_SPM,
            "target_spm": TARGET_SPM,
            "vocabulary": VOCABULARY,
            "vocab_size": self.vocab_size,
            "source_vocab_size": self.source_vocab_size,
        }

    @classmethod
    def from_files(cls, source_spm: bytes, target_spm: bytes, vocabulary: bytes) -> VocabularyTokenizer:
        """What ``files`` wrote, read back."""
        try:
            data = json.loads(vocabulary)
            return cls(source_spm, target_spm, data["source"], data["target"], data["unk"], data["specials"])
        except (ValueError, KeyError, TypeError) as err:
            raise TokenizerError(f"{VOCABULARY}: not a vocabulary ({err})") from err
