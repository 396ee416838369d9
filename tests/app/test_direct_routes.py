"""``app.middleware.DirectRoutes``: POST /translate answered past FastAPI's router, with the
app's own error handling and every middleware around it."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.types import Receive, Scope, Send

from app.http import errors
from app.http.middleware import DirectRoutes
from app.main import create_app
from app.serving.errors import ApiError
from app.settings import Settings
from tests.factories import assert_error, start_app


def _app_with_direct(raised: Exception) -> tuple[FastAPI, list[str]]:
    """An app whose POST /direct raises ``raised`` past the router, and whose router also has
    GET /direct and POST /routed; ``seen`` lists which handler ran."""
    app = FastAPI()
    errors.install(app)
    seen: list[str] = []

    @app.get("/direct")
    async def routed_get() -> dict[str, str]:
        seen.append("router GET /direct")
        return {"via": "router"}

    @app.post("/routed")
    async def routed_post() -> dict[str, str]:
        seen.append("router POST /routed")
        return {"via": "router"}

    async def direct(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append("direct POST /direct")
        raise raised

    app.add_middleware(DirectRoutes, routes={("POST", "/direct"): direct}, handlers=app.exception_handlers)
    return app, seen


def test_a_direct_route_answers_its_errors_with_the_apps_handlers() -> None:
    app, seen = _app_with_direct(ApiError(400, "bad_thing", "that was bad"))
    with TestClient(app) as client:
        reply = client.post("/direct")
        assert reply.status_code == 400
        assert reply.json()["error_type"] == "bad_thing" and reply.json()["error"] == "that was bad"
        # another method on the same path, and another path, go through the router as before
        assert client.get("/direct").json() == {"via": "router"}
        assert client.post("/routed").json() == {"via": "router"}
        assert client.put("/direct").status_code == 405
    assert seen == ["direct POST /direct", "router GET /direct", "router POST /routed"]


def test_an_unexpected_error_in_a_direct_route_is_a_json_500() -> None:
    app, _ = _app_with_direct(RuntimeError("a bug"))
    with TestClient(app, raise_server_exceptions=False) as client:
        reply = client.post("/direct")
    assert reply.status_code == 500
    assert reply.json()["error_type"] == "internal_error"


def test_translate_goes_past_the_router_and_keeps_its_middleware(tiny_weights_dir: Path) -> None:
    """/translate is answered by the direct app (no route in the scope, which FastAPI's router
    sets), and still gets its request id, Server-Timing, body limit and metrics."""
    app = create_app(Settings(weights_dir=tiny_weights_dir, max_body_bytes=2048))
    routed: dict[str, object] = {}

    async def recording(scope: Scope, receive: Receive, send: Send) -> None:  # sees the scope once answered
        await app(scope, receive, send)
        if scope["type"] == "http":
            routed[scope["path"]] = scope.get("route")

    body = {"q": "ein haus", "source": "de", "target": "en"}
    for client in start_app(recording):
        reply = client.post("/translate", json=body, headers={"x-request-id": "d-1"})
        assert reply.status_code == 200 and isinstance(reply.json()["translatedText"], str)
        assert reply.headers["x-request-id"] == "d-1" and "decode;dur=" in reply.headers["server-timing"]
        assert_error(client.post("/translate", content=b"x" * 4096), 413, "payload_too_large")
        assert_error(client.post("/translate", json={**body, "q": 5}), 400, "validation_error")
        assert client.post("/attention", json=body).status_code == 200
        metrics = client.get("/metrics").text
    assert routed["/translate"] is None  # past the router, which names the route it chose
    assert routed["/attention"] is not None and routed["/metrics"] is not None
    assert 'translator_requests_total{endpoint="/translate",status="200"} 1.0' in metrics
    assert 'translator_requests_total{endpoint="/translate",status="400"} 1.0' in metrics
