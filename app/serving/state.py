"""What one running service holds: settings, metrics and the loaded directions."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import math
import signal
import threading
import time
from types import FrameType

import torch

from app.observability import timing
from app.observability.metrics import Metrics
from app.serving.detection import Detection, Detector, NotServed
from app.serving.errors import BAD_REQUEST, UNSUPPORTED_LANGUAGE, ApiError
from app.serving.scheduler import ModelThread
from app.serving.service import LoadedModel, TranslationService, assign_directions, discover, kernel_plan
from app.settings import Settings
from app.storage.files import file_store
from app.storage.ratelimit import RateLimiter
from app.storage.suggestions import SuggestionStore
from model.engine.allocator import (
    active_malloc,
    bound_onednn_cache,
    freeing_at_once,
    mkl_buffer_pool,
    release_free_memory,
    tune_malloc,
)

log = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Leave every object alive now (modules, models, schemas: hundreds of thousands with torch,
    FastAPI and pydantic loaded) out of the cyclic garbage collector's full passes from now on
    -> how many.

    Requests allocate enough to run full passes regularly, and each walked all of those objects
    while holding Python's lock, stalling the model thread too
    (docs/benchmarks/README.md#event-loop). Objects made later are collected as before; a frozen
    one is still freed when its last reference goes."""
    gc.collect()  # what start-up left as garbage goes now, not frozen in
    gc.freeze()
    return gc.get_freeze_count()


# A pair without a model of its own is translated through this language when models to and
# from it exist (Multi30k's directions all have English on one side).
PIVOT = "en"


class AppState:
    """Loads every direction once (in the background) and hands them to the routes."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.rate_limiter = RateLimiter.from_settings(settings, self.metrics)
        self.models: list[LoadedModel] = []  # each checkpoint loaded once, with its scheduler
        self.model_thread = ModelThread()  # all model work, every model's (app/serving/scheduler.py)
        self.services: dict[tuple[str, str], TranslationService] = {}  # per direction served
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.draining = False
        self.drain_started = math.inf  # perf_counter() when draining began: requests that arrived before are served
        self.requests: set[asyncio.Task[object]] = set()  # requests waiting on the model (routes add them)
        self.detector: Detector | None = None  # built with the models, for the languages they take
        self.suggestions = SuggestionStore(settings.data_dir) if settings.suggestions else None
        self.files = file_store(  # translated documents awaiting download (app/storage/files.py)
            settings.file_results_storage,
            settings.file_results_max,
            settings.file_results_max_bytes,
            settings.file_results_ttl_s,
        )

    def check(self) -> None:
        """Refuse settings this machine cannot run (CUDA without a GPU, int8 without AVX2, no
        weights), with a message naming the setting; a slow precision is logged once."""
        kernel_plan(self.settings)
        discover(self.settings.weights_dir, self.settings.load_only)

    def load(self) -> None:
        """Load and warm up every checkpoint under the weights folder, on the model thread;
        then become ready."""
        try:
            if self.settings.threads:
                torch.set_num_threads(self.settings.threads)
            tune_malloc()  # (glibc's malloc only)
            log.info("memory allocator: %s (TRANSLATOR_MALLOC=%s)", active_malloc(), self.settings.malloc)
            bound_onednn_cache()
            pool = mkl_buffer_pool()
            if pool is not None and pool[0]:
                log.warning(
                    "MKL's buffer pool is on (torch was loaded before the model package), so GEMM "
                    "scratch buffers stay resident for good; set MKL_DISABLE_FAST_MM=1 to turn it off"
                )
            paths = discover(self.settings.weights_dir, self.settings.load_only)
            with freeing_at_once():  # what loading and warm-up free goes back to the OS as it goes
                for path, pairs in assign_directions(paths, self.settings.load_only).items():
                    loaded = self.model_thread.run(
                        functools.partial(LoadedModel, path, self.settings, self.metrics, self.model_thread)
                    )
                    self.models.append(loaded)
                    loaded.start()
                    for source, target in loaded.directions if pairs is None else pairs:
                        service = TranslationService(loaded, source, target, self.settings)
                        service.start()
                        self.services[(source, target)] = service
                        log.info("serving %s from %s: %s", service.direction, path, loaded.plan.describe())
            self.detector = Detector([source for source, _ in self.services])
            # what loading freed (float weights that packed copies replaced, warm-up batches) goes back
            # to the OS before the first request; on the model thread, whose heap mimalloc collects
            self.model_thread.run(release_free_memory)
            log.info("%d objects of start-up left out of garbage collection", freeze_startup_objects())
            self.ready.set()
        except Exception as err:
            self.load_error = type(err).__name__  # the message (with paths) goes to the log only
            log.exception("loading models failed")

    def drain_on_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """On SIGTERM/SIGINT, however the server was started (``translator serve``, ``uvicorn
        app.main:app``, gunicorn's uvicorn workers): become not-ready at once (/ready 503, new
        requests 503), and answer whatever still waits on the model 503 after the drain
        timeout; then the server's own handler runs. Main thread only (where signals are)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)

            def on_signal(number: int, frame: FrameType | None, previous: object = previous) -> None:
                if not self.draining:
                    self.start_draining()
                    log.info("draining: up to %g s for accepted requests", self.settings.drain_timeout_s)
                    loop.call_soon_threadsafe(loop.call_later, self.settings.drain_timeout_s, self.cut_off)
                if callable(previous):
                    previous(number, frame)

            signal.signal(sig, on_signal)

    def cut_off(self) -> None:
        """The drain timeout passed: requests still waiting get 503 (see ``app.http.disconnect.until_disconnect``)."""
        if self.requests:
            log.warning("drain timeout: %d requests cut off", len(self.requests))
        for task in list(self.requests):
            task.cancel()

    def close(self) -> None:
        """Finish what is queued (bounded by the drain timeout), then stop the model thread."""
        self.start_draining()
        self.model_thread.close(self.settings.drain_timeout_s)
        gc.unfreeze()  # start-up's objects collectable again, for a process that goes on (tests)

    def service(self, source: str, target: str) -> TranslationService:
        """The service of a language pair: 503 while loading, 400 for an unknown pair."""
        self.require_ready()
        found = self.services.get((source, target))
        if found is None:
            pairs = ", ".join(f"{s}->{t}" for s, t in sorted(self.services))
            raise ApiError(
                BAD_REQUEST, "unsupported_language_pair", f"no model for {source}->{target}; available: {pairs}"
            )
        return found

    def route(self, source: str, target: str) -> list[TranslationService]:
        """The models that translate ``source`` to ``target``: the direct one, else two through
        ``PIVOT`` (de->en->fr); 503 while loading, 400 when neither exists."""
        self.require_ready()
        direct = self.services.get((source, target))
        if direct is not None:
            return [direct]
        first, second = self.services.get((source, PIVOT)), self.services.get((PIVOT, target))
        if first is not None and second is not None and source != target:
            return [first, second]
        self.service(source, target)  # raises the 400 naming what is available
        raise AssertionError("unreachable")

    def pairs(self) -> list[tuple[str, str]]:
        """Every pair this server translates, directly or through ``PIVOT``, sorted."""
        direct = set(self.services)
        pivoted = {(s, t) for s, p in direct if p == PIVOT for q, t in direct if q == PIVOT and s != t}
        return sorted(direct | pivoted)

    def detect_source(self, text: str) -> Detection:
        """The served source language ``text`` is in (``source: "auto"``); 422 naming what it
        looks like when no model takes it."""
        self.require_ready()
        assert self.detector is not None
        try:
            return self.detector.source_of(text)
        except NotServed as err:
            raise ApiError(UNSUPPORTED_LANGUAGE, "unsupported_language", str(err)) from None

    def detect_candidates(self, text: str) -> list[Detection]:
        """The served source languages, most likely first (``/detect``)."""
        self.require_ready()
        assert self.detector is not None
        return self.detector.candidates(text)

    def start_draining(self) -> None:
        """Become not-ready: requests that arrive from now on get 503; those already received
        (even if not yet routed) are still served, within the drain timeout."""
        if not self.draining:
            self.drain_started = time.perf_counter()
            self.draining = True

    def require_ready(self) -> None:
        request = timing.current()  # (None outside a request: counts as arriving now)
        arrived = request.start if request is not None else time.perf_counter()
        if self.draining and arrived >= self.drain_started:
            raise ApiError(503, "shutting_down", "the service is shutting down", {"Retry-After": "1"})
        if not self.ready.is_set():
            message = "models failed to load (see the server log)" if self.load_error else "models are loading"
            raise ApiError(503, "not_ready", message, {"Retry-After": "2"})
