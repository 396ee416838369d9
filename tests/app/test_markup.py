"""app.formats.markup's placement of formatting on translated words, given the alignment.

The model decides the words and the alignment; what is tested here is what the service does
with them, so the engine below answers fixed translations and links (what the model gave
for these sentences is tested through the server in test_html.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.formats.markup import Aligned, Block, Run, translate_blocks


@dataclass
class Scripted:
    """Answers each sentence from a table; records which path each sentence took."""

    plain: dict[str, str] = field(default_factory=dict)
    alignments: dict[str, Aligned] = field(default_factory=dict)
    asked_plain: list[str] = field(default_factory=list)
    asked_aligned: list[str] = field(default_factory=list)

    async def texts(self, texts: Sequence[str]) -> list[str]:
        self.asked_plain.extend(texts)
        return [self.plain[t] for t in texts]

    async def aligned(self, sentences: Sequence[str]) -> list[Aligned | None]:
        self.asked_aligned.extend(sentences)
        return [self.alignments.get(s) for s in sentences]


def spans(sentence: str) -> tuple[tuple[int, int], ...]:
    out, position = [], 0
    for word in sentence.split():
        start = sentence.index(word, position)
        out.append((start, start + len(word)))
        position = start + len(word)
    return tuple(out)


def run(engine: Scripted, block: Block) -> Block:
    return asyncio.run(translate_blocks(engine, [block]))[0]


SENTENCE = "Ein roter Hund läuft."  # words: Ein roter Hund läuft.


def test_a_sentence_in_one_formatting_is_translated_plainly_and_wrapped() -> None:
    engine = Scripted(plain={SENTENCE: "A red dog runs."})
    assert run(engine, (Run(SENTENCE, (0,)),)) == (Run("A red dog runs.", (0,)),)
    assert engine.asked_aligned == []


def test_a_mark_goes_to_the_words_aligned_with_its_words() -> None:
    aligned = Aligned(("A", "red", "dog", "runs."), (0, 1, 2, 3), spans(SENTENCE))
    engine = Scripted(alignments={SENTENCE: aligned})
    block = (Run("Ein "), Run("roter", (0,)), Run(" Hund läuft."))
    assert run(engine, block) == (Run("A "), Run("red", (0,)), Run(" dog runs."))


def test_word_order_changes_follow_the_alignment() -> None:
    sentence = "Er hat den Hund gesehen."
    # "He has seen the dog.": "gesehen" (word 4) moves before "den Hund"
    aligned = Aligned(("He", "has", "seen", "the", "dog."), (0, 1, 4, 2, 3), spans(sentence))
    engine = Scripted(alignments={sentence: aligned})
    block = (Run("Er hat "), Run("den Hund", (0,)), Run(" gesehen."))
    assert run(engine, block) == (Run("He has seen "), Run("the dog.", (0,)))


def test_nested_marks_are_rebuilt_nested() -> None:
    sentence = "Ein Mann und eine Frau sitzen."
    aligned = Aligned(("A", "man", "and", "a", "woman", "sit."), (0, 1, 2, 3, 4, 5), spans(sentence))
    engine = Scripted(alignments={sentence: aligned})
    block = (Run("Ein Mann "), Run("und ", (0,)), Run("eine Frau", (0, 1)), Run(" sitzen."))
    assert run(engine, block) == (Run("A man "), Run("and ", (0,)), Run("a woman", (0, 1)), Run(" sit."))


def test_an_unaligned_word_takes_what_its_neighbours_share() -> None:
    aligned = Aligned(("A", "big", "red", "dog", "runs."), (0, 1, None, 2, 3), spans(SENTENCE))
    engine = Scripted(alignments={SENTENCE: aligned})
    block = (Run("Ein "), Run("roter Hund", (0,)), Run(" läuft."))
    assert run(engine, block) == (Run("A "), Run("big red dog", (0,)), Run(" runs."))


def test_a_mark_split_by_the_alignment_falls_back_to_the_whole_sentence() -> None:
    aligned = Aligned(("A", "red", "dog", "runs."), (1, 0, 2, 1), spans(SENTENCE))  # roter -> "A" and "runs."
    engine = Scripted(alignments={SENTENCE: aligned})
    block = (Run("Ein "), Run("roter", (0,)), Run(" Hund läuft."))
    assert run(engine, block) == (Run("A red dog runs.", (0,)),)


def test_a_mark_no_word_got_is_kept_around_the_sentence() -> None:
    aligned = Aligned(("A", "dog", "runs."), (0, 2, 3), spans(SENTENCE))  # "roter" untranslated
    engine = Scripted(alignments={SENTENCE: aligned})
    block = (Run("Ein "), Run("roter", (7,)), Run(" Hund läuft."))
    assert run(engine, block) == (Run("A dog runs.", (7,)),)


def test_an_atom_follows_the_translation_of_the_word_before_it() -> None:
    sentence = "Ein Hund  läuft."  # an image between "Hund" and "läuft"
    aligned = Aligned(("A", "dog", "runs."), (0, 1, 2), spans(sentence))
    engine = Scripted(alignments={sentence: aligned})
    block = (Run("Ein Hund "), Run("", atom=0), Run(" läuft."))
    assert run(engine, block) == (Run("A dog "), Run("", atom=0), Run(" runs."))


def test_text_between_sentences_and_line_breaks_stay_as_they_were() -> None:
    engine = Scripted(plain={"Ein Hund.": "A dog.", "Eine Katze.": "A cat."})
    block = (Run("Ein Hund.", (0,)), Run("\n", atom=3), Run("  Eine Katze.", (0,)))
    assert run(engine, block) == (Run("A dog.", (0,)), Run("\n", atom=3), Run("  A cat.", (0,)))


def test_a_block_without_text_is_not_sent() -> None:
    engine = Scripted()
    block = (Run("  "), Run("", atom=0))
    assert run(engine, block) == block
    assert engine.asked_plain == [] and engine.asked_aligned == []


def test_through_the_pivot_a_word_links_to_the_source_word_its_pivot_word_links_to() -> None:
    from app.serving.pivots import compose

    german = "Ein roter Hund"
    first = Aligned(("A", "red", "dog"), (0, 1, 2), spans(german))  # de -> en
    second = Aligned(("Un", "chien", "rouge"), (0, 2, 1), spans("A red dog"))  # en -> fr
    assert compose(first, second) == Aligned(("Un", "chien", "rouge"), (0, 2, 1), spans(german))
    assert compose(first, None) is None and compose(None, second) is None
