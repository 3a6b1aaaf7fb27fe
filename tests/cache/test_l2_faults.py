"""The Redis tier against a real redis-server holding values no gateway wrote."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from appliance.cache.entry import CachedAnswer
from appliance.cache.l2 import RedisSettings, RedisTier
from tests.cache.redis_server import RedisServer

MAC_KEY = b"test-cache-mac-key-0123456789abc"
ANSWER = CachedAnswer("an answer", (1, 2, 3), "stop", 4, 3)
KEY = bytes(range(16))


@pytest.fixture
async def tier(redis_server: RedisServer) -> AsyncIterator[RedisTier]:
    redis_server.client().flushall()
    tier = RedisTier(
        RedisSettings(url=redis_server.url, timeout_ms=2000.0, breaker_failures=2, mac_key=MAC_KEY)
    )
    yield tier
    await tier.close()


@pytest.mark.parametrize("kind", ["list", "hash", "set"])
async def test_a_key_of_another_type_is_a_counted_miss_not_a_failing_redis(
    tier: RedisTier, redis_server: RedisServer, kind: str
) -> None:
    name = tier.redis_key("ns", "m", KEY)
    client = redis_server.client()
    {
        "list": lambda: client.rpush(name, b"x"),
        "hash": lambda: client.hset(name, "f", "v"),
        "set": lambda: client.sadd(name, b"x"),
    }[kind]()
    for _ in range(2 * tier.breaker.threshold):
        assert await tier.get("ns", "m", KEY) is None
    counters = tier.counters()
    assert counters["l2_corrupt_entries"] == 2 * tier.breaker.threshold
    assert (counters["l2_errors"], counters["breaker_open"], counters["breaker_opened"]) == (
        0,
        0,
        0,
    )
    # The answer written after the miss replaces the foreign value.
    assert await tier.put("ns", "m", KEY, ANSWER)
    assert await tier.get("ns", "m", KEY) == ANSWER


@pytest.mark.parametrize("size", [15, 65])
def test_a_mac_key_blake2b_cannot_take_is_refused_when_the_tier_is_made(size: int) -> None:
    # Accepted, a key of 65 bytes would fail every seal and every open: each lookup an error.
    with pytest.raises(ValueError, match="needs 16 to 64"):
        RedisTier(RedisSettings(mac_key=b"k" * size))
