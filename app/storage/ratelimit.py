"""Per-client rate limits as LibreTranslate operators know them (``LT_REQ_LIMIT`` and friends).

A client is its API key when it sends one (stored as a hash, never the key itself), else its
address. Each client may make ``req_limit`` requests per minute, ``hourly_req_limit`` per hour
and ``daily_req_limit`` per day (0: no such limit); a key listed in ``api_key_limits`` carries
its own values for any of them. The counters live in ``limits``' storage: in this process's
memory by default, or in Redis (``req_limit_storage=redis://host:6379``) so that every replica
behind a load balancer counts against the same budget. The windows move (a request counts for
exactly one minute, hour or day after it was made), so a client cannot double its rate at a
window boundary.

The per-request character limit (``char_limit``) is not a rate: a request over it can never
pass, so the edge answers it with 400 ``too_many_characters`` (as LibreTranslate), not 429.

If the storage fails (Redis down), requests are let through and the failure is logged and
counted: an outage of the counters must not become an outage of the translations.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass

from limits import RateLimitItem, RateLimitItemPerDay, RateLimitItemPerHour, RateLimitItemPerMinute
from limits.aio.storage import Storage
from limits.aio.strategies import MovingWindowRateLimiter
from limits.storage import storage_from_string

from app.observability.metrics import Metrics
from app.settings import KeyLimits, Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientLimits:
    """The limits that apply to one client (0: none)."""

    per_minute: int
    per_hour: int
    per_day: int
    chars: int

    def items(self) -> list[tuple[str, RateLimitItem]]:
        windows = (
            ("minute", self.per_minute, RateLimitItemPerMinute),
            ("hour", self.per_hour, RateLimitItemPerHour),
            ("day", self.per_day, RateLimitItemPerDay),
        )
        return [(name, kind(amount)) for name, amount, kind in windows if amount > 0]


class RateLimited(Exception):
    """The client used up a window; ``retry_after``: seconds until it may send again."""

    def __init__(self, window: str, limit: int, retry_after: int) -> None:
        super().__init__(f"rate limit reached: {limit} requests per {window}; retry in {retry_after} s")
        self.window, self.limit, self.retry_after = window, limit, retry_after


def client_id(api_key: str | None, address: str | None) -> str:
    """The name a client's counters are kept under: a hash of its key, else its address."""
    if api_key:
        return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:32]
    return "ip:" + (address or "unknown")


def storage_for(uri: str) -> Storage:
    """``memory://`` or ``redis://host:port/db`` (LibreTranslate's form) -> an asyncio storage."""
    scheme = uri.split("://", 1)[0].removeprefix("async+")
    options: dict[str, str] = {"implementation": "redispy"} if scheme.startswith("redis") else {}
    storage = storage_from_string(f"async+{uri.removeprefix('async+')}", **options)
    assert isinstance(storage, Storage)
    return storage


class RateLimiter:
    """Counts every client's requests and answers whether the next one may pass."""

    def __init__(
        self,
        defaults: ClientLimits,
        per_key: dict[str, KeyLimits],
        storage_uri: str,
        metrics: Metrics | None = None,
    ) -> None:
        self.defaults, self.metrics = defaults, metrics
        self._per_key = {client_id(key, None): limits for key, limits in per_key.items()}
        self.storage = storage_for(storage_uri)
        self._limiter = MovingWindowRateLimiter(self.storage)
        self._last_error_log = 0.0

    @property
    def active(self) -> bool:
        """Whether any request rate is limited at all (else ``hit`` does nothing)."""
        return bool(self.defaults.items()) or any(self.limits_for(c).items() for c in self._per_key)

    def limits_for(self, client: str) -> ClientLimits:
        own = self._per_key.get(client)
        if own is None:
            return self.defaults
        d = self.defaults
        return ClientLimits(
            d.per_minute if own.req_limit is None else own.req_limit,
            d.per_hour if own.hourly_req_limit is None else own.hourly_req_limit,
            d.per_day if own.daily_req_limit is None else own.daily_req_limit,
            d.chars if own.char_limit is None else own.char_limit,
        )

    async def hit(self, client: str) -> None:
        """Count one request of ``client``; raise ``RateLimited`` if a window is full (the
        request is then not counted in any window)."""
        items = self.limits_for(client).items()
        if not items:
            return
        try:
            for window, item in items:
                if not await self._limiter.test(item, client):
                    reset, _ = await self._limiter.get_window_stats(item, client)
                    retry_after = max(1, math.ceil(reset - time.time()))
                    if self.metrics is not None:
                        self.metrics.rate_limited.labels(window).inc()
                    raise RateLimited(window, item.amount, retry_after)
            for _, item in items:
                await self._limiter.hit(item, client)
        except RateLimited:
            raise
        except Exception as err:  # the storage failed: let the request through (module docstring)
            if self.metrics is not None:
                self.metrics.rate_limit_errors.inc()
            now = time.monotonic()
            if now - self._last_error_log > 60:
                self._last_error_log = now
                log.error("rate-limit storage failed, requests are not limited meanwhile: %s", err)

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics | None = None) -> RateLimiter:
        defaults = ClientLimits(
            settings.req_limit, settings.hourly_req_limit, settings.daily_req_limit, settings.char_limit
        )
        return cls(defaults, settings.api_key_limits, settings.req_limit_storage, metrics)

    async def reset(self) -> None:
        """Forget every counter (tests, and operators through a restart of memory storage)."""
        await self.storage.reset()
