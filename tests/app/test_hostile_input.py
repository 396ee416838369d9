"""Nothing a client sends gets a 5xx: hostile bodies, unicode, nesting, keys, CORS; the connection stays usable.

Property-based tests (hypothesis) throw arbitrary JSON values, unicode (lone surrogates,
combining marks, RTL, zero-width, NUL) and form bodies at every POST route of the app; a
real server checks that a keep-alive connection still serves after each hostile request.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.http.deps import MAX_JSON_DEPTH
from app.settings import Settings
from tests.factories import assert_error, start
from tests.helpers import running_server

DOC = {"source": "de", "target": "en"}
ROUTES = ("/translate", "/attention")
KEY = "s3cret-key"

# Text a translation API meets: combining marks, RTL, zero-width joiners, NUL, emoji, and
# lone surrogates (valid JSON escapes, not Unicode text).
HOSTILE = ["\ud800", "a\udfffb", "e\u0301\u0301", "\u202eabc", "\u200b\u200d", "\x00", "שלום", "😀" * 3, ""]
texts = st.one_of(st.text(max_size=40), st.sampled_from(HOSTILE), st.text(alphabet=st.characters(), max_size=8))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["q", "source", "target", "api_key", "beam_size", "alternatives", "format", "max_length", "details",
          "layers", "heads", "kinds", "level"]  # fmt: skip
bodies = st.fixed_dictionaries({"q": texts | json_values}, optional={f: json_values for f in FIELDS if f != "q"})


@pytest.fixture(scope="module")
def client(tiny_weights_dir: Path) -> Iterator[TestClient]:
    yield from start(Settings(weights_dir=tiny_weights_dir, max_body_bytes=65536))


@pytest.fixture(scope="module")
def keyed(tiny_weights_dir: Path) -> Iterator[TestClient]:
    yield from start(Settings(weights_dir=tiny_weights_dir, api_keys=[KEY], cors_origins=["https://ok.example"]))


def assert_client_error(response: Any) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert body["error"] and body["error_type"], body


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("field", ["q", "source", "target", "api_key"])
def test_lone_surrogates_are_a_400(client: TestClient, route: str, field: str) -> None:
    body = {"q": "Ein Hund.", **DOC, field: "x\ud800y"}
    raw = json.dumps(body)  # ensure_ascii: the escape "\ud800" travels as valid JSON
    response = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert_error(response, 400, "invalid_unicode")
    assert client.post(route, json={"q": "Ein Hund.", **DOC}).status_code == 200


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 950, 30_000])
def test_deep_nesting_is_a_400(client: TestClient, depth: int) -> None:
    for raw in ("[" * depth + "]" * depth, '{"q": ' + "[" * depth + "]" * depth + "}"):
        response = client.post("/translate", content=raw, headers={"content-type": "application/json"})
        assert_error(response, 400, "invalid_json")


def test_the_key_is_checked_before_the_body(keyed: TestClient) -> None:
    invalid = {"q": 5, "beam_size": "many"}  # a 400 with a key
    assert_error(keyed.post("/translate", json=invalid), 403, "forbidden")
    assert_error(keyed.post("/translate", json=invalid, headers={"X-API-Key": "wrong"}), 403, "forbidden")
    raw = "[" * 5000  # not even JSON: a wrong header key is refused before the body is read
    headers = {"X-API-Key": "wrong", "content-type": "application/json"}
    assert_error(keyed.post("/translate", content=raw, headers=headers), 403, "forbidden")
    assert_error(keyed.post("/translate", json={**invalid, "api_key": KEY}), 400, "validation_error")
    assert keyed.post("/translate", json={"q": "Ein Hund.", **DOC, "api_key": KEY}).status_code == 200
    assert keyed.post("/translate", json={"q": "Ein Hund.", **DOC}, headers={"X-API-Key": KEY}).status_code == 200


def test_cors_rejections_are_json(keyed: TestClient) -> None:
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    assert_error(keyed.options("/translate", headers=preflight), 400, "cors_rejected")
    allowed = {**preflight, "Origin": "https://ok.example"}
    assert keyed.options("/translate", headers=allowed).status_code == 200


@pytest.mark.parametrize("route", ROUTES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_arbitrary_json_bodies_get_no_5xx(client: TestClient, route: str, body: dict[str, Any]) -> None:
    raw = json.dumps(body, allow_nan=True)
    assert_client_error(client.post(route, content=raw, headers={"content-type": "application/json"}))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=json_values)
def test_arbitrary_json_documents_get_no_5xx(client: TestClient, value: Any) -> None:
    raw = json.dumps(value, allow_nan=True)
    assert_client_error(client.post("/translate", content=raw, headers={"content-type": "application/json"}))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from([*FIELDS, "x"]), st.lists(texts, min_size=1, max_size=3), max_size=6))
def test_arbitrary_form_bodies_get_no_5xx(client: TestClient, fields: dict[str, list[str]]) -> None:
    raw = urlencode([(k, v) for k, vs in fields.items() for v in vs], errors="surrogatepass")
    response = client.post("/translate", content=raw, headers={"content-type": "application/x-www-form-urlencoded"})
    assert_client_error(response)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64), content_type=st.sampled_from(["application/json", "text/plain", "", "a/b+json"]))
def test_arbitrary_bytes_get_no_5xx(client: TestClient, raw: bytes, content_type: str) -> None:
    assert_client_error(client.post("/translate", content=raw, headers={"content-type": content_type}))


@pytest.mark.server
@pytest.mark.usefixtures("fused_kernels")
def test_a_real_connection_survives_hostile_requests(tiny_weights_dir: Path) -> None:
    """Over one keep-alive connection to a real server: each hostile body gets a 4xx JSON
    answer, and the next request on the same connection is served."""
    hostile = [
        json.dumps({"q": "\ud800", **DOC}),
        json.dumps({"q": "Ein Hund.", "source": "\udc00", "target": "en"}),
        json.dumps({"q": "Ein Hund.", **DOC, "api_key": "\ud83d"}),
        "[" * 2000 + "]" * 2000,
        '{"q": "\x00\u202e\u200b", "source": "de", "target": "en"}',
    ]
    env = {"TRANSLATOR_WEIGHTS_DIR": str(tiny_weights_dir)}
    with running_server(env) as url:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        headers = {"content-type": "application/json"}
        for raw in hostile:
            conn.request("POST", "/translate", body=raw.encode("utf-8", "surrogatepass"), headers=headers)
            reply = conn.getresponse()
            payload = json.loads(reply.read())
            assert 400 <= reply.status < 500 or reply.status == 200, (raw[:40], reply.status, payload)
            conn.request("POST", "/translate", body=json.dumps({"q": "Ein Hund.", **DOC}), headers=headers)
            ok = conn.getresponse()
            assert ok.status == 200 and "translatedText" in json.loads(ok.read())
        conn.close()
