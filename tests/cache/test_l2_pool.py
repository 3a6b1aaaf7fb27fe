"""The Redis tier's connection pool under a burst of lookups, against a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.cache.entry import CachedAnswer
from appliance.cache.l2 import RedisSettings, RedisTier
from appliance.cache.metrics import CacheMetrics
from tests.cache.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-pool"))
    server.start()
    yield server
    server.kill()


async def test_more_lookups_than_connections_wait_for_one_instead_of_failing(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    # A burst larger than the pool is not a Redis fault: it must neither miss nor open the breaker.
    metrics = CacheMetrics()
    tier = RedisTier(
        RedisSettings(url=redis_server.url, timeout_ms=5000.0, max_connections=2), metrics
    )
    answer = CachedAnswer("an answer", (1, 2, 3), "stop", 4, 3)
    try:
        assert await tier.put("ns", "m", b"k" * 16, answer)
        hits = await asyncio.gather(*(tier.get("ns", "m", b"k" * 16) for _ in range(64)))
    finally:
        await tier.close()
    assert hits == [answer] * 64
    assert (metrics.l2_errors, metrics.l2_timeouts, metrics.breaker_opened) == (0, 0, 0)
    assert tier.breaker.state == "closed"
