"""Per-client rate limits (app/ratelimit.py) on both storages: this process's memory, and a
real Redis server shared by two limiters as two replicas would share it."""

from __future__ import annotations

import asyncio

import pytest

from app.metrics import Metrics
from app.ratelimit import ClientLimits, RateLimited, RateLimiter, client_id
from app.settings import KeyLimits, Settings

ALICE = client_id(None, "10.0.0.1")
BOB = client_id(None, "10.0.0.2")


def admitted(limiter: RateLimiter, client: str, n: int) -> int:
    """How many of n requests in a row pass (in a fresh event loop: memory storage only)."""
    return asyncio.run(count(limiter, client, n))


async def count(limiter: RateLimiter, client: str, n: int) -> int:
    passed = 0
    for _ in range(n):
        try:
            await limiter.hit(client)
            passed += 1
        except RateLimited:
            pass
    return passed


def test_each_client_gets_its_own_minute_budget_and_a_retry_after() -> None:
    metrics = Metrics()
    limiter = RateLimiter(ClientLimits(3, 0, 0, 0), {}, "memory://", metrics)
    assert admitted(limiter, ALICE, 5) == 3
    assert admitted(limiter, BOB, 5) == 3  # Alice's use does not count against Bob
    with pytest.raises(RateLimited) as err:
        asyncio.run(limiter.hit(ALICE))
    assert err.value.window == "minute" and err.value.limit == 3
    assert 55 <= err.value.retry_after <= 60
    assert metrics.registry.get_sample_value("translator_rate_limited_requests_total", {"window": "minute"}) == 5


def test_the_tightest_window_decides_and_refused_requests_do_not_count() -> None:
    limiter = RateLimiter(ClientLimits(10, 4, 100, 0), {}, "memory://")
    assert admitted(limiter, ALICE, 6) == 4
    with pytest.raises(RateLimited) as err:
        asyncio.run(limiter.hit(ALICE))
    assert err.value.window == "hour" and err.value.retry_after > 3000
    # the refused requests were not counted in the minute window: it holds exactly 4
    assert asyncio.run(limiter._limiter.get_window_stats(ClientLimits(10, 0, 0, 0).items()[0][1], ALICE))[1] == 6


def test_an_api_key_carries_its_own_limits_and_is_counted_as_itself() -> None:
    settings = Settings(req_limit=2, api_key_limits={"vip": KeyLimits(req_limit=5), "free": KeyLimits(req_limit=0)})
    limiter = RateLimiter.from_settings(settings)
    assert admitted(limiter, client_id("vip", "10.0.0.1"), 8) == 5
    assert admitted(limiter, client_id("free", "10.0.0.1"), 20) == 20  # 0: no limit for this key
    assert admitted(limiter, ALICE, 3) == 2  # the same address without a key: the server's limit
    assert limiter.limits_for(client_id("vip", None)).chars == 0
    assert "vip" not in client_id("vip", None)  # counters are named by a hash, never the key


def test_no_limits_configured_means_nothing_is_counted() -> None:
    limiter = RateLimiter.from_settings(Settings())
    assert not limiter.active
    assert admitted(limiter, ALICE, 50) == 50


def test_replicas_share_counters_through_redis(redis_url: str) -> None:
    metrics = Metrics()

    async def scenario() -> None:  # (one event loop: the Redis client belongs to it, as in a server)
        first = RateLimiter(ClientLimits(4, 0, 0, 0), {}, redis_url, metrics)
        second = RateLimiter(ClientLimits(4, 0, 0, 0), {}, redis_url, metrics)
        await first.reset()
        assert await count(first, ALICE, 2) == 2
        assert await count(second, ALICE, 5) == 2  # the other replica already counted two
        assert await count(first, BOB, 1) == 1
        with pytest.raises(RateLimited) as err:
            await second.hit(ALICE)
        assert 55 <= err.value.retry_after <= 60

    asyncio.run(scenario())
    assert metrics.registry.get_sample_value("translator_rate_limit_storage_errors_total") == 0
    assert metrics.registry.get_sample_value("translator_rate_limited_requests_total", {"window": "minute"}) == 4


def test_a_storage_outage_lets_requests_through_and_is_counted() -> None:
    metrics = Metrics()
    limiter = RateLimiter(ClientLimits(1, 0, 0, 0), {}, "redis://127.0.0.1:9", metrics)  # nothing listens on 9
    assert admitted(limiter, ALICE, 3) == 3
    assert metrics.registry.get_sample_value("translator_rate_limit_storage_errors_total") == 3


def test_settings_refuse_unknown_storages_and_malformed_key_limits() -> None:
    with pytest.raises(ValueError):
        Settings(req_limit_storage="mongodb://localhost")
    with pytest.raises(ValueError):
        Settings(api_key_limits='{"k": {"req_limt": 5}}')
    assert Settings(api_keys="a,b", api_key_limits='{"c": {}}').known_keys == {"a", "b", "c"}
