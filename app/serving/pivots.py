"""The translator a request's formatted text goes through (``app.formats.markup.Engine``): one model,
or two through the pivot language, with the request's options and one deadline for all."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from app.formats.markup import Aligned
from app.serving.service import ItemResult, TranslationService
from model.engine.options import DecodingOptions


@dataclass(frozen=True)
class Legs:
    """``services[i]`` translates with ``options[i]``; the last leg's output is the answer."""

    services: tuple[TranslationService, ...]
    options: tuple[DecodingOptions, ...]
    deadline: float  # time.monotonic()

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.001)

    async def items(self, texts: Sequence[str]) -> list[ItemResult]:
        """Every leg in turn: a leg's best translations are the next leg's sources."""
        items: list[ItemResult] = []
        for service, options in zip(self.services, self.options, strict=True):
            items = await service.translate(texts, options, self.remaining())
            texts = [item.texts[0] for item in items]
        return items

    async def texts(self, texts: Sequence[str]) -> list[str]:
        return [item.texts[0] for item in await self.items(texts)] if texts else []

    async def aligned(self, sentences: Sequence[str]) -> list[Aligned | None]:
        """Each leg aligned; through the pivot, a target word links to the source word its
        pivot word links to."""
        if not sentences:
            return []
        found: list[Aligned | None] = [None] * len(sentences)
        texts = list(sentences)
        for number, (service, options) in enumerate(zip(self.services, self.options, strict=True)):
            items, aligned = await service.translate_aligned(texts, options, self.remaining())
            found = aligned if number == 0 else [compose(a, b) for a, b in zip(found, aligned, strict=True)]
            texts = [item.texts[0] for item in items]
        return found


def compose(first: Aligned | None, second: Aligned | None) -> Aligned | None:
    """source -> pivot (``first``) and pivot -> target (``second``, whose source is the text
    of ``first.words``) as source -> target."""
    if first is None or second is None:
        return None
    pivot_text = " ".join(first.words)
    spans, position = [], 0  # each pivot word's characters in the pivot text
    for word in first.words:
        start = pivot_text.find(word, position)
        start = position if start < 0 else start
        spans.append((start, start + len(word)))
        position = start + len(word)

    def through(k: int | None) -> int | None:
        if k is None:
            return None
        a, b = second.source_spans[k]
        overlaps = [min(b, e) - max(a, s) for s, e in spans]
        best = max(range(len(spans)), key=overlaps.__getitem__, default=None)
        return None if best is None or overlaps[best] <= 0 else first.links[best]

    return Aligned(second.words, tuple(through(k) for k in second.links), first.source_spans)
