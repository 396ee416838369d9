"""The rest of LibreTranslate's API: /detect, source "auto" and /frontend/settings, in process
with the tiny checkpoint (de->en) and the real detector; its status codes also through a real
server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.error import HTTPError

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from starlette.types import Message

from app.settings import Settings
from app.storage.suggestions import SuggestionStore
from model import checkpoint
from model.engine import loading
from model.network.tokenizer import Tokenizer
from model.network.transformer import Transformer
from model.training.data import read_parallel
from tests.factories import assert_error, start, tiny_config
from tests.helpers import ROOT, running_server

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
    assert_error(client.post("/detect", json={"q": "  "}), 400, "empty_text")
    assert_error(client.post("/detect", json={}), 400, "validation_error")


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


def http_error(call: Callable[[], Any]) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of the HTTPError that a libretranslatepy call raises."""
    with pytest.raises(HTTPError) as raised:
        call()
    return raised.value.code, json.loads(raised.value.read())


@pytest.mark.server
@pytest.mark.usefixtures("fused_kernels")
def test_bad_requests_get_libretranslates_status_codes_on_a_real_server(tiny_weights_dir: Path) -> None:
    """400 for every bad request and 403 for a wrong key, as LibreTranslate answers (clients
    branch on them), each with its ``error`` and ``error_type``: through libretranslatepy, and
    plain form and JSON posts for what that client cannot send."""
    from libretranslatepy import LibreTranslateAPI

    key = "the-key"
    env = {"TRANSLATOR_WEIGHTS_DIR": str(tiny_weights_dir), "TRANSLATOR_API_KEYS": key, "TRANSLATOR_MAX_ITEMS": "3"}
    with running_server(env) as url:
        keyed, wrong = LibreTranslateAPI(url, api_key=key), LibreTranslateAPI(url, api_key="wrong")
        assert keyed.translate(GERMAN, "de", "en")
        status, body = http_error(lambda: keyed.translate(GERMAN, "de", "xx"))  # an unsupported target
        assert (status, body["error_type"]) == (400, "unsupported_language_pair") and "de->xx" in body["error"]
        status, body = http_error(lambda: wrong.translate(GERMAN, "de", "en"))
        assert (status, body["error_type"]) == (403, "forbidden") and body["error"]
        assert http_error(lambda: LibreTranslateAPI(url).detect(GERMAN))[0] == 403  # no key at all
        no_q = httpx.post(f"{url}/translate", data={"source": "de", "target": "en", "api_key": key})
        assert (no_q.status_code, no_q.json()["error_type"]) == (400, "validation_error")
        assert no_q.json()["error"].startswith("q:")
        many = {"q": ["Ein Hund."] * 4, "source": "de", "target": "en", "api_key": key}
        too_many = httpx.post(f"{url}/translate", json=many)
        assert (too_many.status_code, too_many.json()["error_type"]) == (400, "too_many_items")


def test_frontend_settings_in_libretranslate_shape(client: TestClient) -> None:
    settings = client.get("/frontend/settings").json()
    assert settings["charLimit"] == 500 and settings["keyRequired"] is False and settings["apiKeys"] is False
    assert settings["language"]["source"] == {"code": "auto", "name": "Auto Detect"}
    assert settings["language"]["target"]["code"] == "en" and settings["filesTranslation"] is True


def test_spec_is_the_openapi_document_where_libretranslate_serves_it(client: TestClient) -> None:
    spec = client.get("/spec")
    assert spec.status_code == 200 and spec.json() == client.get("/openapi.json").json()
    assert {"/translate", "/detect", "/languages", "/translate_file"} <= set(spec.json()["paths"])


def test_suggest_is_refused_unless_enabled(client: TestClient) -> None:
    body = {"q": "Ein Hund.", "s": "A dog.", "source": "de", "target": "en"}
    assert_error(client.post("/suggest", json=body), 403, "suggestions_disabled")
    assert client.get("/frontend/settings").json()["suggestions"] is False


def test_suggestions_are_kept_under_concurrent_requests_and_export_as_a_corpus(
    tiny_weights_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    bodies = [
        {"q": f"Ein Hund Nummer {i}.", "s": f"Dog number {i}.", "source": "de", "target": "en"} for i in range(40)
    ]
    for client in start(Settings(weights_dir=tiny_weights_dir, suggestions=True, data_dir=data)):
        assert client.get("/frontend/settings").json()["suggestions"] is True
        with ThreadPoolExecutor(8) as pool:  # form-encoded, as LibreTranslate clients send
            codes = list(pool.map(lambda body, c=client: c.post("/suggest", data=body).status_code, bodies))
        assert codes == [200] * 40
        wrong = {"q": "Ein Hund.", "s": "Un chien.", "source": "de", "target": "fr"}
        assert_error(client.post("/suggest", json=wrong), 400, "unsupported_language_pair")
    assert SuggestionStore(data).count() == 40
    out = tmp_path / "corpus"
    cmd = [sys.executable, "-m", "app.cli", "suggestions", "export", "--data-dir", str(data), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "de-en: 40 pairs", done.stderr[-2000:]
    pairs = read_parallel(out / "suggestions.de-en.de.gz", out / "suggestions.de-en.en.gz")
    assert sorted(zip(pairs.src, pairs.tgt, strict=True)) == sorted((b["q"], b["s"]) for b in bodies)


def test_parameters_are_read_from_the_query_string_too(client: TestClient) -> None:
    """LibreTranslate reads every parameter from JSON, the form or the query string, also on POST."""
    only_query = client.post("/translate", params={"q": GERMAN, "source": "de", "target": "en", "beam_size": "1"})
    assert only_query.status_code == 200, only_query.text
    body = {"q": GERMAN, "source": "de", "target": "en", "beam_size": 1}
    assert only_query.json()["translatedText"] == client.post("/translate", json=body).json()["translatedText"]
    mixed = client.post("/translate", params={"target": "en", "beam_size": "1"}, data={"q": GERMAN, "source": "de"})
    assert mixed.json()["translatedText"] == only_query.json()["translatedText"]
    repeated = client.post("/translate", params=[("q", "Ein Hund."), ("q", "Zwei Katzen."), ("source", "de"),
                                                 ("target", "en")])  # fmt: skip
    assert len(repeated.json()["translatedText"]) == 2
    assert client.post("/detect", params={"q": GERMAN}).json()[0]["language"] == "de"
    surrogate = client.post("/translate?q=%ED%A0%80&source=de&target=en&beam_size=1")  # bytes of U+D800: not UTF-8
    assert surrogate.status_code < 500  # decoded with replacement characters, never a lone surrogate


def test_a_query_string_that_is_not_utf8_is_a_400(client: TestClient) -> None:
    """Raw bytes that are not UTF-8 in the query string (uvicorn's parser refuses them itself,
    other ASGI servers pass them on) are the client's error: a 400 in the service's shape."""
    body = json.dumps({"source": "de", "target": "en"}).encode()
    headers = [(b"host", b"test"), (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/translate", "raw_path": b"/translate", "root_path": "", "query_string": b"q=\xff",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}  # fmt: skip
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    async def request() -> None:
        await client.app(scope, receive, send)

    assert client.portal is not None  # (the client is started)
    client.portal.call(request)
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error_type"] == "bad_request"


@pytest.fixture(scope="module")
def pivot_weights(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Tokenizer) -> Path:
    """de-en and en-fr checkpoints (random tiny models sharing one tokenizer): no de-fr model."""
    root = tmp_path_factory.mktemp("pivot-weights")
    for seed, (source, target) in enumerate([("de", "en"), ("en", "fr")]):
        torch.manual_seed(seed)
        model = Transformer(tiny_config(tiny_tokenizer.vocab_size))
        meta = {"source_lang": source, "target_lang": target, "decoding": {"beam_size": 2}}
        checkpoint.save(root / f"{source}-{target}", model, tiny_tokenizer, meta)
    return root


def test_load_only_serves_the_directions_among_its_languages(pivot_weights: Path) -> None:
    for client in start(Settings(weights_dir=pivot_weights, load_only="de, en")):  # type: ignore[arg-type]
        languages = {lang["code"]: lang["targets"] for lang in client.get("/languages").json()}
        assert languages == {"de": ["en"], "en": []}
        assert [(d["source"], d["target"]) for d in client.get("/info").json()["directions"]] == [("de", "en")]
        assert client.post("/translate", json={"q": "Hallo", "source": "de", "target": "en"}).status_code == 200
        assert_error(client.post("/translate", json={"q": "Hi", "source": "en", "target": "fr"}), 400,
                     "unsupported_language_pair")  # fmt: skip


def fake_checkpoint(folder: Path, meta: dict[str, Any], val_bleu: dict[str, float] | float | None) -> Path:
    """config.json (and metrics.json) only: what choosing a checkpoint per direction reads."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model": {}, **meta}))
    if isinstance(val_bleu, float):
        (folder / "metrics.json").write_text(json.dumps({"val": {"beam5": {"bleu": val_bleu}}}))
    elif val_bleu is not None:
        scores = {d: {"val": {"beam5": {"bleu": b}}} for d, b in val_bleu.items()}
        (folder / "metrics.json").write_text(json.dumps(scores))
    return folder


def test_each_direction_is_served_by_the_checkpoint_with_the_better_val_score(tmp_path: Path) -> None:
    from app.serving.service import assign_directions

    many = {"directions": ["de-en", "de-fr", "en-fr"], "target_tags": True}
    m2m = fake_checkpoint(tmp_path / "many", many, {"de-en": 42.0, "de-fr": 30.0, "en-fr": 50.0})
    de_en = fake_checkpoint(tmp_path / "de-en", {"source_lang": "de", "target_lang": "en"}, 43.0)
    en_fr = fake_checkpoint(tmp_path / "en-fr", {"source_lang": "en", "target_lang": "fr"}, 50.0)  # a tie
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    plan = assign_directions([broken, de_en, en_fr, m2m])
    assert plan == {broken: None, de_en: [("de", "en")], en_fr: [("en", "fr")], m2m: [("de", "fr")]}
    worse = fake_checkpoint(tmp_path / "w" / "de-en", {"source_lang": "de", "target_lang": "en"}, 41.0)
    assert assign_directions([worse, m2m]) == {m2m: [("de", "en"), ("de", "fr"), ("en", "fr")]}
    unscored = fake_checkpoint(tmp_path / "u" / "de-en", {"source_lang": "de", "target_lang": "en"}, None)
    assert assign_directions([unscored, m2m]) == {m2m: [("de", "en"), ("de", "fr"), ("en", "fr")]}  # unknown loses
    assert assign_directions([de_en, m2m], ["de", "fr"]) == {m2m: [("de", "fr")]}  # TRANSLATOR_LOAD_ONLY
    assert assign_directions([de_en, m2m], ["de", "en"]) == {de_en: [("de", "en")]}


def test_a_many_to_many_model_serves_its_directions_from_one_loaded_model(tmp_path: Path) -> None:
    """The shipped many-to-many checkpoint alone: every direction it lists is served, each
    source led by its target's tag (the same translation as the model outside the service),
    all through one model and one batching thread."""
    from model.engine.options import DecodingOptions
    from model.engine.translator import Translator
    from model.network.tokenizer import target_prefix

    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "many-to-many").symlink_to(ROOT / "weights" / "many-to-many")
    ckpt = loading.load(weights / "many-to-many")
    texts = ["Ein Hund läuft über die Wiese.", "Zwei Kinder spielen im Park."]
    card = ckpt.meta["decoding"]

    def alpha(direction: str) -> float:  # the card's length penalty, or the direction's own where it has one
        return float(card.get("length_penalty_by_direction", {}).get(direction, card["length_penalty"]))

    def ngrams(direction: str) -> int:  # the card's n-gram guard, or the direction's own where it has one
        return int(
            card.get("no_repeat_ngram_size_by_direction", {}).get(direction, card.get("no_repeat_ngram_size", 0))
        )

    for client in start(Settings(weights_dir=weights)):
        languages = {lang["code"]: lang["targets"] for lang in client.get("/languages").json()}
        assert languages == {"cs": ["de", "en", "fr"], "de": ["cs", "en", "fr"], "en": ["cs", "de", "fr"],
                             "fr": ["cs", "de", "en"]}  # fmt: skip
        for target in ("fr", "en", "cs"):
            body = {"q": texts, "source": "de", "target": target, "beam_size": 2, "details": True}
            answer = client.post("/translate", json=body).json()
            direct = Translator(ckpt.model, ckpt.tokenizer, target_prefix(ckpt.tokenizer, target))
            options = DecodingOptions(
                beam_size=2, length_penalty=alpha(f"de-{target}"), no_repeat_ngram_size=ngrams(f"de-{target}")
            )
            expected = [t.text for t in direct.translate(texts, options)]
            assert answer["translatedText"] == expected
            assert [d["models"] for d in answer["details"]] == [[f"de-{target}"]] * 2
        info = client.get("/info").json()["directions"]
        assert len(info) == 12 and {d["parameters"] for d in info} == {ckpt.model.num_parameters()}
        for d in info:  # each direction's own length penalty, where val chose one
            assert d["recommended_decoding"]["length_penalty"] == alpha(f"{d['source']}-{d['target']}")
        metrics = client.get("/metrics").text
        assert 'translator_decode_steps_total{direction="many-to-many"}' in metrics  # one model thread
        assert 'translator_model_info{device="cpu",direction="de-fr",dtype="float32",vocabulary="full"} 1.0' in metrics
        attention = client.post("/attention", json={"q": texts[0], "source": "de", "target": "fr"}).json()
        assert attention["source_tokens"][0] == "▁Ein"  # the tag is not shown as the text's


def test_a_pair_without_a_model_is_translated_through_english(pivot_weights: Path) -> None:
    for client in start(Settings(weights_dir=pivot_weights)):
        languages = {lang["code"]: lang["targets"] for lang in client.get("/languages").json()}
        assert languages["de"] == ["en", "fr"] and languages["en"] == ["fr"]  # de->fr through en
        texts = ["Ein Hund läuft.", "Zwei Kinder spielen im Park."]
        pivoted = client.post("/translate", json={"q": texts, "source": "de", "target": "fr", "details": True}).json()
        english = client.post("/translate", json={"q": texts, "source": "de", "target": "en"}).json()["translatedText"]
        french = client.post("/translate", json={"q": english, "source": "en", "target": "fr"}).json()["translatedText"]
        assert pivoted["translatedText"] == french  # exactly the two legs, one after the other
        assert [d["models"] for d in pivoted["details"]] == [["de-en", "en-fr"]] * 2
        alternatives = client.post(
            "/translate", json={"q": texts[0], "source": "de", "target": "fr", "alternatives": 1}
        ).json()
        assert len(alternatives["alternatives"]) == 1  # n-best from the last leg
        assert_error(client.post("/translate", json={"q": "Hallo", "source": "fr", "target": "de"}), 400,
                     "unsupported_language_pair")  # fmt: skip
