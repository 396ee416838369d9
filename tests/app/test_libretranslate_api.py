"""The rest of LibreTranslate's API: /detect, source "auto" and /frontend/settings, in process
with the tiny checkpoint (de->en) and the real detector."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.settings import Settings
from tests.factories import assert_error, start

GERMAN = "Ein Mann fährt mit dem Fahrrad über die Brücke."


@pytest.fixture(scope="module")
def client(tiny_weights_dir: Path) -> Iterator[TestClient]:
    yield from start(Settings(weights_dir=tiny_weights_dir, char_limit=500, max_text_chars=300))


def test_detect_answers_the_served_languages_best_first(client: TestClient) -> None:
    found = client.post("/detect", json={"q": GERMAN}).json()
    assert [d["language"] for d in found] == ["de"]  # the tiny checkpoint translates from de only
    assert 90 < found[0]["confidence"] <= 100
    form = client.post("/detect", data={"q": "Der Hund schläft."})  # LibreTranslate clients send forms
    assert form.status_code == 200 and form.json()[0]["language"] == "de"
    assert_error(client.post("/detect", json={"q": "  "}), 422, "empty_text")
    assert_error(client.post("/detect", json={}), 422, "validation_error")


def test_auto_source_detects_each_text(client: TestClient) -> None:
    one = client.post("/translate", json={"q": GERMAN, "source": "auto", "target": "en", "beam_size": 1}).json()
    assert one["detectedLanguage"]["language"] == "de" and one["detectedLanguage"]["confidence"] > 90
    explicit = client.post("/translate", json={"q": GERMAN, "source": "de", "target": "en", "beam_size": 1}).json()
    assert one["translatedText"] == explicit["translatedText"] and "detectedLanguage" not in explicit
    many = client.post(
        "/translate", json={"q": [GERMAN, "Zwei Hunde spielen."], "source": "auto", "target": "en", "beam_size": 1}
    ).json()
    assert [d["language"] for d in many["detectedLanguage"]] == ["de", "de"] and len(many["translatedText"]) == 2


def test_auto_source_in_a_language_no_model_takes_is_a_clear_422(client: TestClient) -> None:
    body = {"q": "Hola, ¿cómo estás? Me llamo Juan y vivo en Madrid.", "source": "auto", "target": "en"}
    error = assert_error(client.post("/translate", json=body), 422, "unsupported_language")
    assert "'es'" in error["error"] and "de" in error["error"]


def test_frontend_settings_in_libretranslate_shape(client: TestClient) -> None:
    settings = client.get("/frontend/settings").json()
    assert settings["charLimit"] == 500 and settings["keyRequired"] is False and settings["apiKeys"] is False
    assert settings["language"]["source"] == {"code": "auto", "name": "Auto Detect"}
    assert settings["language"]["target"]["code"] == "en" and settings["filesTranslation"] is False
