"""How to decode: the one options object a request's parameters become, end to end (the
service builds it from the request and the model card, ``model.engine.decoding`` runs it).

A leaf module, so a checkpoint reader or a trainer names decoding options without importing
the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Repetition:
    """A request's repetition options (None: the model card's, else off), on top of the card's."""

    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass(frozen=True)
class DecodingOptions:
    """How to decode. ``beam_size`` 1 with ``n_best`` 1 is greedy search.

    The number of generated tokens (EOS included) is at most
    ``min(ceil(max_length_a * source_tokens + max_length_b), max_length, model cap)``;
    a hypothesis that reaches it without EOS is returned with ``finished=False``.
    ``length_penalty`` is GNMT's alpha: scores are log P / ((5 + length) / 6) ** alpha.
    ``repetition_penalty`` (1: off) and ``no_repeat_ngram_size`` (0: off) keep a model from
    answering with a loop, as CTranslate2 and ``transformers`` name and define them
    (``model.engine.penalties``), with or without a shortlist (applied in its columns).
    """

    beam_size: int = 4
    n_best: int = 1
    length_penalty: float = 0.6
    max_length_a: float = 1.5
    max_length_b: int = 10
    max_length: int | None = None
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError("beam_size must be >= 1")
        if not 1 <= self.n_best <= self.beam_size:
            raise ValueError("n_best must be between 1 and beam_size")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError("max_length must be >= 1")
        if self.length_penalty < 0 or self.max_length_a < 0 or self.max_length_b < 0:
            raise ValueError("length_penalty, max_length_a and max_length_b must be >= 0")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0 (1 is off)")
        if self.no_repeat_ngram_size < 0:
            raise ValueError("no_repeat_ngram_size must be >= 0 (0 is off)")
