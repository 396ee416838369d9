"""A request's model work, withdrawn when its client goes away (``until_disconnect``): the HTTP
side of ``app.serving.translate.Watch``."""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from app.serving.errors import ApiError
from app.serving.state import AppState

T = TypeVar("T")


async def until_disconnect(request: Request, state: AppState, work: Awaitable[T]) -> T:
    """Run ``work``; if the client goes away first, cancel it (its sentences leave the queue or
    the running batch). Cancelled itself (the drain timeout), it answers 503. What the service
    and its scheduler refuse leaves as their own errors (``app.http.errors.refusal`` answers them).
    ``work`` runs in this request's task, which a watcher of the connection cancels: no task of
    its own (each task is event-loop time on every request)."""
    current = asyncio.current_task()
    assert current is not None
    state.requests.add(current)
    gone = False

    async def disconnected() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        current.cancel()

    watcher = asyncio.ensure_future(disconnected())
    try:
        return await work
    except asyncio.CancelledError:
        current.uncancel()  # (answered here: the task carries on to send the answer)
        if gone:
            raise ApiError(499, "client_closed_request", "the client disconnected") from None
        # the drain timeout passed (AppState.cut_off, or uvicorn's graceful-shutdown timeout):
        # the work is withdrawn (its awaits were cancelled) and the answer is 503, not uvicorn's 500.
        raise ApiError(
            503, "shutting_down", "the service stopped before this request finished", {"Retry-After": "1"}
        ) from None
    finally:
        watcher.cancel()
        state.requests.discard(current)
