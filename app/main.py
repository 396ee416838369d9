"""The FastAPI application: ``create_app(settings)``; ``uvicorn app.main:app`` serves the defaults."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles

from app import errors
from app.middleware import BodyLimitMiddleware, RequestContextMiddleware
from app.routes import STATIC, router
from app.settings import Settings
from app.state import AppState

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start loading the models in the background (so /health and /ready answer at once);
    on shutdown, let the batchers finish what was accepted."""
    state: AppState = app.state.translator
    loading = asyncio.create_task(asyncio.to_thread(state.load))
    yield
    state.draining = True
    await loading
    await asyncio.to_thread(state.close)
    log.info("stopped")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    state = AppState(settings)
    app = FastAPI(
        title="Transformer translator",
        description="Neural machine translation (LibreTranslate-compatible /translate, attention maps).",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.translator = state
    errors.install(app)
    app.include_router(router)
    if STATIC.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC), name="static")
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            expose_headers=["X-Request-ID"],
        )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestContextMiddleware, metrics=state.metrics)
    return app


app = create_app()
