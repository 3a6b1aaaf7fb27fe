"""The L2 tier through Redis Sentinel: the primary is killed under load, the Sentinels promote the
replica, and the gateway goes on answering (L1 and the engine while no primary answers), then finds
the new primary and answers from L2 again, without a restart. Real redis-server and
redis-sentinel processes on loopback, with the redis role's ACL users (the Sentinels require a
login, from the gateways and from each other); the gateway and engine server in this process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis

from appliance.cache.l2 import TLS_CONNECT_S, RedisSettings, RedisTier
from appliance.cache.tiers import TierUnavailable
from appliance.config import CacheConfig
from appliance.v1 import inference_pb2 as pb
from tests.cache.redis_server import SentinelGroup, TlsFiles
from tests.cache.test_cache_e2e import MAC_KEY, Gateway, counters_until, gateway
from tests.cache.test_l2_faults import ANSWER, KEY
from tests.cache.test_semantic_e2e import QUESTION, ask, semantic_config
from tests.conftest import Engine, Tiny
from tests.support import until

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


def _settings(group: SentinelGroup, **changes: object) -> RedisSettings:
    """The gateway's settings as the appliance role writes them: its ACL user at the primary
    and at the Sentinels."""
    auth = group.gateway_auth
    settings = RedisSettings(
        username=auth["username"],
        password=auth["password"],
        sentinels=group.addresses,
        sentinel_service=group.name,
        sentinel_username=auth["username"],
        sentinel_password=auth["password"],
        timeout_ms=200.0,  # a loaded 2-core CI machine
        breaker_reset_s=0.2,
        mac_key=MAC_KEY,
    )
    return dataclasses.replace(settings, **changes)  # type: ignore[arg-type]


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
    settings = _settings(group)
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
    # The Sentinel asked may hear of the failover a hello period after the ones that made it.
    assert group.replica.port != old_port
    until(
        lambda: group.primary_port() == group.replica.port,
        "the Sentinels do not name the replica as primary",
        30,
        0.2,
    )
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
    await _followers_reach_the_other_gateway(
        tiny, engine, _settings(group, url="redis://127.0.0.1:1/0"), embedder_dir
    )


async def _followers_reach_the_other_gateway(
    tiny: Tiny, engine: Engine, settings: RedisSettings, embedder_dir: Path
) -> None:
    """Two gateways on `settings`: a semantic entry the first writes, and an invalidation it
    sends, reach the second through the followers."""
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
    tier = RedisTier(_settings(group, breaker_reset_s=RedisSettings.breaker_reset_s))
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


# What would point the gateways at another Redis, or take theirs away.
REPOINTING = [
    ("SENTINEL", "SET", "appliance", "quorum", "1"),
    ("SENTINEL", "REMOVE", "appliance"),
    ("SENTINEL", "MONITOR", "other", "127.0.0.1", "1", "1"),
    ("SENTINEL", "FAILOVER", "appliance"),
    ("SENTINEL", "RESET", "*"),
    ("SENTINEL", "CONFIG", "SET", "resolve-hostnames", "yes"),
    ("SENTINEL", "FLUSHCONFIG"),
    ("ACL", "SETUSER", "default", "on", "nopass", "+@all"),
    ("SHUTDOWN",),
]


def test_the_sentinels_refuse_whoever_would_repoint_the_gateways(group: SentinelGroup) -> None:
    """Without a login nothing is answered; the gateways' user and the Sentinels' own may read
    where the primary is (and the Sentinels vote), never change what they monitor."""
    port = group.sentinel_ports[0]
    # A client that sends commands without AUTH (redis-py would open with HELLO).
    with socket.create_connection(("127.0.0.1", port), timeout=10) as anonymous:
        replies = anonymous.makefile("rb")
        for command in [("PING",), *REPOINTING]:
            anonymous.sendall(
                b"*%d\r\n" % len(command)
                + b"".join(b"$%d\r\n%s\r\n" % (len(a), a.encode()) for a in command)
            )
            assert replies.readline().startswith(b"-NOAUTH"), command
    wrong = group.sentinel(port, username="appliance", password="guess")
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    peer = group.sentinel(port, username="sentinel", password=group.PASSWORDS["sentinel"])
    for who in (group.sentinel(port), peer):
        assert who.ping()
        for command in REPOINTING:
            with pytest.raises(redis.exceptions.NoPermissionError):
                who.execute_command(*command)  # type: ignore[no-untyped-call]
    address = group.sentinel(port).execute_command(  # type: ignore[no-untyped-call]
        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", group.name
    )
    assert int(address[1]) == group.primary.port
    assert group.sentinel(port).sentinel_slaves(group.name)


@pytest.mark.parametrize("password", [None, "guess"])
async def test_a_gateway_the_sentinels_refuse_says_which_setting_to_fix(
    group: SentinelGroup, caplog: pytest.LogCaptureFixture, password: str | None
) -> None:
    """L2 is unavailable (misses), and the log line names the Sentinels' credential, never a
    password."""
    settings = _settings(group, sentinel_password=password)
    tier = RedisTier(settings)
    try:
        told = await tier.check()
    finally:
        await tier.close()
    assert told.startswith(f"redis at '{group.name}' of Sentinels ")
    assert f"unreachable (No master found for '{group.name}': " in told
    assert "AuthenticationError" in told and "<redis" not in told, told  # no client's repr
    lines = [r.getMessage() for r in caplog.records if r.name == "appliance.cache.l2"]
    assert any("sentinel_password_file" in line for line in lines), lines
    secrets = [s for s in (settings.password, password) if s]
    assert not any(s in line for s in secrets for line in [*lines, told])


async def test_a_dead_sentinel_is_passed_over(group: SentinelGroup) -> None:
    """One Sentinel down (its host lost, or stopped for maintenance) while the other two
    answer: the gateway asks the next one, and L2 keeps answering."""
    tier = RedisTier(_settings(group))
    try:
        assert await tier.check() == ""
        assert tier._sentinel is not None
        # The Sentinel the gateway asks first: the one that answered last.
        first = tier._sentinel.sentinels[0].connection_pool.connection_kwargs["port"]
        group.kill_sentinel(first)
        await tier.client.connection_pool.disconnect()
        assert await tier.put("ns", "m", KEY, ANSWER)
        assert await tier.get("ns", "m", KEY) == ANSWER
        assert tier.counters()["l2_timeouts"] == 0
    finally:
        await tier.close()


async def test_a_sentinel_user_without_discovery_says_which_rules_to_give(
    group: SentinelGroup, caplog: pytest.LogCaptureFixture
) -> None:
    """Logged in as a Sentinel user the Sentinels do not let ask where the primary is (here the
    Sentinels' own): L2 is unavailable and the log line says which user lacks what."""
    settings = _settings(
        group, sentinel_username="sentinel", sentinel_password=group.PASSWORDS["sentinel"]
    )
    tier = RedisTier(settings)
    try:
        told = await tier.check()
    finally:
        await tier.close()
    assert "unreachable" in told and "'sentinel|masters'" in told, told
    lines = [r.getMessage() for r in caplog.records if r.name == "appliance.cache.l2"]
    assert any("sentinel_username names lacks this command" in line for line in lines), lines


@pytest.fixture
def tls_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    workdir = tmp_path_factory.mktemp("sentinel-tls")
    g = SentinelGroup(workdir, tls=TlsFiles.make(workdir / "tls"))
    try:
        g.start()  # the replica in sync and every Sentinel knowing it: over TLS
        yield g
    finally:
        g.stop()


def _plaintext_ping(port: int) -> bytes:
    """What a port answers a PING sent in the clear (b"": it closed the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"PING\r\n")
        try:
            return conn.recv(64)
        except ConnectionResetError:
            return b""


async def test_with_tls_the_gateway_talks_tls_to_the_sentinels_and_through_a_failover(
    tls_group: SentinelGroup,
) -> None:
    """Servers and Sentinels take TLS only (replication and the Sentinels' links are TLS): a
    gateway with a rediss:// url asks the Sentinels over TLS too, and follows a failover."""
    group = tls_group
    assert group.tls is not None
    for port in (group.primary.port, group.replica.port, *group.sentinel_ports):
        assert _plaintext_ping(port) == b"", port
    tier = RedisTier(_settings(group, url="rediss://127.0.0.1:1/0", tls_ca_file=str(group.tls.ca)))
    try:
        assert await tier.check() == ""
        assert await tier.put("ns", "m", KEY, ANSWER)
        assert await tier.get("ns", "m", KEY) == ANSWER
        assert group.primary.client().wait(1, 5000) == 1
        group.primary.kill()
        until(
            lambda: group.primary_port() == group.replica.port,
            "the Sentinels do not name the replica as primary",
            30,
            0.2,
        )
        await tier.client.connection_pool.disconnect()
        # The breaker may be open from the calls that failed meanwhile: until it probes again.
        deadline = time.monotonic() + 30
        while not await tier.put("ns", "m", KEY, ANSWER):
            assert time.monotonic() < deadline, tier.counters()
            await asyncio.sleep(0.1)
        assert group.replica.client().get(tier.redis_key("ns", "m", KEY)) is not None
    finally:
        await tier.close()


@pytest.mark.parametrize("sentinels", [(), ("10.0.0.2:26379", "10.0.0.3:26379")])
async def test_a_tls_connection_is_given_time_for_its_handshake(
    sentinels: tuple[str, ...],
) -> None:
    """A new TLS connection (to Redis or a Sentinel) is a handshake more than TCP: with a
    request's 20 ms as its timeout, the start-up check (1 s) on a loaded host finds no primary
    and the gateway starts with L2 off. A request's own budget still bounds it."""
    settings = RedisSettings(url="rediss://10.0.0.2:6379/0", sentinels=sentinels, mac_key=MAC_KEY)
    tier = RedisTier(settings)
    try:
        kwargs = tier.client.connection_pool.connection_kwargs
        assert kwargs["socket_connect_timeout"] >= TLS_CONNECT_S
        if tier._sentinel is not None:
            assert tier._sentinel.sentinel_kwargs["socket_connect_timeout"] >= TLS_CONNECT_S
            assert tier._sentinel.sentinel_kwargs["ssl"] is True
    finally:
        await tier.close()


async def test_with_tls_the_stream_followers_use_the_primary_the_sentinels_name(
    tiny: Tiny, engine: Engine, tls_group: SentinelGroup, embedder_dir: Path
) -> None:
    """The followers (semantic entries, invalidations) through the primary the Sentinels name,
    with every link TLS."""
    assert tls_group.tls is not None
    settings = _settings(tls_group, url="rediss://127.0.0.1:1/0", tls_ca_file=str(tls_group.tls.ca))
    await _followers_reach_the_other_gateway(tiny, engine, settings, embedder_dir)
