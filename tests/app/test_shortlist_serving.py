"""TRANSLATOR_SHORTLIST: the service decodes through a checkpoint's lexical shortlist by default,
says so in /info and /metrics, and serves the whole vocabulary when told to."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.settings import Settings
from model.engine import loading
from model.engine.translator import Translator
from tests.factories import DOC, start

TEXTS = ["Ein Mann fährt mit dem Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch im Park."]


@pytest.fixture(scope="module")
def weights(shipped: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weights folder serving the shipped de-en checkpoint alone."""
    root = tmp_path_factory.mktemp("weights")
    (root / shipped.name).symlink_to(shipped.resolve())
    return root


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.slow
def test_the_setting_picks_what_a_step_scores(weights: Path, enabled: bool) -> None:
    ckpt = loading.load(weights / "de-en")
    table = loading.load_shortlist(weights / "de-en", ckpt.config.tgt_vocab_size) if enabled else None
    direct = Translator(ckpt.model, ckpt.tokenizer, shortlist=table)
    options = loading.decoding_options(ckpt.meta)
    expected = [t.text for t in direct.translate(TEXTS, options)]
    client: TestClient
    for client in start(Settings(weights_dir=weights, shortlist=enabled, cache_size=0)):
        vocabulary = "shortlist" if enabled else "full"
        assert client.get("/info").json()["directions"][0]["vocabulary"] == vocabulary
        labels = f'device="cpu",direction="de-en",dtype="float32",vocabulary="{vocabulary}"'
        assert f"translator_model_info{{{labels}}} 1.0" in client.get("/metrics").text
        answer = client.post("/translate", json={"q": TEXTS, **DOC}).json()
        assert answer["translatedText"] == expected
