"""The cache in the gateway's request path, against the engine server and a real redis-server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from appliance.cache.entry import CachedAnswer
from appliance.cache.invalidation_feed import InvalidationFeed
from appliance.cache.l2 import RedisSettings, RedisTier
from appliance.cache.seal import Sealer
from appliance.config import CacheConfig, HttpConfig
from appliance.engine.runner import EngineStats
from appliance.gateway.models import load_models
from appliance.gateway.server import RunningGateway, start_server
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.cache.redis_server import RedisServer
from tests.conftest import Engine, Tiny
from tests.support import gateway_config, until_async, until_engine

# The secret every gateway of a test shares to authenticate Redis entries.
MAC_KEY = b"test-cache-mac-key-0123456789abc"
MISS, L1, L2 = pb.CACHE_TIER_MISS, pb.CACHE_TIER_EXACT_L1, pb.CACHE_TIER_EXACT_L2


def cache_config(redis_server: RedisServer | None, **l1: object) -> CacheConfig:
    redis = None
    if redis_server is not None:
        # A budget loose enough for a loaded 2-core CI machine; the slow-Redis test tightens it.
        redis = RedisSettings(
            url=redis_server.url, timeout_ms=200.0, breaker_reset_s=0.2, mac_key=MAC_KEY
        )
    return dataclasses.replace(CacheConfig(redis=redis), **l1)  # type: ignore[arg-type]


class Gateway:
    def __init__(self, running: RunningGateway, channel: grpc.aio.Channel) -> None:
        self.running = running
        self.stub = pb_grpc.InferenceStub(channel)
        self.admin = pb_grpc.CacheAdminStub(channel)
        self._channel = channel

    async def counters(self) -> dict[str, int]:
        return dict((await self.admin.Stats(pb.CacheStatsRequest())).counters)

    async def close(self) -> None:
        await self._channel.close()
        await self.running.drain(0.2)


async def gateway(
    tiny: Tiny,
    engine: Engine,
    cache: CacheConfig,
    fingerprint: Path | None = None,
    http: HttpConfig | None = None,
) -> Gateway:
    config = gateway_config(
        tiny.tokenizer_dir, engine.address, cache=cache, http=http, fingerprint_file=fingerprint
    )
    running = await start_server(config, await load_models(config))
    return Gateway(running, grpc.aio.insecure_channel(f"127.0.0.1:{running.port}"))


@pytest.fixture
async def gw(tiny: Tiny, engine: Engine, redis_server: RedisServer) -> AsyncIterator[Gateway]:
    redis_server.client().flushall()
    g = await gateway(tiny, engine, cache_config(redis_server))
    yield g
    await g.close()


async def counters_until(
    g: Gateway, done: Callable[[dict[str, int]], bool], timeout: float = 20.0
) -> dict[str, int]:
    """Polls the gateway's counters until `done` holds (what it waits for happens in the
    background: writes, stream followers)."""

    last: dict[str, int] = {}

    async def reached() -> dict[str, int] | None:
        last.update(await g.counters())
        return dict(last) if done(last) else None

    return await until_async(reached, lambda: f"counters never got there: {last}", timeout, 0.02)


counter = iter(range(10**9))


def req(prompt: str | None = None, **kw: object) -> pb.GenerateRequest:
    """A deterministic request nobody asked before (unless prompt is given)."""
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    return pb.GenerateRequest(model="tiny", prompt=prompt or f"question {next(counter)}", **kw)  # type: ignore[arg-type]


def started(engine: Engine) -> int:
    stats: EngineStats = engine.models["tensorrt_llm"].runner.stats
    return stats.started


async def settle() -> None:
    """Waits for the write-back tasks (L2 is written off the request path) to finish."""
    writes = [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "") == "RedisTier._write"
    ]
    if writes:
        await asyncio.wait(writes, timeout=10)


async def test_hit_tiers_and_identical_answers_across_gateways(
    gw: Gateway, tiny: Tiny, engine: Engine, redis_server: RedisServer
) -> None:
    r = req()
    before = started(engine)
    miss = await gw.stub.Complete(r)
    assert miss.final.cache_tier == MISS
    hit = await gw.stub.Complete(r)
    assert hit.final.cache_tier == L1
    await settle()
    other = await gateway(tiny, engine, cache_config(redis_server))
    try:
        l2 = await other.stub.Complete(r)
        again = await other.stub.Complete(r)
    finally:
        await other.close()
    assert (l2.final.cache_tier, again.final.cache_tier) == (L2, L1)
    assert started(engine) - before == 1
    for answer in (hit, l2, again):
        assert answer.text == miss.text and list(answer.token_ids) == list(miss.token_ids)
        assert answer.final.finish_reason == miss.final.finish_reason
        assert answer.final.usage == miss.final.usage


async def test_a_streamed_hit_has_the_shape_of_a_miss(gw: Gateway) -> None:
    r = req()
    miss = [m async for m in gw.stub.Generate(r)]
    hit = [m async for m in gw.stub.Generate(r)]
    assert [m.HasField("final") for m in hit] == [False, True]
    assert miss[-1].final.WhichOneof  # both end with one final message
    assert "".join(m.text for m in hit) == "".join(m.text for m in miss)
    assert hit[-1].final.cache_tier == L1 and miss[-1].final.cache_tier == MISS
    assert hit[-1].final.timings.total_us >= hit[-1].final.timings.ttft_us


async def test_tenants_never_see_each_others_answers(gw: Gateway, engine: Engine) -> None:
    r = req()
    r.namespace = "tenant-a"
    await gw.stub.Complete(r)
    before = started(engine)
    r.namespace = "tenant-b"
    b = await gw.stub.Complete(r)
    assert b.final.cache_tier == MISS and started(engine) - before == 1


async def test_a_rebuilt_engine_misses(
    tiny: Tiny, engine: Engine, redis_server: RedisServer, tmp_path: Path
) -> None:
    r = req()
    old = await gateway(tiny, engine, cache_config(redis_server))
    try:
        await old.stub.Complete(r)
        await settle()
    finally:
        await old.close()
    rebuilt = tmp_path / "engine_fingerprint"
    rebuilt.write_text("a-new-engine\n")
    new = await gateway(tiny, engine, cache_config(redis_server), fingerprint=rebuilt)
    try:
        assert (await new.stub.Complete(r)).final.cache_tier == MISS
    finally:
        await new.close()


async def test_a_cancelled_stream_is_never_cached(gw: Gateway, engine: Engine) -> None:
    r = req(max_tokens=1500)
    stats: EngineStats = engine.models["tensorrt_llm"].runner.stats
    cancelled = stats.cancelled
    call = gw.stub.Generate(r)
    await call.read()
    call.cancel()
    await until_engine(stats, lambda: stats.cancelled > cancelled)
    await settle()
    assert (await gw.counters())["writes"] == 0
    before = started(engine)
    call = gw.stub.Generate(r)
    first = await call.read()
    call.cancel()
    assert started(engine) - before == 1 and first.token_ids  # generated again, not a hit


async def test_a_failed_stream_is_never_cached(
    tiny: Tiny, engine_repo: Path, redis_server: RedisServer
) -> None:
    from appliance.engine.server import load_repository as engine_models
    from appliance.engine.server import start_engine

    models = engine_models(engine_repo)
    server, _, port = await start_engine({"tensorrt_llm": models["tensorrt_llm"]}, "127.0.0.1:0")
    engine = Engine(f"127.0.0.1:{port}", None, models, server)  # type: ignore[arg-type]
    g = await gateway(tiny, engine, cache_config(redis_server))
    try:
        await server.stop(grace=None)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await g.stub.Complete(req())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        counters = await g.counters()
        assert counters["writes"] == 0 and counters["l1_entries"] == 0
    finally:
        await g.close()
        for m in models.values():
            m.runner.close()


async def test_single_flight_makes_one_engine_request_for_concurrent_misses(
    gw: Gateway, engine: Engine
) -> None:
    r = req(max_tokens=40)
    before = started(engine)
    answers = await asyncio.gather(*(gw.stub.Complete(r) for _ in range(6)))
    assert started(engine) - before == 1
    assert len({a.text for a in answers}) == 1
    # Each of the other five joined the flight live, or (on a slow machine) arrived after it
    # ended and hit L1: either way, no second engine request.
    counters = await gw.counters()
    assert counters["single_flight_followers"] + counters["l1_hits"] == 5
    assert (
        sum(a.final.cache_tier == MISS for a in answers) == 1 + counters["single_flight_followers"]
    )


async def test_the_leader_cancelling_leaves_the_followers_their_answer(
    gw: Gateway, engine: Engine
) -> None:
    r = req(max_tokens=300)
    reference = await gw.stub.Complete(dataclasses_replace(r, cache_policy=pb.CACHE_POLICY_BYPASS))
    before = started(engine)
    leader = gw.stub.Generate(r)
    await leader.read()
    followers = [asyncio.ensure_future(gw.stub.Complete(r)) for _ in range(3)]
    await counters_until(gw, lambda c: c["single_flight_followers"] == 3)
    leader.cancel()
    answers = await asyncio.gather(*followers)
    assert started(engine) - before == 1
    assert all(a.text == reference.text for a in answers)
    assert (await gw.stub.Complete(r)).final.cache_tier == L1  # complete, so it was cached


def dataclasses_replace(r: pb.GenerateRequest, **fields: object) -> pb.GenerateRequest:
    copy = pb.GenerateRequest()
    copy.CopyFrom(r)
    for k, v in fields.items():
        setattr(copy, k, v)
    return copy


async def test_policies(gw: Gateway, engine: Engine) -> None:
    r = req()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await gw.stub.Complete(dataclasses_replace(r, cache_policy=pb.CACHE_POLICY_ONLY))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    before = started(engine)
    for _ in range(2):
        bypass = await gw.stub.Complete(dataclasses_replace(r, cache_policy=pb.CACHE_POLICY_BYPASS))
        assert bypass.final.cache_tier == MISS
    assert started(engine) - before == 2
    assert (await gw.counters())["writes"] == 0  # BYPASS writes nothing either
    refreshed = await gw.stub.Complete(dataclasses_replace(r, cache_policy=pb.CACHE_POLICY_REFRESH))
    assert refreshed.final.cache_tier == MISS and started(engine) - before == 3
    only = await gw.stub.Complete(dataclasses_replace(r, cache_policy=pb.CACHE_POLICY_ONLY))
    assert only.final.cache_tier == L1 and only.text == refreshed.text
    again = await gw.stub.Complete(dataclasses_replace(r, cache_policy=pb.CACHE_POLICY_REFRESH))
    assert again.final.cache_tier == MISS and started(engine) - before == 4
    sampled = req(temperature=0.8, cache_policy=pb.CACHE_POLICY_ONLY)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await gw.stub.Complete(sampled)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


class PausedEngine:
    """Pauses every generation of a gateway after its first event from the engine (the engine
    was asked: the generation is under way) until `release` is set."""

    def __init__(self, g: Gateway) -> None:
        pipeline = g.running.pipeline
        self.reached = asyncio.Event()
        self.release = asyncio.Event()
        real = pipeline.engine

        async def paused(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            first = True
            async for event in real(*args, **kwargs):
                if first:
                    first = False
                    self.reached.set()
                    await self.release.wait()
                yield event

        pipeline.engine = paused  # type: ignore[method-assign]

    async def generating(self) -> None:
        async with asyncio.timeout(20):
            await self.reached.wait()


@pytest.mark.parametrize("policy", [pb.CACHE_POLICY_DEFAULT, pb.CACHE_POLICY_REFRESH])
async def test_an_answer_generated_across_an_invalidation_is_never_served(
    gw: Gateway, policy: int
) -> None:
    """The generation began before the invalidation and ends after it: neither L1 nor L2 serves
    its answer (it was the question's answer before the invalidation)."""
    r = req(namespace="racing")
    paused = PausedEngine(gw)
    call = gw.stub.Complete(dataclasses_replace(r, cache_policy=policy))
    await paused.generating()
    await gw.admin.Invalidate(pb.InvalidateRequest(namespace="racing"))
    paused.release.set()
    assert (await call).final.cache_tier == MISS
    await settle()
    counters = await gw.counters()
    assert (await gw.stub.Complete(r)).final.cache_tier == MISS
    # That answer, generated after the invalidation, is stored and served.
    await settle()
    assert counters["writes"] >= 1
    assert (await gw.stub.Complete(r)).final.cache_tier == L1


async def test_a_request_sent_after_an_invalidation_does_not_follow_an_older_generation(
    gw: Gateway,
) -> None:
    """Single flight joins requests for the same answer, but not to a generation that began
    before an invalidation covering it: the request sent since gets a generation of its own."""
    r = req(namespace="joining")
    paused = PausedEngine(gw)
    flights = gw.running.pipeline.flights
    led: list[bool] = []
    joined = asyncio.Event()
    real_join = flights.join

    def join(*args: Any, **kwargs: Any) -> Any:
        flight, leads = real_join(*args, **kwargs)
        led.append(leads)
        joined.set()
        return flight, leads

    flights.join = join  # type: ignore[method-assign]
    before = (await gw.counters())["single_flight_followers"]
    first = gw.stub.Complete(r)
    await paused.generating()
    await gw.admin.Invalidate(pb.InvalidateRequest(namespace="joining"))
    joined.clear()
    second = gw.stub.Complete(r)
    async with asyncio.timeout(20):
        await joined.wait()  # the second request chose (its generation waits for the slot)
    paused.release.set()
    assert led == [True, True]
    assert (await first).final.cache_tier == MISS
    assert (await second).final.cache_tier == MISS
    assert (await gw.counters())["single_flight_followers"] == before
    await settle()
    # The second generation began after the invalidation: its answer is stored.
    assert (await gw.stub.Complete(r)).final.cache_tier == L1


async def test_sampled_requests_without_seed_are_not_cached(gw: Gateway, engine: Engine) -> None:
    r = req(temperature=0.9)
    before = started(engine)
    await gw.stub.Complete(r)
    assert (await gw.stub.Complete(r)).final.cache_tier == MISS
    assert started(engine) - before == 2
    seeded = req(temperature=0.9, seed=3)
    await gw.stub.Complete(seeded)
    assert (await gw.stub.Complete(seeded)).final.cache_tier == L1


async def test_invalidate_a_namespace(gw: Gateway, redis_server: RedisServer) -> None:
    r = req()
    r.namespace = "team"
    await gw.stub.Complete(r)
    await settle()
    assert redis_server.client().dbsize() == 1
    removed = await gw.admin.Invalidate(pb.InvalidateRequest(namespace="team"))
    assert (removed.l1_removed, removed.l2_removed) == (1, 1)
    assert (await gw.stub.Complete(r)).final.cache_tier == MISS
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await gw.admin.Invalidate(pb.InvalidateRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_every_cached_answer_names_its_entry_and_one_can_be_dropped_alone(
    gw: Gateway, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The key a client or the access log reports is the one `invalidate --entry` takes."""
    r, other = req(namespace="audit"), req(namespace="audit")
    with caplog.at_level(logging.INFO, logger="appliance.access"):
        miss = await gw.stub.Complete(r)
    entry = miss.final.cache_entry
    assert len(entry) == 32 and bytes.fromhex(entry)
    (line,) = [m for m in caplog.messages if f"request_id='{miss.request_id}'" in m]
    assert line.endswith(f" cache_entry={entry}") and "similarity=" not in line
    await gw.stub.Complete(other)
    hit = await gw.stub.Complete(r)
    assert (hit.final.cache_tier, hit.final.cache_entry) == (L1, entry)
    await settle()
    keys = {k.decode()[-32:] for k in redis_server.keys("appliance:audit:*")}
    assert entry in keys and len(keys) == 2
    for uncached in (req(temperature=0.9), req(cache_policy=pb.CACHE_POLICY_BYPASS)):
        assert (await gw.stub.Complete(uncached)).final.cache_entry == ""
    removed = await gw.admin.Invalidate(pb.InvalidateRequest(namespace="audit", entry=entry))
    assert (removed.l1_removed, removed.l2_removed) == (1, 1)
    assert (await gw.stub.Complete(r)).final.cache_tier == MISS
    assert (await gw.stub.Complete(other)).final.cache_tier == L1


async def test_an_invalidation_reaches_the_l1_of_every_gateway_on_the_redis(
    gw: Gateway, tiny: Tiny, engine: Engine, redis_server: RedisServer
) -> None:
    other = await gateway(tiny, engine, cache_config(redis_server))
    try:
        for g in (gw, other):
            await counters_until(g, lambda c: c["l1_feed_in_step"] == 1)
        team, single, kept = req(namespace="team"), req(namespace="one"), req(namespace="one")
        for r in (team, single, kept):
            await gw.stub.Complete(r)
        await settle()
        for r in (team, single, kept):
            assert (await other.stub.Complete(r)).final.cache_tier == L2
            assert (await other.stub.Complete(r)).final.cache_tier == L1
        removed = await gw.admin.Invalidate(pb.InvalidateRequest(namespace="team"))
        assert (removed.l1_removed, removed.l2_removed) == (1, 1)
        await counters_until(other, lambda c: c["l1_peer_invalidations"] == 1)
        assert (await other.stub.Complete(team)).final.cache_tier == MISS
        # One answer by its key (the hex that ends its Redis key), the rest of the namespace kept.
        name = redis_server.keys("appliance:one:*")[0].decode()
        await gw.admin.Invalidate(pb.InvalidateRequest(namespace="one", entry=name[-32:]))
        await counters_until(other, lambda c: c["l1_peer_invalidations"] == 2)
        tiers = [(await other.stub.Complete(r)).final.cache_tier for r in (single, kept)]
        assert sorted(tiers) == [MISS, L1]
        own = await gw.counters()
        assert own["l1_peer_invalidations"] == 0  # its own messages: applied when it made them
        assert own["l1_feed_errors"] == 0 and (await other.counters())["l1_feed_errors"] == 0
    finally:
        await other.close()


async def test_an_invalidation_with_redis_stalled_says_which_tiers_were_invalidated(
    gw: Gateway, redis_server: RedisServer
) -> None:
    """Redis stalled: the call ends within the tiers' time budgets, UNAVAILABLE, saying that L1
    dropped the answer, that Redis did not (and why) and that the other gateways were not told;
    nothing goes on behind the operator's back. Once Redis answers, the same call finishes it."""
    r = req(namespace="slow")
    await gw.stub.Complete(r)
    await settle()
    redis_server.pause()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await gw.admin.Invalidate(pb.InvalidateRequest(namespace="slow"), timeout=30)
    finally:
        redis_server.resume()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    details = failed.value.details() or ""
    assert "l2 not invalidated (tier l2 (redis) INCR took longer than its 200 ms" in details
    assert "l1 invalidated (1 removed)" in details
    assert "other gateways were not told (redis did not take the message within 2 s)" in details
    assert len(redis_server.keys("appliance:slow:*")) == 1
    removed = await gw.admin.Invalidate(pb.InvalidateRequest(namespace="slow"))
    assert (removed.l1_removed, removed.l2_removed) == (0, 1)


async def test_only_is_unavailable_not_a_miss_while_redis_cannot_be_asked(
    tiny: Tiny, engine: Engine, redis_server: RedisServer
) -> None:
    """cache_policy ONLY with L1 missing and L2 not asked (its breaker open) or not answering:
    the cache may hold the answer, so UNAVAILABLE (503 over HTTP) with a retry hint, naming the
    tier; a true miss stays NOT_FOUND."""
    redis_server.client().flushall()
    g = await gateway(
        tiny, engine, cache_config(redis_server), http=HttpConfig(listen="127.0.0.1:0")
    )
    assert g.running.http is not None
    url = f"http://127.0.0.1:{g.running.http.port}/v1/completions"
    body = {
        "model": "tiny",
        "prompt": "asked while redis is stalled",
        "max_tokens": 8,
        "temperature": 0,
        "appliance": {"cache_policy": "only"},
    }
    r = req(body["prompt"], cache_policy=pb.CACHE_POLICY_ONLY)  # type: ignore[arg-type]
    try:
        redis_server.pause()
        try:
            for _ in range(50):  # timeouts until the breaker opens, then skipped calls
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await g.stub.Complete(r)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "tier l2 (redis)" in (err.value.details() or "")
                trailers = dict(err.value.trailing_metadata() or ())
                assert int(trailers["grpc-retry-pushback-ms"]) >= 1000
                if (await g.counters())["l2_skipped_breaker_open"]:
                    break
            assert "breaker is" in (err.value.details() or "")
            async with aiohttp.ClientSession() as session, session.post(url, json=body) as http:
                assert http.status == 503 and int(http.headers["retry-after"]) >= 1
                assert "tier l2 (redis)" in (await http.json())["error"]["message"]
        finally:
            redis_server.resume()
        cache = g.running.pipeline.cache
        assert cache is not None and isinstance(cache.tiers[1], RedisTier)
        breaker = cache.tiers[1].breaker
        while breaker.retry_in() > 0:  # the breaker's own clock: then the next call probes
            await asyncio.sleep(breaker.retry_in())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await g.stub.Complete(r)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await g.close()


async def test_a_gateway_that_lost_redis_empties_its_l1_when_it_hears_redis_again(
    tiny: Tiny, engine: Engine, redis_server: RedisServer
) -> None:
    """It may have missed other gateways' invalidations meanwhile; its L1 answered all along."""
    redis_server.client().flushall()
    g = await gateway(tiny, engine, cache_config(redis_server))
    try:
        # It listens only once its follower knows where the stream ends.
        assert (await g.counters())["l1_feed_in_step"] == 1
        r = req()
        await g.stub.Complete(r)
        assert (await g.stub.Complete(r)).final.cache_tier == L1
        redis_server.kill()
        await counters_until(g, lambda c: c["l1_feed_in_step"] == 0)
        assert (await g.stub.Complete(r)).final.cache_tier == L1
        redis_server.start()
        counters = await counters_until(g, lambda c: c["l1_feed_clears"] == 1)
        assert counters["l1_feed_in_step"] == 1 and counters["l1_entries"] == 0
        assert (await g.stub.Complete(r)).final.cache_tier != L1
    finally:
        await g.close()


def feed_settings(redis_server: RedisServer) -> RedisSettings:
    """The cache's Redis settings, on an emptied Redis (a feed test starts from no stream)."""
    redis_server.client().flushall()
    settings = cache_config(redis_server).redis
    assert settings is not None
    return settings


def recorder(applied: list[str]) -> Callable[[str, str, bytes | None], int]:
    """A feed's `apply` that records each namespace ("everything" for L1 emptied)."""

    def apply(namespace: str, model: str, entry: bytes | None) -> int:
        applied.append(namespace or "everything")
        return 0

    return apply


async def test_the_invalidation_follower_outlives_a_failure_of_its_own(
    redis_server: RedisServer,
) -> None:
    """Any exception, not only Redis's, is a lost step: L1 is emptied once back and the next
    messages apply (a follower that died would leave l1_feed_in_step at 1, missing them all)."""
    settings = feed_settings(redis_server)
    applied: list[str] = []
    record = recorder(applied)

    def apply(namespace: str, model: str, entry: bytes | None) -> int:
        record(namespace, model, entry)
        if len(applied) == 1:
            raise RuntimeError("a fault of the follower's own")
        return 0

    follower, publisher = InvalidationFeed(settings, apply), InvalidationFeed(settings, apply)
    await follower.start()
    assert follower.following  # start returns once it has read where the stream ends
    try:
        await until_async(lambda: follower.following, "the follower never followed", 20.0)
        await publisher.publish("first", "", None)
        await until_async(lambda: follower.counts.cleared, "the follower never cleared L1", 20.0)
        await publisher.publish("second", "", None)
        await until_async(lambda: applied[-1] == "second", lambda: f"applied {applied}", 20.0)
        assert applied == ["first", "everything", "second"]
        assert follower.following and follower.counts.errors == 1
    finally:
        await follower.close()
        await publisher.close()


async def test_the_feed_starts_once_it_knows_the_stream_end_or_that_redis_is_down(
    redis_server: RedisServer,
) -> None:
    """The gateway starts listening after `start`: with Redis up the follower is in step by
    then; with Redis down `start` does not wait out its bound (the follower empties L1 when
    Redis is back)."""
    settings = feed_settings(redis_server)
    up = InvalidationFeed(settings, lambda *_: 0)
    down = InvalidationFeed(
        dataclasses.replace(settings, url="redis://127.0.0.1:1/0"), lambda *_: 0
    )
    try:
        await up.start()
        assert up.following
        async with asyncio.timeout(10):  # start's own bound is 60 s here
            await down.start(wait_s=60.0)
        assert not down.following and down.counts.errors == 1
    finally:
        await up.close()
        await down.close()


async def test_a_gateway_listening_before_its_follower_read_the_stream_empties_l1_then(
    redis_server: RedisServer,
) -> None:
    """`start` gave up waiting on the follower's first read: the gateway listens and L1 takes
    answers, so that read, when it comes, empties L1 (invalidations before the position it finds
    were never heard). A start that saw the read clears nothing."""
    settings = feed_settings(redis_server)
    applied: list[str] = []
    apply = recorder(applied)
    late, timely = InvalidationFeed(settings, apply), InvalidationFeed(settings, apply)
    try:
        await late.start(wait_s=0)  # returns before the follower has run at all
        assert not late.following
        await until_async(lambda: late.following, "the follower never read the stream", 10.0)
        assert applied == ["everything"] and late.counts.cleared == 1
        await timely.start()
        assert timely.following and timely.counts.cleared == 0 and applied == ["everything"]
    finally:
        await late.close()
        await timely.close()


async def test_invalidations_without_the_gateways_mac_are_dropped_counted_and_said_once(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever can write to Redis cannot empty a gateway's L1: a message without a tag (what
    a gateway of an older version sends too), one sealed with another secret, a replay of a
    sealed one and one sealed long before Redis appended it are dropped, counted and logged
    once; the gateways' own messages apply."""
    settings = feed_settings(redis_server)
    applied: list[str] = []
    follower = InvalidationFeed(settings, recorder(applied))
    publisher = InvalidationFeed(settings, recorder([]))
    stranger = InvalidationFeed(
        dataclasses.replace(settings, mac_key=b"another-gateways-secret-0123456"), recorder([])
    )
    client = redis_server.client()
    stream = follower.stream
    stale = Sealer(MAC_KEY).seal_message(
        stream,
        {"ns": "stale", "model": "", "entry": "", "from": "gone", "seq": "1", "at": "1000"},
    )
    try:
        await follower.start()
        with caplog.at_level(logging.WARNING, logger="appliance.cache.invalidation_feed"):
            client.xadd(stream, {"ns": "", "model": "", "entry": "", "from": "an-old-gateway"})
            await stranger.publish("", "", None)
            await publisher.publish("first", "", None)
            last: Any = client.xrevrange(stream, count=1)
            client.xadd(stream, last[0][1])  # the same message again
            client.xadd(stream, stale)  # type: ignore[arg-type]
            await publisher.publish("second", "", None)
            await until_async(lambda: "second" in applied, lambda: f"applied {applied}", 20.0)
    finally:
        for feed in (follower, publisher, stranger):
            await feed.close()
    assert applied == ["first", "second"]
    assert follower.counters()["l1_feed_refused_messages"] == 4
    [line] = [
        r.getMessage() for r in caplog.records if r.name == "appliance.cache.invalidation_feed"
    ]
    assert "it carries no tag" in line and "mac_key_file" in line


async def test_a_gateway_started_after_a_message_refuses_its_replay(
    redis_server: RedisServer,
) -> None:
    """A gateway that starts has heard none of the messages before it: a copy of one appended
    again (at once, or after the stream was deleted, under its own id) is refused and counted,
    not applied; the messages sent after it started apply."""
    settings = feed_settings(redis_server)
    client = redis_server.client()
    publisher = InvalidationFeed(settings, recorder([]))
    applied: list[str] = []
    restarted = InvalidationFeed(settings, recorder(applied))
    try:
        await publisher.start()
        await publisher.publish("replayed", "", None)
        stored: Any = client.xrange(publisher.stream)
        ((message_id, fields),) = stored
        await restarted.start()
        client.xadd(publisher.stream, fields)
        await until_async(
            lambda: applied or restarted.counters()["l1_feed_refused_messages"], "not read"
        )
        client.delete(publisher.stream)
        client.xadd(publisher.stream, fields, id=message_id)
        await publisher.publish("after", "", None)
        await until_async(lambda: "after" in applied, lambda: f"applied {applied}", 20.0)
    finally:
        await publisher.close()
        await restarted.close()
    assert applied == ["after"]
    assert restarted.counters()["l1_feed_refused_messages"] == 1


async def test_a_feed_without_a_mac_key_applies_sealed_and_unsealed_messages(
    redis_server: RedisServer,
) -> None:
    """Without a key the feed works as it did before messages were sealed; a sealed message
    is read as before by such a feed, as by a gateway of an older version."""
    settings = feed_settings(redis_server)
    keyless = dataclasses.replace(settings, mac_key=None)
    applied: list[str] = []
    follower = InvalidationFeed(keyless, recorder(applied))
    sealed, unsealed = (
        InvalidationFeed(settings, recorder([])),
        InvalidationFeed(keyless, recorder([])),
    )
    try:
        await follower.start()
        await sealed.publish("sealed", "", None)
        await unsealed.publish("unsealed", "", None)
        redis_server.client().xadd(
            follower.stream, {"ns": "old", "model": "", "entry": "", "from": "o"}
        )
        await until_async(lambda: len(applied) == 3, lambda: f"applied {applied}", 20.0)
    finally:
        for feed in (follower, sealed, unsealed):
            await feed.close()
    assert applied == ["sealed", "unsealed", "old"]
    assert follower.counters()["l1_feed_refused_messages"] == 0


async def test_redis_killed_mid_load_and_restarted(
    tiny: Tiny, engine: Engine, redis_server: RedisServer
) -> None:
    redis_server.client().flushall()
    g = await gateway(tiny, engine, cache_config(redis_server, l1_max_entries=0))
    prompts = [req() for _ in range(6)]
    failures = 0

    async def load(rounds: int) -> None:
        nonlocal failures
        for i in range(rounds):
            try:
                await g.stub.Complete(prompts[i % len(prompts)], timeout=30)
            except grpc.aio.AioRpcError:
                failures += 1

    try:
        await load(12)
        killer = threading.Thread(target=redis_server.kill)
        killer.start()
        await load(12)
        killer.join()
        await load(12)  # Redis is down: every request is a miss, none fails
        down = await g.counters()
        assert down["l2_errors"] + down["l2_timeouts"] + down["l2_skipped_breaker_open"] > 0
        redis_server.start()
        cache = g.running.pipeline.cache
        assert cache is not None and isinstance(cache.tiers[1], RedisTier)
        breaker = cache.tiers[1].breaker
        while breaker.retry_in() > 0:  # the breaker's own clock: then the next call probes
            await asyncio.sleep(breaker.retry_in())
        await load(12)
        await settle()
        hits_before = (await g.counters())["l2_hits"]
        await load(12)
        assert (await g.counters())["l2_hits"] > hits_before  # hits resume after the restart
    finally:
        await g.close()
    assert failures == 0


async def test_slow_redis_does_not_make_requests_miss_their_deadline(
    tiny: Tiny, engine: Engine, redis_server: RedisServer
) -> None:
    redis_server.client().flushall()
    cache = cache_config(redis_server, l1_max_entries=0)
    assert cache.redis is not None
    cache = dataclasses.replace(cache, redis=dataclasses.replace(cache.redis, timeout_ms=5.0))
    g = await gateway(tiny, engine, cache)
    try:
        redis_server.pause()
        for _ in range(3):
            answer = await g.stub.Complete(req(max_tokens=4), timeout=1.0)
            assert answer.final.cache_tier == MISS
        counters = await g.counters()
        assert counters["l2_timeouts"] >= 1
        assert counters["l2_timeouts"] + counters["l2_skipped_breaker_open"] >= 3
    finally:
        redis_server.resume()
        await g.close()


async def test_more_lookups_than_connections_wait_for_one_instead_of_failing(
    redis_server: RedisServer,
) -> None:
    # A burst larger than the pool is not a Redis fault: it must neither miss nor open the breaker.
    tier = RedisTier(
        RedisSettings(url=redis_server.url, timeout_ms=5000.0, max_connections=2, mac_key=MAC_KEY)
    )
    answer = CachedAnswer("an answer", (1, 2, 3), "stop", 4, 3)
    try:
        assert await tier.put("ns", "m", b"k" * 16, answer)
        hits = await asyncio.gather(*(tier.get("ns", "m", b"k" * 16) for _ in range(64)))
    finally:
        await tier.close()
    assert hits == [answer] * 64
    faults = tier.metrics
    assert (faults.l2_errors, faults.l2_timeouts, faults.breaker_opened) == (0, 0, 0)
    assert tier.breaker.state == "closed"
