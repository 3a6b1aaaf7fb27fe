"""Stream appends and generation raises against a real redis-server: a stream whose last id is
ahead of Redis's clock, invalidations racing, and a Redis whose ACL predates the commands."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from appliance.cache.entry import CachedAnswer, encode
from appliance.cache.invalidation_feed import InvalidationFeed
from appliance.cache.l2 import RedisSettings, RedisTier
from appliance.cache.sealed_stream import redis_ms
from tests.cache.redis_server import RedisServer, gateway_acl_rules
from tests.support import until_async

MAC_KEY = b"test-cache-mac-key-0123456789abc"
ANSWER = CachedAnswer("an answer", (1, 2, 3), "stop", 4, 3)
KEY = bytes(range(16))


def settings_of(server: RedisServer, **changes: Any) -> RedisSettings:
    return RedisSettings(url=server.url, timeout_ms=2000.0, mac_key=MAC_KEY, **changes)


def recorder(applied: list[str]) -> Callable[[str, str, bytes | None], int]:
    def apply(namespace: str, model: str, entry: bytes | None) -> int:
        applied.append(namespace or "everything")
        return 0

    return apply


@pytest.fixture
async def tier(redis_server: RedisServer) -> AsyncIterator[RedisTier]:
    redis_server.client().flushall()
    tier = RedisTier(settings_of(redis_server))
    yield tier
    await tier.close()


async def test_an_append_lands_when_the_streams_last_id_is_ahead_of_redis_clock(
    redis_server: RedisServer,
) -> None:
    """After a failover to a replica whose clock lags (or a clock stepped back) the stream's last
    id is ahead of Redis's clock: appends still land, and the other gateways apply them."""
    redis_server.client().flushall()
    settings = settings_of(redis_server)
    applied: list[str] = []
    follower = InvalidationFeed(settings, recorder(applied))
    publisher = InvalidationFeed(settings, recorder([]))
    try:
        ahead = await redis_ms(publisher._own.client) + 5000
        redis_server.client().xadd(follower.stream, {"x": "1"}, id=f"{ahead}-0")
        await follower.start()
        for namespace in ("first", "second"):
            await publisher.publish(namespace, "", None)
        await until_async(lambda: "second" in applied, lambda: f"applied {applied}", 20.0)
    finally:
        await publisher.close()
        await follower.close()
    assert applied == ["first", "second"]
    assert follower.counters()["l1_feed_refused_messages"] == 0


async def test_invalidations_racing_each_raise_the_generation(
    tier: RedisTier, redis_server: RedisServer
) -> None:
    """Another gateway's invalidation lands while this one raises the same generation, and an
    entry is stored in between: both raises count, so that entry set back is refused by a
    gateway that starts after them."""
    other = RedisTier(tier.settings)
    writer = RedisTier(tier.settings)
    fresh = RedisTier(tier.settings)
    client = redis_server.client()
    gen = tier.generation_keys("ns", "m", KEY)[1]
    copies: list[bytes] = []
    send: Callable[..., Awaitable[Any]] = tier.client.execute_command

    async def land(*args: Any) -> None:
        if not copies and gen in args:
            await other.invalidate("ns", "")
            assert await writer.put("ns", "m", KEY, ANSWER)
            copy = client.get(tier.redis_key("ns", "m", KEY))
            assert isinstance(copy, bytes)
            copies.append(copy)

    async def interleaved(*args: Any, **options: Any) -> Any:
        # The other invalidation lands after this gateway read the generation, or before it
        # wrote it: between the two, were they two commands.
        if args[0] != "GET":
            await land(*args)
        result = await send(*args, **options)
        if args[0] == "GET":
            await land(*args)
        return result

    tier.client.execute_command = interleaved  # type: ignore[method-assign]
    try:
        await tier.invalidate("ns", "")
        assert copies
        assert int(client.get(gen) or 0) == 2
        client.set(tier.redis_key("ns", "m", KEY), copies[0])
        assert await fresh.get("ns", "m", KEY) is None
        assert fresh.counters()["l2_invalidated_entries"] == 1
    finally:
        for each in (other, writer, fresh):
            await each.close()


async def test_a_generation_set_back_below_what_a_gateway_saw_is_raised_above_it(
    tier: RedisTier, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    gen = tier.generation_keys("ns", "m", KEY)[1]
    for _ in range(3):
        await tier.invalidate("ns", "")
    client.set(gen, 1)  # a replica promoted before the raises reached it
    await tier.invalidate("ns", "")
    assert int(client.get(gen) or 0) == 4
    client.set(gen, "not a generation")
    await tier.invalidate("ns", "")
    assert int(client.get(gen) or 0) == 5


async def test_an_entry_of_the_release_before_generations_is_a_plain_miss(
    tier: RedisTier, redis_server: RedisServer
) -> None:
    """During a rolling upgrade the gateways not yet upgraded store entries without generations:
    misses, not counted as corrupt (nothing is damaged) nor as invalidated."""
    name = tier.redis_key("ns", "m", KEY)
    redis_server.client().set(name, tier.seal(name, encode(ANSWER)))
    assert await tier.get("ns", "m", KEY) is None
    counters = tier.counters()
    assert counters["l2_corrupt_entries"] == counters["l2_invalidated_entries"] == 0
    assert await tier.put("ns", "m", KEY, ANSWER)
    assert await tier.get("ns", "m", KEY) == ANSWER


async def test_a_redis_whose_acl_predates_time_and_incr_still_serves_every_gateway(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rolling upgrade reaches the gateways before Redis's ACL: TIME and INCR refused. The L1
    follower starts and applies the other gateways' invalidations, an invalidation raises the
    generation, the breaker stays closed, and what to fix is said once."""
    acl = tmp_path / "users.acl"
    acl.write_text(
        "user default on nopass ~* &* +@all\n"
        f"user appliance on >gateway-password {gateway_acl_rules('+time', '+incr', '+incrby')}\n"
    )
    server = RedisServer(tmp_path)
    server.start(["--aclfile", str(acl)])
    settings = settings_of(
        server, username="appliance", password="gateway-password", breaker_failures=2
    )
    applied: list[str] = []
    follower = InvalidationFeed(settings, recorder(applied))
    publisher = InvalidationFeed(settings, recorder([]))
    tier = RedisTier(settings)
    try:
        with caplog.at_level(logging.WARNING):
            await follower.start()
            assert follower.counters()["l1_feed_in_step"] == 1
            for namespace in ("first", "second", "third"):
                await tier.invalidate(namespace, "")
                await publisher.publish(namespace, "", None)
            await until_async(lambda: "third" in applied, lambda: f"applied {applied}", 20.0)
        assert applied == ["first", "second", "third"]
        assert server.client().get(tier.generation_keys("first", "m", KEY)[1]) == b"1"
        counters = tier.counters()
        assert counters["breaker_opened"] == counters["breaker_open"] == 0
        assert follower.counters()["l1_feed_errors"] == 0
        said = [r.getMessage() for r in caplog.records if "users.acl" in r.getMessage()]
        assert said and len(said) <= 3, said
    finally:
        for each in (follower, publisher):
            await each.close()
        await tier.close()
        server.kill()
