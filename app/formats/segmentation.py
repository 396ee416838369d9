"""Split a text into sentences and put translated sentences back in the same layout.

The model was trained on single sentences, so a paragraph is translated sentence by
sentence (all sentences of a request in one batch) and re-joined with the original
whitespace: line breaks and blank lines between paragraphs survive unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# Abbreviations that end with a period but rarely end a sentence (German and English).
_ABBREVIATIONS = (
    "z.b u.a d.h bzw ca usw vgl dr prof nr str hr fr etc evtl ggf inkl bzgl mr mrs ms st jr sr vs no e.g i.e"
)
ABBREVIATIONS = frozenset(_ABBREVIATIONS.split())
# A sentence ends at . ! ? … (plus closing quotes/brackets) followed by whitespace.
_BOUNDARY = re.compile(r"""[.!?…]+["'”’»)\]]*(?=\s+)""")


@dataclass(frozen=True)
class Segment:
    """A piece of the original text: a sentence to translate, or whitespace kept as is."""

    text: str
    translate: bool


def _ends_with_abbreviation(text: str) -> bool:
    """Does the text end with an abbreviation, an initial or an ordinal number ("3.")?"""
    words = text.split()
    word = words[-1].rstrip(".").lower() if words else ""
    return word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()) or word.isdigit()


def _sentence_spans(line: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence of a stripped, single line."""
    spans, start = [], 0
    for match in _BOUNDARY.finditer(line):
        end = match.end()
        following = line[end:].lstrip()
        if match.group().startswith(".") and _ends_with_abbreviation(line[start:end]):
            continue
        if following[0].islower():
            continue
        spans.append((start, end))
        start = len(line) - len(following)
    spans.append((start, len(line)))
    return spans


def segment(text: str) -> list[Segment]:
    """Text -> segments; joining every ``segment.text`` gives back the text exactly."""
    out: list[Segment] = []
    for part in re.split(r"(\s*\n\s*)", text):  # lines, and the line-break runs between them
        if not part:
            continue
        if part.isspace():
            out.append(Segment(part, False))
            continue
        inner = part.strip()
        lead, trail = part[: part.index(inner)], part[part.index(inner) + len(inner) :]
        if lead:
            out.append(Segment(lead, False))
        position = 0
        for a, b in _sentence_spans(inner):
            if a > position:
                out.append(Segment(inner[position:a], False))
            out.append(Segment(inner[a:b], True))
            position = b
        if trail:
            out.append(Segment(trail, False))
    return out


def sentences(segments: Sequence[Segment]) -> list[str]:
    """The sentences to translate, in order."""
    return [s.text for s in segments if s.translate]


def rejoin(segments: Sequence[Segment], translations: Sequence[str]) -> str:
    """Put translations in place of the sentences, keeping every whitespace segment."""
    it = iter(translations)
    return "".join(next(it) if s.translate else s.text for s in segments)
