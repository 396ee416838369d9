"""/translate takes repetition_penalty and no_repeat_ngram_size per request, and its details say
how sure the model was (a 0-100 confidence per item and per sentence)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.settings import Settings
from tests.factories import DOC, assert_error, start

TEXT = "Ein Mann fährt mit dem Fahrrad. Zwei Hunde spielen im Schnee."


@pytest.fixture(scope="module")
def client(tiny_weights_dir: Path) -> Iterator[TestClient]:
    yield from start(Settings(weights_dir=tiny_weights_dir))


def pieces(client: TestClient, **options: object) -> list[str]:
    answer = client.post("/translate", json={"q": TEXT, **DOC, "details": True, "beam_size": 1, **options})
    assert answer.status_code == 200, answer.text
    details = answer.json()["details"]
    assert 0 <= details["confidence"] <= 100
    assert details["confidence"] == min(s["confidence"] for s in details["sentences"])
    return list(details["tokens"])


def test_no_repeat_ngram_size_per_request(client: TestClient) -> None:
    plain = pieces(client)
    assert any(a == b for a, b in itertools.pairwise(plain))  # the random model repeats itself
    blocked = pieces(client, no_repeat_ngram_size=1)  # no piece twice in a sentence
    assert blocked != plain
    assert pieces(client, repetition_penalty=1.0, no_repeat_ngram_size=0) == plain


@pytest.mark.parametrize("body", [{"repetition_penalty": 0}, {"no_repeat_ngram_size": -1}, {"repetition_penalty": "x"}])
def test_bad_values_are_400(client: TestClient, body: dict[str, object]) -> None:
    assert_error(client.post("/translate", json={"q": TEXT, **DOC, **body}), 400)
