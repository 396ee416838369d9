"""The HTTP contract through httpx against the app (lifespan included), with a tiny real checkpoint."""

from __future__ import annotations

import gc
import inspect
import re
import time
import weakref
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.http.errors import refusal
from app.main import create_app
from app.serving.scheduler import QueueFull, SchedulerClosed, TooLarge
from app.serving.service import SentenceTooLong, TextTooLong, Timeout, TranslationError
from app.settings import Settings
from app.storage.ratelimit import RateLimited
from model.engine import fused, kernels
from tests.factories import DOC, assert_error, sample, server_timing, start


@pytest.fixture(scope="module")
def client(tiny_weights_dir: Path) -> Iterator[TestClient]:
    yield from start(
        Settings(
            weights_dir=tiny_weights_dir,
            max_items=4,
            max_text_chars=300,
            max_beam=4,
            max_alternatives=2,
            max_body_bytes=4096,
        )
    )


def post(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    return client.post(path, json=body)


def test_string_and_list_shapes(client: TestClient) -> None:
    one = post(client, "/translate", {"q": "Ein Mann.", **DOC}).json()
    assert isinstance(one["translatedText"], str) and set(one) == {"translatedText"}
    many = post(client, "/translate", {"q": ["Ein Mann.", "Zwei Hunde."], **DOC}).json()
    assert isinstance(many["translatedText"], list) and len(many["translatedText"]) == 2
    assert many["translatedText"][0] == one["translatedText"]


def test_alternatives_and_details(client: TestClient) -> None:
    body = post(client, "/translate", {"q": "Ein Mann. Zwei Hunde.", "alternatives": 2, "details": True, **DOC}).json()
    assert len(body["alternatives"]) == 2 and all(isinstance(a, str) for a in body["alternatives"])
    assert body["translatedText"] not in body["alternatives"]
    d = body["details"]
    assert len(d["sentences"]) == 2 and d["sentences"][0]["source"] == "Ein Mann."
    assert d["source_token_count"] == sum(len(s["source_tokens"]) for s in d["sentences"])
    assert d["target_token_count"] == len(d["tokens"])
    assert isinstance(d["truncated"], bool) and d["score"] <= 0
    assert d["timings"]["total_ms"] >= d["timings"]["queue_ms"] >= 0
    listed = post(client, "/translate", {"q": ["Ein Mann."], "alternatives": 1, "details": True, **DOC}).json()
    assert isinstance(listed["alternatives"][0], list) and isinstance(listed["details"], list)


def test_a_beam_narrower_than_the_alternatives_is_widened(client: TestClient) -> None:
    narrow = post(client, "/translate", {"q": "Ein Mann.", "alternatives": 2, "beam_size": 1, **DOC}).json()
    wide = post(client, "/translate", {"q": "Ein Mann.", "alternatives": 2, "beam_size": 3, **DOC}).json()
    assert narrow == wide and len(narrow["alternatives"]) == 2


def test_paragraph_layout_is_kept(client: TestClient) -> None:
    text = "Ein Mann. Zwei Hunde.\n\nEine Frau."
    out = post(client, "/translate", {"q": text, "details": True, **DOC}).json()
    assert out["translatedText"].count("\n\n") == 1
    assert len(out["details"]["sentences"]) == 3


def test_form_encoded_libretranslate_request(client: TestClient) -> None:
    form = client.post("/translate", data={"q": "Ein Mann.", "source": "de", "target": "en"})
    assert form.status_code == 200
    assert (
        form.json()["translatedText"] == post(client, "/translate", {"q": "Ein Mann.", **DOC}).json()["translatedText"]
    )


@pytest.mark.parametrize(
    ("body", "error_type"),
    [
        ({"q": "", **DOC}, "empty_text"),
        ({"q": "   \n ", **DOC}, "empty_text"),
        ({"q": [], **DOC}, "validation_error"),
        ({"q": ["ok", " "], **DOC}, "empty_text"),
        ({"q": "x" * 301, **DOC}, "text_too_long"),
        ({"q": ["a"] * 5, **DOC}, "too_many_items"),
        ({"q": "Hallo", "source": "de", "target": "fr"}, "unsupported_language_pair"),
        ({"q": "Der Hund läuft schnell.", "source": "auto", "target": "fr"}, "unsupported_language_pair"),
        ({"q": "Hallo", "beam_size": 5, **DOC}, "validation_error"),
        ({"q": "Hallo", "beam_size": 0, **DOC}, "validation_error"),
        ({"q": "Hallo", "alternatives": 3, **DOC}, "validation_error"),
        ({"q": "Hallo", "max_length": 100000, **DOC}, "validation_error"),
        ({"q": "Hallo", "format": "markdown", **DOC}, "validation_error"),
        ({"q": 42, **DOC}, "validation_error"),
        ({"q": "Hallo", "beam_size": "many", **DOC}, "validation_error"),
        ({"q": "Hallo", "details": {"a": 1}, **DOC}, "validation_error"),
        ({"source": "de", "target": "en"}, "validation_error"),
        ({"q": "Hallo"}, "validation_error"),
    ],
)
def test_invalid_input_is_a_400(client: TestClient, body: dict[str, Any], error_type: str) -> None:
    assert_error(post(client, "/translate", body), 400, error_type)  # LibreTranslate's status


def test_sentence_longer_than_the_model_takes_is_refused_not_truncated(client: TestClient) -> None:
    words = " ".join(["q"] * 140)  # one sentence of 279 characters and at least 140 tokens (the model takes 127)
    body = assert_error(post(client, "/translate", {"q": words, **DOC}), 400, "text_too_long")
    assert "tokens" in body["error"]


def test_malformed_bodies(client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    assert_error(client.post("/translate", content=b"{bad json", headers=headers), 400, "invalid_json")
    assert_error(client.post("/translate", content=b"\xff\xfe", headers=headers), 400, "invalid_json")
    assert_error(client.post("/translate", content=b"[1, 2]", headers=headers), 400, "validation_error")
    assert_error(client.post("/translate", content=b"q=a", headers={"content-type": "text/plain"}), 415)
    assert_error(client.post("/translate", content=b"{" + b" " * 5000 + b"}", headers=headers), 413)

    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b" " * 1000

    assert_error(client.post("/translate", content=chunks(), headers=headers), 413)
    assert_error(client.get("/translate"), 405)
    assert_error(client.get("/nowhere"), 404)
    assert client.get("/health").status_code == 200  # still serving


def test_repeated_sentences_hit_the_cache(client: TestClient) -> None:
    def hits() -> float:
        families = text_string_to_metric_families(client.get("/metrics").text)
        return next(s.value for f in families for s in f.samples if s.name == "translator_cache_hits_total")

    before = hits()
    first = post(client, "/translate", {"q": "Ein Hund rennt.", "details": True, **DOC}).json()
    second = post(client, "/translate", {"q": "Ein Hund rennt.", "details": True, **DOC}).json()
    assert hits() == before + 1
    assert second["translatedText"] == first["translatedText"]
    assert second["details"]["sentences"][0]["cached"] and not first["details"]["sentences"][0]["cached"]


def test_server_timing_breaks_a_request_into_phases(client: TestClient) -> None:
    phase_count = "translator_request_phase_seconds_count"
    decodes_before = sample(client, phase_count, endpoint="/translate", phase="decode")
    steps_before = sample(client, "translator_decode_step_seconds_count", direction="de-en")
    response = post(client, "/translate", {"q": "Zwei Frauen sitzen auf einer Bank. Sie lachen.", **DOC})
    assert response.status_code == 200
    timings = server_timing(response)
    names = ["parse", "prepare", "queue", "encode", "decode", "handoff", "detokenize", "respond", "total"]
    assert list(timings) == names
    assert all(ms >= 0 for ms in timings.values()) and timings["decode"] > 0
    # the phases follow one another (the sentence that finished last), so they add up to the total
    assert sum(ms for name, ms in timings.items() if name != "total") <= timings["total"] + 0.1
    assert sample(client, phase_count, endpoint="/translate", phase="decode") == decodes_before + 1
    assert sample(client, "translator_decode_step_seconds_count", direction="de-en") > steps_before

    cached = server_timing(post(client, "/translate", {"q": "Zwei Frauen sitzen auf einer Bank. Sie lachen.", **DOC}))
    assert list(cached) == ["parse", "prepare", "detokenize", "respond", "total"]  # no model work
    assert "server-timing" not in client.get("/health").headers


def test_metadata_endpoints(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json()["directions"] == ["de-en"]
    langs = client.get("/languages").json()
    assert {"code": "de", "name": "German", "targets": ["en"]} in langs
    info = client.get("/info").json()
    assert info["version"] == metadata.version("transformer-translator")
    direction = info["directions"][0]
    assert direction["source"] == "de" and direction["device"] == "cpu" and direction["dtype"] == "float32"
    assert direction["parameters"] > 0 and direction["model"]["d_model"] == 32
    plan = kernels.choose("cpu", "float32")
    assert (direction["kernel"], direction["step_kernel"], direction["cpu_isa"]) == (plan.kernel, plan.step, plan.isa)
    assert direction["fused_step"] == (plan.fused if fused.load(plan.fused) is not None else None)
    assert direction["kv_cache"] == "float32"  # float32 keeps its cache in float32
    assert direction["int8_products"] is None  # (float32)
    assert info["limits"]["max_items"] == 4
    assert client.get("/docs").status_code == 200
    assert "/translate" in client.get("/openapi.json").json()["paths"]


def test_the_pages_are_served_with_nothing_from_elsewhere(client: TestClient) -> None:
    """/ (the translation page) and /viewer, their scripts and styles from the app itself: no
    build step, no framework, no address another host serves (tests/e2e/test_page.py: in Chromium)."""
    for path, script in (("/", "/static/translate.js"), ("/viewer", "/static/viewer.js")):
        page = client.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        links = re.findall(r'(?:src|href)="([^"]*)"', page.text)
        assert script in links
        assert all(link.startswith(("/", "data:")) for link in links), links
        for asset in (link for link in links if link.startswith("/static/")):
            assert client.get(asset).status_code == 200, asset
    for name in ("translate.js", "translate.css", "viewer.js", "viewer.css"):
        assert "://" not in client.get(f"/static/{name}").text, name
    assert all(path not in client.get("/openapi.json").json()["paths"] for path in ("/", "/viewer"))


def test_the_fused_step_kernels_can_be_turned_off(tiny_weights_dir: Path) -> None:
    """TRANSLATOR_FUSED_STEP=false: the plan names none, the model runs none, /info says so,
    and translations still come back."""
    for client in start(Settings(weights_dir=tiny_weights_dir, fused_step=False)):
        direction = client.get("/info").json()["directions"][0]
        assert direction["fused_step"] is None
        assert client.post("/translate", json={"q": "Ein Hund.", "source": "de", "target": "en"}).status_code == 200


def test_request_id_is_returned(client: TestClient) -> None:
    response = client.get("/health", headers={"x-request-id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    generated = client.get("/health", headers={"x-request-id": "bad id with spaces"}).headers["x-request-id"]
    assert generated != "bad id with spaces" and len(generated) == 32


def test_metrics_parse_and_have_the_documented_families(client: TestClient) -> None:
    post(client, "/translate", {"q": "Eine Katze.", **DOC})
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    documented = [
        "translator_requests",
        "translator_request_duration_seconds",
        "translator_queue_wait_seconds",
        "translator_request_phase_seconds",
        "translator_decode_step_seconds",
        "translator_queue_depth",
        "translator_inflight_requests",
        "translator_batch_sentences",
        "translator_batch_tokens",
        "translator_source_tokens",
        "translator_target_tokens",
        "translator_decode_steps",
        "translator_cache_hits",
        "translator_cache_misses",
        "translator_model_info",
        "process_cpu_seconds",
        "process_resident_memory_bytes",
    ]
    assert not [name for name in documented if name not in families]
    info = families["translator_model_info"].samples[0]
    labels = {"direction": "de-en", "device": "cpu", "dtype": "float32", "vocabulary": "full"}  # no shortlist shipped
    assert info.labels == labels and info.value == 1
    statuses = {
        s.labels["status"] for s in families["translator_requests"].samples if s.labels["endpoint"] == "/translate"
    }
    assert "200" in statuses


def test_ready_is_503_until_models_are_loaded(tiny_weights_dir: Path) -> None:
    app = create_app(Settings(weights_dir=tiny_weights_dir))
    client = TestClient(app)  # no context manager: the lifespan (which loads) has not run
    assert_error(client.get("/ready"), 503, "not_ready")
    assert client.get("/ready").headers["retry-after"]
    assert_error(client.post("/translate", json={"q": "Hallo", **DOC}), 503, "not_ready")
    assert client.get("/health").status_code == 200


def test_missing_weights_fail_start_up(tmp_path: Path) -> None:
    with (
        pytest.raises(RuntimeError, match="no checkpoint folders"),
        TestClient(create_app(Settings(weights_dir=tmp_path))),
    ):
        pass


def test_a_checkpoint_that_fails_to_load_is_unhealthy_and_names_no_path(tmp_path: Path) -> None:
    (tmp_path / "de-en").mkdir()
    (tmp_path / "de-en" / "config.json").write_text("{not json")
    with TestClient(create_app(Settings(weights_dir=tmp_path))) as client:
        deadline = time.monotonic() + 10
        while client.get("/health").status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        ready = assert_error(client.get("/ready"), 503, "not_ready")
        for reply in (health.text, ready["error"]):
            assert str(tmp_path) not in reply and "config.json" not in reply


def test_api_keys(tiny_weights_dir: Path) -> None:
    for client in start(Settings(weights_dir=tiny_weights_dir, api_keys=["k1", "k2"])):
        assert_error(post(client, "/translate", {"q": "Hallo", **DOC}), 403, "forbidden")
        assert_error(post(client, "/translate", {"q": "Hallo", "api_key": "nope", **DOC}), 403)
        assert post(client, "/translate", {"q": "Hallo", "api_key": "k2", **DOC}).status_code == 200
        assert client.post("/translate", json={"q": "Hallo", **DOC}, headers={"x-api-key": "k1"}).status_code == 200
        bearer = {"authorization": "Bearer k1"}
        assert client.post("/attention", json={"q": "Hallo", **DOC}, headers=bearer).status_code == 200
        form = client.post("/translate", data={"q": "Hallo", "source": "de", "target": "en", "api_key": "k1"})
        assert form.status_code == 200
        assert client.get("/languages").status_code == 200  # metadata stays open


def test_cors_origins(tiny_weights_dir: Path) -> None:
    for client in start(Settings(weights_dir=tiny_weights_dir, cors_origins=["https://example.org"])):
        preflight = client.options(
            "/translate", headers={"origin": "https://example.org", "access-control-request-method": "POST"}
        )
        assert preflight.headers["access-control-allow-origin"] == "https://example.org"
        other = client.get("/health", headers={"origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_a_request_that_can_never_fit_is_413_not_retryable(tiny_weights_dir: Path) -> None:
    for client in start(Settings(weights_dir=tiny_weights_dir, queue_size=2)):
        reply = post(client, "/translate", {"q": ["Ein Hund.", "Eine Katze.", "Ein Pferd."], **DOC})
        assert_error(reply, 413, "too_many_sentences")
        assert "retry-after" not in reply.headers
        reply = post(client, "/translate", {"q": "Ein Hund. Eine Katze. Ein Pferd.", **DOC})  # 3 sentences, 1 text
        assert_error(reply, 413, "too_many_sentences")
        assert post(client, "/translate", {"q": ["Ein Hund.", "Eine Katze."], **DOC}).status_code == 200


def test_the_schema_declares_the_key_the_form_body_and_the_answers(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert doc["components"]["securitySchemes"]["APIKeyHeader"] == {
        "type": "apiKey",
        "in": "header",
        "name": "X-API-Key",
        "description": doc["components"]["securitySchemes"]["APIKeyHeader"]["description"],
    }
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path in ("/translate", "/attention", "/detect", "/suggest"):
        operation = doc["paths"][path]["post"]
        assert {"APIKeyHeader": []} in operation["security"] and {"HTTPBearer": []} in operation["security"]
        content = operation["requestBody"]["content"]
        assert set(content) == {"application/json", "application/x-www-form-urlencoded"}
        form = content["application/x-www-form-urlencoded"]["schema"]["properties"]
        assert all("null" not in str(prop) for prop in form.values()), path  # a form has no null
    for path, model in (("/info", "InfoResponse"), ("/ready", "ReadyResponse"), ("/health", "HealthResponse")):
        schema = doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{model}"}
    translate = doc["paths"]["/translate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert translate["properties"]["alternatives"]["maximum"] == 2  # min(max_alternatives, max_beam - 1)


@pytest.mark.parametrize(
    ("refused", "status", "error_type", "retry_after"),
    [
        (QueueFull("9 sentences queued (limit 8)", 3), 429, "queue_full", "3"),
        (TooLarge("too many"), 413, "too_many_sentences", None),
        (SchedulerClosed("shutting down"), 503, "shutting_down", "1"),
        (RateLimited("minute", 10, 7), 429, "rate_limited", "7"),
        (SentenceTooLong(2, 600, 511), 400, "text_too_long", None),
        (TextTooLong(200, 128), 400, "text_too_long", None),
        (Timeout(1.5), 504, "timeout", None),
    ],
)
def test_what_the_service_refuses_gets_its_status_in_one_place(
    refused: Exception, status: int, error_type: str, retry_after: str | None
) -> None:
    answer = refusal(refused)
    assert (answer.status, answer.error_type) == (status, error_type)
    assert (answer.headers or {}).get("Retry-After") == retry_after
    if isinstance(refused, TranslationError | TooLarge | RateLimited):
        assert answer.message == str(refused)


def test_draining_refuses_requests_that_arrive_after_it_began_not_those_before(tmp_path: Path) -> None:
    """A request received before SIGTERM but not yet routed (its body still being read, say) is
    served within the drain timeout; one that arrives after gets 503 shutting_down."""
    from app.observability import timing
    from app.serving.errors import ApiError
    from app.serving.state import AppState

    state = AppState(Settings(weights_dir=tmp_path))
    state.ready.set()
    _, before = timing.begin()  # received now
    state.start_draining()
    state.require_ready()  # not refused
    timing.end(before)
    _, after = timing.begin()  # received after draining began
    with pytest.raises(ApiError) as refused:
        state.require_ready()
    timing.end(after)
    assert refused.value.status == 503 and refused.value.error_type == "shutting_down"
    with pytest.raises(ApiError):  # outside any request: counts as arriving now
        state.require_ready()


def test_every_route_dependency_runs_on_the_event_loop(client: TestClient) -> None:
    """FastAPI runs a plain ``def`` dependency in its thread pool: a thread hand-off per request
    that took a fifth of the event loop's time at 64 clients (docs/benchmarks/README.md#event-loop).
    Every dependency of every route is a coroutine."""
    from fastapi.routing import APIRoute

    def calls(dependant: Any) -> Iterator[Any]:
        for dependency in dependant.dependencies:
            yield dependency.call
            yield from calls(dependency)

    def api_routes(routes: list[Any]) -> Iterator[APIRoute]:
        for route in routes:
            if isinstance(route, APIRoute):
                yield route
            inner = getattr(route, "original_router", route)  # (an included router)
            yield from api_routes(getattr(inner, "routes", []))

    sync, seen = [], set()
    for route in api_routes(client.app.routes):  # type: ignore[attr-defined]
        seen.add(route.path)
        for call in calls(route.dependant):
            function = call if inspect.isfunction(call) else getattr(call, "__call__", None)  # noqa: B004
            if not inspect.iscoroutinefunction(function):
                sync.append(f"{route.path}: {getattr(call, '__name__', type(call).__name__)}")
    assert {"/translate", "/attention", "/languages", "/suggest"} <= seen
    assert sync == []


def test_start_up_objects_leave_the_collector_once_ready_and_return_on_close(tiny_weights_dir: Path) -> None:
    """Ready means start-up's objects are frozen (full collections skip them: app.state
    ``freeze_startup_objects``), while garbage made later is still collected; closing the app
    hands the frozen ones back, so a process that goes on can free them."""

    class Node:
        def __init__(self) -> None:
            self.me = self  # a reference cycle: only the collector frees it

    gc.unfreeze()
    for client in start(Settings(weights_dir=tiny_weights_dir)):
        assert gc.get_freeze_count() > 10_000  # modules, schemas, the model: all of start-up
        assert client.post("/translate", json={"q": "Ein Hund.", **DOC}).status_code == 200
        later = Node()
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None
    assert gc.get_freeze_count() == 0
