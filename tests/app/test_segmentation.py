"""Sentence splitting keeps the layout: rejoin(segment(text)) restores every whitespace."""

from __future__ import annotations

import pytest

from app.formats.segmentation import rejoin, segment, sentences


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Ein Mann läuft.", ["Ein Mann läuft."]),
        ("Ein Mann läuft. Eine Frau sitzt!", ["Ein Mann läuft.", "Eine Frau sitzt!"]),
        ("Das ist z.B. gut. Am 3. Mai kam er.", ["Das ist z.B. gut.", "Am 3. Mai kam er."]),
        ('Er sagte: "Hallo." Dann ging er.', ['Er sagte: "Hallo."', "Dann ging er."]),
        ("Wer? Ich... nein.", ["Wer?", "Ich... nein."]),
        ("Zeile eins\nZeile zwei", ["Zeile eins", "Zeile zwei"]),
        ("kein Punkt am Ende", ["kein Punkt am Ende"]),
    ],
)
def test_sentences(text: str, expected: list[str]) -> None:
    assert sentences(segment(text)) == expected


@pytest.mark.parametrize(
    "text",
    ["A. B.", "  leading and trailing  ", "Absatz eins. Satz zwei.\n\nAbsatz zwei.\n", "x\r\ny", "\n\nA\n\n"],
)
def test_layout_round_trip(text: str) -> None:
    segs = segment(text)
    assert "".join(s.text for s in segs) == text
    assert rejoin(segs, [s.upper() for s in sentences(segs)]) == "".join(
        s.text.upper() if s.translate else s.text for s in segs
    )


def test_paragraphs_are_kept_around_translations() -> None:
    segs = segment("Eins. Zwei.\n\nDrei.")
    assert rejoin(segs, ["One.", "Two.", "Three."]) == "One. Two.\n\nThree."
