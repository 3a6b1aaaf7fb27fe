"""The L2 tier through Redis Sentinel: the primary is killed under load, the Sentinels promote the
replica, and the gateway goes on answering (L1 and the engine while no primary answers), then finds
the new primary and answers from L2 again, without a restart. Real redis-server and
redis-sentinel processes on loopback; the gateway and engine server in this process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from appliance.cache.l2 import RedisSettings, RedisTier
from appliance.cache.tiers import TierUnavailable
from appliance.config import CacheConfig
from appliance.v1 import inference_pb2 as pb
from tests.cache.redis_server import SentinelGroup
from tests.cache.test_cache_e2e import MAC_KEY, Gateway, counters_until, gateway
from tests.cache.test_semantic_e2e import QUESTION, ask, semantic_config
from tests.conftest import Engine, Tiny

L2 = pb.CACHE_TIER_EXACT_L2
PROMPTS = [f"fleet question {n}" for n in range(6)]


@pytest.fixture
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    g = SentinelGroup(tmp_path_factory.mktemp("sentinel"))
    try:
        g.start()
        yield g
    finally:
        g.stop()


@dataclass
class Load:
    """Requests sent until `stop` is set: each outcome with its time (monotonic seconds)."""

    gw: Gateway
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    answers: list[tuple[float, int]] = field(default_factory=list)  # (time sent, cache tier)
    failures: list[str] = field(default_factory=list)
    # Set by an L2 answer to a request sent after `since`.
    l2_hit: asyncio.Event = field(default_factory=asyncio.Event)
    since: float = 0.0

    async def worker(self, n: int) -> None:
        k = n
        while not self.stop.is_set():
            k += 1
            # Mostly repeated deterministic questions (L2 answers them with L1 off), and a sampled
            # request now and then (never cached: always the engine).
            sampled = k % 5 == 0
            request = pb.GenerateRequest(
                model="tiny",
                prompt="tell me something" if sampled else PROMPTS[k % len(PROMPTS)],
                max_tokens=4,
                temperature=1.0 if sampled else 0.0,
            )
            sent = time.monotonic()
            try:
                reply = await self.gw.stub.Complete(request, timeout=30)
            except grpc.aio.AioRpcError as exc:
                self.failures.append(f"{exc.code().name}: {exc.details()}")
                continue
            self.answers.append((sent, reply.final.cache_tier))
            if reply.final.cache_tier == L2 and sent > self.since:
                self.l2_hit.set()


async def test_losing_the_primary_degrades_to_l1_then_l2_resumes(
    tiny: Tiny, engine: Engine, group: SentinelGroup
) -> None:
    settings = RedisSettings(
        sentinels=group.addresses,
        sentinel_service=group.name,
        timeout_ms=200.0,  # a loaded 2-core CI machine
        breaker_reset_s=0.2,
        mac_key=MAC_KEY,
    )
    # L1 off: every repeated question is an L2 lookup, so the answers show when L2 answers.
    gw = await gateway(tiny, engine, CacheConfig(l1_max_entries=0, redis=settings))
    load = Load(gw)
    workers = [asyncio.ensure_future(load.worker(n)) for n in range(2)]
    try:
        await asyncio.wait_for(load.l2_hit.wait(), 60)
        # Every answer written so far is on the replica before the primary dies.
        primary = group.primary.client()
        assert primary.wait(1, 5000) == 1
        old_port = group.primary.port
        load.l2_hit.clear()
        group.primary.kill()
        killed = load.since = time.monotonic()
        await asyncio.wait_for(load.l2_hit.wait(), 60)
        # The invalidation feed lost its connection with the primary: it follows the new one, L1
        # emptied once (invalidations may have been missed meanwhile).
        await counters_until(gw, lambda c: c["l1_feed_clears"] >= 1 and c["l1_feed_in_step"] == 1)
        # A little more load on the new primary, then stop.
        await asyncio.sleep(0.5)
    finally:
        load.stop.set()
        await asyncio.gather(*workers)
        counters = await gw.counters()
        await gw.close()

    assert load.failures == [], load.failures[:5]
    assert group.primary_port() == group.replica.port != old_port
    before = [t for t, tier in load.answers if t < killed and tier == L2]
    after = [t for t, tier in load.answers if t > killed and tier == L2]
    assert before and after
    resumed = after[0]
    gap = resumed - killed
    without = sum(1 for t, _ in load.answers if killed < t < resumed)
    print(
        f"\nsentinel failover: {len(load.answers)} requests, 0 failed; no L2 answer for"
        f" {gap:.2f} s after the primary was killed (down-after {group.down_after_ms} ms),"
        f" {without} requests answered by the engine meanwhile; redis errors"
        f" {counters.get('l2_errors', 0)}, timeouts {counters.get('l2_timeouts', 0)}",
        file=sys.stderr,
    )


async def test_the_stream_followers_use_the_primary_the_sentinels_name(
    tiny: Tiny, engine: Engine, group: SentinelGroup, embedder_dir: Path
) -> None:
    """Not the host in `url` (nothing listens there): the semantic tier's entries and every
    invalidation reach the other gateway through the primary the Sentinels name."""
    settings = RedisSettings(
        url="redis://127.0.0.1:1/0",
        sentinels=group.addresses,
        sentinel_service=group.name,
        timeout_ms=200.0,
        breaker_reset_s=0.2,
        mac_key=MAC_KEY,
    )
    config = dataclasses.replace(semantic_config(None, embedder_dir), redis=settings)
    first = await gateway(tiny, engine, config)
    other = await gateway(tiny, engine, config)
    try:
        for g in (first, other):
            await counters_until(
                g, lambda c: c["semantic_in_sync"] == 1 and c["l1_feed_in_step"] == 1
            )
        await first.stub.Complete(ask(QUESTION))
        await counters_until(other, lambda c: c["semantic_entries"] == 1)
        assert (await other.stub.Complete(ask(QUESTION))).final.cache_tier == L2
        await first.admin.Invalidate(pb.InvalidateRequest(namespace="sem"))
        counters = await counters_until(
            other, lambda c: c["semantic_entries"] == 0 and c["l1_peer_invalidations"] == 1
        )
        assert counters["l1_entries"] == 0
        assert counters["semantic_follower_errors"] == counters["l1_feed_errors"] == 0
    finally:
        await other.close()
        await first.close()


async def test_an_invalidation_no_replica_acknowledged_is_reported(group: SentinelGroup) -> None:
    """Replication is asynchronous: a generation raised on the primary and lost with it would
    come back lower on the promoted replica, and the answers it refused would be served again.
    An invalidation reports whether a replica has taken it."""
    settings = RedisSettings(
        sentinels=group.addresses,
        sentinel_service=group.name,
        timeout_ms=200.0,  # a loaded 2-core CI machine
        mac_key=MAC_KEY,
    )
    tier = RedisTier(settings)
    gen = tier.generation_keys("ns", "", b"")[1]
    try:
        assert await tier.invalidate("ns", "") == 0
        assert group.replica.client().get(gen) == b"1"
        group.replica.pause()
        try:
            with pytest.raises(TierUnavailable, match="no replica acknowledged"):
                await tier.invalidate("ns", "")
        finally:
            group.replica.resume()
        assert group.primary.client().get(gen) == b"2"
        assert tier.counters()["breaker_open"] == 0
    finally:
        await tier.close()
