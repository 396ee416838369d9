"""Formatted text through the translator: the text of an HTML paragraph or a document's
paragraph arrives as runs, each with its formatting (``marks``: the inline elements around
it, the run of a .docx paragraph, outermost first) or an object kept as it is (``atom``: an
image, a line break, untranslated code); the translation comes back as runs with the same
marks placed on the words that translate the marked words.

Each sentence is translated on its own. A sentence in one formatting is translated as
plain text and wrapped in it. A sentence whose formatting changes inside it is translated
with a word alignment (``Aligned``: the model's cross-attention, as ``/attention`` shows
it): each target word takes the formatting of the source word it translates, a word
aligned to nothing the formatting its neighbours share. When that places a mark on words
that are not contiguous, or on none, the sentence falls back to every mark it had around
the whole translated sentence, so no link or emphasis is ever lost. Atoms go after the
translation of the word they followed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from app.formats.segmentation import segment

Marks = tuple[int, ...]


@dataclass(frozen=True)
class Run:
    """A piece of a block: text in one formatting, or an atom (an object kept as it is,
    whose ``text`` is what it stands for in the running text: "" or "\\n" for a line break)."""

    text: str
    marks: Marks = ()
    atom: int | None = None


Block = tuple[Run, ...]


@dataclass(frozen=True)
class Aligned:
    """A translated sentence as words, and for each word the source word it translates.

    ``source_spans[k]``: (start, end) characters of source word k in the sentence;
    ``links[i]``: index into ``source_spans`` for target word ``words[i]``, or None."""

    words: tuple[str, ...]
    links: tuple[int | None, ...]
    source_spans: tuple[tuple[int, int], ...]


class Engine(Protocol):
    """What formatted text needs from the translator (bound to a direction and options)."""

    async def texts(self, texts: Sequence[str]) -> list[str]:
        """Each text translated (plain)."""
        ...

    async def aligned(self, sentences: Sequence[str]) -> list[Aligned | None]:
        """Each sentence translated with its word alignment (None: no alignment for it)."""
        ...


def plain(block: Block) -> str:
    return "".join(run.text for run in block)


def has_text(block: Block) -> bool:
    return any(run.atom is None and run.text.strip() for run in block)


def has_words(block: Block) -> bool:
    """Text with a letter in it (a cell holding a number is left as it is)."""
    return any(run.atom is None and any(c.isalpha() for c in run.text) for run in block)


@dataclass(frozen=True)
class _Piece:
    """A run clipped to one segment, its offsets relative to the segment's start."""

    start: int
    end: int
    run: Run


def _clip(block: Block, start: int, end: int, last: bool) -> list[_Piece]:
    """The runs of ``block`` within characters [start, end); an empty run (an atom) at the
    boundary belongs to the segment it starts, or to the last one at the very end."""
    out, position = [], 0
    for run in block:
        a, b = position, position + len(run.text)
        position = b
        if a == b:
            if start <= a < end or (last and a == end):
                out.append(_Piece(a - start, a - start, run))
        elif a < end and b > start:
            lo, hi = max(a, start), min(b, end)
            out.append(_Piece(lo - start, hi - start, replace(run, text=run.text[lo - a : hi - a])))
    return out


async def translate_blocks(engine: Engine, blocks: Sequence[Block]) -> list[Block]:
    """Every block's sentences translated, all blocks together (one batch of plain sentences,
    one of sentences that need an alignment); text between sentences kept as it was."""
    plans: list[list[tuple[str, list[_Piece]]]] = []  # per block: (sentence or "", its pieces)
    simple: list[str] = []
    formatted: list[str] = []
    for block in blocks:
        text, plan, position = plain(block), [], 0
        segments = segment(text) if has_text(block) else []
        for number, seg in enumerate(segments):
            end = position + len(seg.text)
            pieces = _clip(block, position, end, number == len(segments) - 1)
            position = end
            plan.append((seg.text if seg.translate else "", pieces))
            if seg.translate:
                (simple if _uniform(pieces) is not None else formatted).append(seg.text)
        if not segments:
            plan.append(("", _clip(block, 0, len(text), True)))
        plans.append(plan)
    plain_done, aligned_done = await asyncio.gather(engine.texts(simple), engine.aligned(formatted))
    plain_out, aligned_out = iter(plain_done), iter(aligned_done)
    results: list[Block] = []
    for plan in plans:
        runs: list[Run] = []
        for sentence, pieces in plan:
            if not sentence:
                runs.extend(p.run for p in pieces)
                continue
            marks = _uniform(pieces)
            if marks is not None:
                runs.append(Run(next(plain_out), marks))
            else:
                runs.extend(_place(sentence, pieces, next(aligned_out)))
        results.append(_merged(runs))
    return results


def _uniform(pieces: Sequence[_Piece]) -> Marks | None:
    """The one formatting of a sentence without atoms, else None."""
    if any(p.run.atom is not None for p in pieces):
        return None
    kinds = {p.run.marks for p in pieces if p.run.text.strip()}
    return kinds.pop() if len(kinds) == 1 else None


def _place(sentence: str, pieces: Sequence[_Piece], aligned: Aligned | None) -> list[Run]:
    """The translated words with the formatting of the source words they translate, atoms
    after the translation of the word before them (module docstring); else the fallback."""
    texts = [p for p in pieces if p.run.atom is None and p.run.text.strip()]
    atoms = [p for p in pieces if p.run.atom is not None]
    if aligned is None or not aligned.words:
        return _around(aligned.words if aligned else (), texts, atoms, sentence)
    source_marks = [_marks_at(span, texts) for span in aligned.source_spans]
    words = list(aligned.words)
    marks: list[Marks | None] = [None if k is None else source_marks[k] for k in aligned.links]
    for i in range(len(marks)):  # a word aligned to nothing: the formatting both neighbours share
        if marks[i] is None:
            left = next((m for m in reversed(marks[:i]) if m is not None), ())
            right = next((m for m in marks[i + 1 :] if m is not None), ())
            marks[i] = _common(left, right)
    placed: list[Marks] = [m if m is not None else () for m in marks]
    wanted = {m for p in texts for m in p.run.marks}
    if not _contiguous(placed) or wanted - {m for ms in placed for m in ms}:
        return _around(words, texts, atoms, sentence)
    after: dict[int, list[_Piece]] = {}  # target word -> atoms placed after it (-1: before all)
    for atom in atoms:
        before = [k for k, (_, end) in enumerate(aligned.source_spans) if end <= atom.start]
        targets = [i for i, k in enumerate(aligned.links) if before and k == before[-1]]
        after.setdefault(targets[-1] if targets else (-1 if not before else len(words) - 1), []).append(atom)
    runs = [_atom_run(a, ()) for a in after.get(-1, [])]
    for i, word in enumerate(words):
        if i:
            runs.append(Run(" ", _common(placed[i - 1], placed[i])))
        runs.append(Run(word, placed[i]))
        for atom in after.get(i, []):
            if atom.start > 0 and sentence[atom.start - 1].isspace():  # "mit <code>": spaced as it was
                runs.append(Run(" ", placed[i]))
            runs.append(_atom_run(atom, placed[i]))
    return runs


def _around(words: Sequence[str], texts: Sequence[_Piece], atoms: Sequence[_Piece], sentence: str) -> list[Run]:
    """Fallback: every mark of the sentence around the whole translation (outer marks
    outside), the atoms after it."""
    order: dict[int, tuple[int, int]] = {}
    for n, p in enumerate(texts):
        for depth, m in enumerate(p.run.marks):
            order.setdefault(m, (depth, n))
    marks = tuple(sorted(order, key=order.__getitem__))
    text = " ".join(words) if words else sentence
    return [Run(text, marks), *(_atom_run(a, ()) for a in atoms)]


def _atom_run(piece: _Piece, around: Marks) -> Run:
    """An atom keeps the formatting it had as far as its new place shares it."""
    return replace(piece.run, marks=_common(piece.run.marks, around))


def _marks_at(span: tuple[int, int], texts: Sequence[_Piece]) -> Marks:
    """The formatting covering most characters of a source word."""
    start, end = span
    best: Marks = ()
    most = 0
    for p in texts:
        overlap = min(end, p.end) - max(start, p.start)
        if overlap > most:
            best, most = p.run.marks, overlap
    return best


def _common(a: Marks, b: Marks) -> Marks:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _contiguous(placed: Sequence[Marks]) -> bool:
    """Does each mark cover one unbroken stretch of words (so it is one element)?"""
    seen: set[int] = set()
    for i, marks in enumerate(placed):
        for depth, m in enumerate(marks):
            continues = i > 0 and len(placed[i - 1]) > depth and placed[i - 1][depth] == m
            if m in seen and not continues:
                return False
            seen.add(m)
    return True


def _merged(runs: Sequence[Run]) -> Block:
    """Neighbouring text runs in the same formatting joined."""
    out: list[Run] = []
    for run in runs:
        if out and run.atom is None and out[-1].atom is None and out[-1].marks == run.marks:
            out[-1] = Run(out[-1].text + run.text, run.marks)
        else:
            out.append(run)
    return tuple(out)
