"""Per-client rate limits (app/storage/ratelimit.py) on both storages: this process's memory, and a
real Redis server shared by two limiters as two replicas would share it."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from app.observability.metrics import Metrics
from app.settings import KeyLimits, Settings
from app.storage.ratelimit import ClientLimits, RateLimited, RateLimiter, client_id
from tests.factories import DOC, assert_error, sample, start

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


def test_the_api_answers_429_with_retry_after_per_client_and_key(tiny_weights_dir: Path) -> None:
    settings = Settings(
        weights_dir=tiny_weights_dir,
        req_limit=2,
        char_limit=40,
        api_key_limits={"vip": KeyLimits(req_limit=4, char_limit=100)},
    )
    body = {"q": "Ein Hund.", **DOC, "beam_size": 1}
    for client in start(settings):
        assert [client.post("/translate", json=body).status_code for _ in range(2)] == [200, 200]
        refused = client.post("/translate", json=body)
        error = assert_error(refused, 429, "rate_limited")
        assert 55 <= int(refused.headers["retry-after"]) <= 60 and "2 requests per minute" in error["error"]
        assert client.post("/attention", json=body).status_code == 429  # one budget for the client
        assert client.get("/languages").status_code == 200  # reading the API is not limited
        vip = {"x-api-key": "vip"}
        assert [client.post("/translate", json=body, headers=vip).status_code for _ in range(5)] == [200] * 4 + [429]
        stranger = {"x-api-key": "made-up"}  # an unknown key is the address again, not a fresh budget
        assert client.post("/translate", json=body, headers=stranger).status_code == 429
        assert sample(client, "translator_rate_limited_requests_total", window="minute") == 4


def test_the_character_limit_is_per_request_and_per_key(tiny_weights_dir: Path) -> None:
    settings = Settings(weights_dir=tiny_weights_dir, char_limit=20, api_key_limits={"big": KeyLimits(char_limit=0)})
    for client in start(settings):
        long = {"q": ["Ein Hund läuft.", "Eine Katze."], **DOC, "beam_size": 1}  # 26 characters together
        error = assert_error(client.post("/translate", json=long), 400, "too_many_characters")
        assert "26 characters" in error["error"] and "at most 20" in error["error"]
        assert client.post("/translate", json=long, headers={"x-api-key": "big"}).status_code == 200


def test_two_replicas_share_one_budget_in_redis(tiny_weights_dir: Path, redis_url: str) -> None:
    settings = Settings(weights_dir=tiny_weights_dir, req_limit=3, req_limit_storage=redis_url)
    body = {"q": "Ein Hund.", **DOC, "beam_size": 1}
    asyncio.run(RateLimiter.from_settings(settings).reset())
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(contextlib.contextmanager(start)(settings))
        second = stack.enter_context(contextlib.contextmanager(start)(settings))
        codes = [c.post("/translate", json=body).status_code for c in (first, second, first, second)]
    assert codes == [200, 200, 200, 429]
