"""The FastAPI application: ``create_app(settings)``; ``uvicorn app.main:app`` serves the defaults."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from app import version
from app.http import errors, openapi, routes
from app.http.deps import security_schemes
from app.http.middleware import BodyLimitMiddleware, DirectRoutes, JsonCorsMiddleware, RequestContextMiddleware
from app.http.uploads import FORM_OVERHEAD
from app.observability import tracing
from app.serving.state import AppState
from app.settings import Settings

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Check that the settings can run here (device, dtype, weights folder: an error exits the
    server with its message), then start loading the models in the background (so /health and
    /ready answer at once);
    on shutdown, let the model thread finish what was accepted. The loader is a thread of its
    own that ends after loading; the models load and run on the one model thread
    (``app.serving.scheduler.ModelThread``: one OpenMP pool)."""
    state: AppState = app.state.translator
    state.check()  # a setting this machine cannot run fails start-up here, before serving anything
    tracing.configure()  # spans over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set (app/observability/tracing.py)
    state.drain_on_signals(asyncio.get_running_loop())
    loader = threading.Thread(target=state.load, name="loader", daemon=True)
    loader.start()
    yield
    state.start_draining()
    await asyncio.to_thread(loader.join)
    await asyncio.to_thread(state.close)
    log.info("stopped")


def document(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, built once: FastAPI's, with the API key's security schemes (the keyed
    routes name them in their ``openapi_extra``; they are not dependencies: ``app.http.deps.keyed``)."""
    if app.openapi_schema is None:
        doc = FastAPI.openapi(app)  # (kept as app.openapi_schema)
        doc.setdefault("components", {})["securitySchemes"] = security_schemes()
        return doc
    return app.openapi_schema


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    state = AppState(settings)
    app = FastAPI(
        title="Transformer translator",
        description="Neural machine translation (LibreTranslate-compatible /translate, attention maps).",
        version=version(),
        lifespan=lifespan,
        # requests are traced by app.observability.tracing (a span per request, one per phase) and timed by
        # app.observability.metrics: FastAPI's own OpenTelemetry instrumentation would add a second root span
        # per request wherever a global provider is set, and checks the providers on every request
        telemetry={
            "tracing": False,
            "metrics": False,
            "logs": False,
            "operation_spans": False,
            "auto_configure": False,
        },
    )
    app.state.translator = state
    app.openapi = functools.partial(document, app)  # type: ignore[method-assign]
    errors.install(app)
    # the request models state this server's limits (its settings, its checkpoints' config.json)
    facts = openapi.model_facts(settings.weights_dir, settings.load_only)
    models = openapi.request_models(settings, facts)
    routes.include(app, models)
    if routes.STATIC.is_dir():
        app.mount("/static", StaticFiles(directory=routes.STATIC), name="static")
    # POST /translate past the router; added first, so innermost: the middleware added after it wrap it too
    direct = {("POST", "/translate"): routes.translate_app}
    app.add_middleware(DirectRoutes, routes=direct, handlers=app.exception_handlers)
    if settings.cors_origins:
        app.add_middleware(
            JsonCorsMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            expose_headers=["X-Request-ID", "Server-Timing"],
        )
    # an upload's limit is the file's (its form around it included); app.http.uploads stops at the file's own
    uploads = {"/translate_file": settings.max_file_bytes + FORM_OVERHEAD}
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, paths=uploads)
    app.add_middleware(RequestContextMiddleware, metrics=state.metrics)
    return app


app = create_app()
