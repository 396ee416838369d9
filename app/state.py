"""What one running service holds: settings, metrics and the loaded directions."""

from __future__ import annotations

import logging
import threading

import torch

from app.errors import ApiError
from app.metrics import Metrics
from app.service import TranslationService, discover, kernel_plan
from app.settings import Settings
from model.allocator import tune_malloc

log = logging.getLogger(__name__)


class AppState:
    """Loads every direction once (in the background) and hands them to the routes."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.services: dict[tuple[str, str], TranslationService] = {}
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.draining = False

    def check(self) -> None:
        """Refuse settings this machine cannot run (CUDA without a GPU, int8 without AVX2, no
        weights), with a message naming the setting; a slow precision is logged once."""
        kernel_plan(self.settings)
        discover(self.settings.weights_dir)

    def load(self) -> None:
        """Load and warm up every checkpoint under the weights folder; then become ready."""
        try:
            if self.settings.threads:
                torch.set_num_threads(self.settings.threads)
            tune_malloc()
            for path in discover(self.settings.weights_dir):
                service = TranslationService(path, self.settings, self.metrics)
                service.start()
                self.services[(service.source, service.target)] = service
                log.info("serving %s from %s: %s", service.direction, path, service.plan.describe())
            self.ready.set()
        except Exception as err:
            self.load_error = f"{type(err).__name__}: {err}"
            log.exception("loading models failed")

    def close(self) -> None:
        """Finish what is queued (bounded by the drain timeout), then stop the workers."""
        self.draining = True
        for service in self.services.values():
            service.close(self.settings.drain_timeout_s)

    def service(self, source: str, target: str) -> TranslationService:
        """The service of a language pair: 503 while loading, 422 for an unknown pair."""
        self.require_ready()
        found = self.services.get((source, target))
        if found is None:
            pairs = ", ".join(f"{s}->{t}" for s, t in sorted(self.services))
            raise ApiError(422, "unsupported_language_pair", f"no model for {source}->{target}; available: {pairs}")
        return found

    def require_ready(self) -> None:
        if self.draining:
            raise ApiError(503, "shutting_down", "the service is shutting down", {"Retry-After": "1"})
        if not self.ready.is_set():
            message = f"models failed to load: {self.load_error}" if self.load_error else "models are loading"
            raise ApiError(503, "not_ready", message, {"Retry-After": "2"})
