"""The Redis tier against a real redis-server holding values no gateway wrote."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from appliance.cache.entry import CachedAnswer
from appliance.cache.keys import ModelIdentity, SamplingKey
from appliance.cache.l2 import RedisSettings, RedisTier
from appliance.cache.tiers import CacheQuery, TierUnavailable
from appliance.tools.processes import free_port
from tests.cache.redis_server import RedisServer, gateway_acl_rules
from tests.support import until

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
async def test_a_key_of_another_type_is_a_miss_not_a_failing_redis(
    tier: RedisTier, redis_server: RedisServer, kind: str
) -> None:
    """MGET (the entry and its generations in one round trip) reads it as no value."""
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
    assert (counters["l2_errors"], counters["breaker_open"], counters["breaker_opened"]) == (
        0,
        0,
        0,
    )
    # The answer written after the miss replaces the foreign value.
    assert await tier.put("ns", "m", KEY, ANSWER)
    assert await tier.get("ns", "m", KEY) == ANSWER


async def test_a_full_redis_refusing_writes_still_serves_what_it_holds(
    tier: RedisTier, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    assert await tier.put("ns", "m", KEY, ANSWER)
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")  # every write is refused with OOM from now on
    try:
        with caplog.at_level(logging.WARNING, logger="appliance.cache.l2"):
            for n in range(2 * tier.breaker.threshold):
                assert not await tier.put("ns", "m", bytes([n]) * 16, ANSWER)
            assert await tier.get("ns", "m", KEY) == ANSWER
    finally:
        client.config_set("maxmemory", "0")
    counters = tier.counters()
    assert counters["l2_errors"] == 2 * tier.breaker.threshold
    assert (counters["breaker_open"], counters["l2_skipped_breaker_open"]) == (0, 0)
    [line] = [r.getMessage() for r in caplog.records if r.name == "appliance.cache.l2"]
    assert "refused SET" in line and "maxmemory-policy" in line


@pytest.mark.parametrize("size", [15, 65])
def test_a_mac_key_blake2b_cannot_take_is_refused_when_the_tier_is_made(size: int) -> None:
    # Accepted, a key of 65 bytes would fail every seal and every open: each lookup an error.
    with pytest.raises(ValueError, match="needs 16 to 64"):
        RedisTier(RedisSettings(mac_key=b"k" * size))


async def test_entries_sealed_with_another_secret_are_misses_said_once(
    tier: RedisTier, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    other = RedisTier(
        RedisSettings(url=redis_server.url, mac_key=b"another-gateways-secret-0123456")
    )
    try:
        keys = [bytes([n]) * 16 for n in range(5)]
        for key in keys:
            assert await other.put("ns", "m", key, ANSWER)
        with caplog.at_level(logging.WARNING, logger="appliance.cache.l2"):
            for key in keys:
                assert await tier.get("ns", "m", key) is None
    finally:
        await other.close()
    assert tier.counters()["l2_forged_entries"] == len(keys)
    [line] = [r.getMessage() for r in caplog.records if r.name == "appliance.cache.l2"]
    assert "mac_key_file" in line


async def test_an_invalidation_of_a_stalled_redis_fails_within_the_time_budget_saying_why(
    redis_server: RedisServer,
) -> None:
    """Each command (GET and SET of its generation, SCAN and UNLINK) of an invalidation has the tier's time budget, as a lookup has: a
    stalled Redis is a failure the operator is told of, not a call that never ends."""
    redis_server.client().flushall()
    tier = RedisTier(RedisSettings(url=redis_server.url, timeout_ms=100.0, mac_key=MAC_KEY))
    try:
        assert await tier.put("ns", "m", KEY, ANSWER)
        redis_server.pause()
        try:
            async with asyncio.timeout(30):  # a hang fails here, not the suite
                with pytest.raises(TierUnavailable) as err:
                    await tier.invalidate("ns", "")
        finally:
            redis_server.resume()
        # The first command: the INCR of the generation the invalidation raises.
        assert str(err.value) == "tier l2 (redis) INCR took longer than its 100 ms time budget"
        assert tier.counters()["l2_timeouts"] == 1
        assert await tier.invalidate("ns", "") == 1  # Redis answers again: done
    finally:
        await tier.close()


@pytest.mark.parametrize("password", [None, "not-the-password"])
async def test_redis_refusing_the_credentials_is_logged_once_with_what_to_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, password: str | None
) -> None:
    """NOAUTH (no password given) or WRONGPASS: one line naming the setting to fix, never the
    password; every failed call is still counted, and the breaker opens as for any fault."""
    server = RedisServer(tmp_path)
    server.start()
    server.client().config_set("requirepass", "the-real-password")
    # A budget far above connect + AUTH on a busy runner: the refusal, not a timeout, is counted.
    tier = RedisTier(
        RedisSettings(
            url=server.url,
            password=password,
            breaker_failures=3,
            mac_key=MAC_KEY,
            timeout_ms=5000.0,
        )
    )
    try:
        with caplog.at_level(logging.WARNING, logger="appliance.cache.l2"):
            for _ in range(3):
                assert await tier.get("ns", "m", KEY) is None
    finally:
        await tier.close()
        server.kill()
    assert tier.counters()["l2_errors"] == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "appliance.cache.l2"]
    [told] = [line for line in lines if "password_file" in line]
    assert "redis refused this gateway" in told and "ACL" in told
    assert not any(password and password in line for line in lines)


@pytest.mark.parametrize(
    ("namespace", "model", "entry"),
    [("ns", "m", None), ("ns", "", None), ("", "m", None), ("", "", None), ("", "", KEY)],
)
async def test_an_entry_set_back_after_its_invalidation_is_a_counted_miss(
    tier: RedisTier,
    redis_server: RedisServer,
    namespace: str,
    model: str,
    entry: bytes | None,
) -> None:
    """Whatever can write to Redis can copy a sealed entry and SET it back after an invalidation
    unlinked it: neither the gateway that invalidated, nor one that starts later, serves it; an
    answer stored after the invalidation is served. The gateway that heard of the invalidation
    refuses the copy even when the writer deletes every other key too."""
    other = RedisTier(tier.settings)
    client = redis_server.client()
    name = tier.redis_key("ns", "m", KEY)
    untouched = tier.redis_key("ns2", "m2", bytes(16))
    try:
        assert await tier.put("ns", "m", KEY, ANSWER)
        assert await tier.put("ns2", "m2", bytes(16), ANSWER)
        copy = client.get(name)
        assert copy is not None
        await tier.invalidate(namespace, model, entry)
        client.set(name, copy)
        assert await tier.get("ns", "m", KEY) is None
        assert await other.get("ns", "m", KEY) is None
        assert tier.counters()["l2_invalidated_entries"] == 1
        assert other.counters()["l2_invalidated_entries"] == 1
        if entry is not None or namespace or model:
            assert await tier.get("ns2", "m2", bytes(16)) == ANSWER  # outside the invalidation
        for key in client.keys("*"):
            if key not in (name.encode(), untouched.encode()):
                client.delete(key)
        assert await tier.get("ns", "m", KEY) is None
        fresh = CachedAnswer("a fresh answer", (4,), "stop", 1, 1)
        assert await other.put("ns", "m", KEY, fresh)
        assert await tier.get("ns", "m", KEY) == fresh
        assert await other.get("ns", "m", KEY) == fresh
    finally:
        await other.close()


def query(key: bytes = KEY) -> CacheQuery:
    model = ModelIdentity("m", "e", "t", "v")
    return CacheQuery(key, "ns", model, "q", (), SamplingKey(8, True, 0, 1, 1, None, ()))


async def written(tier: RedisTier) -> None:
    """Waits for the tier's background writes."""
    if tier._writes:
        await asyncio.wait(tier._writes, timeout=10)


async def test_an_answer_under_way_during_an_invalidation_is_never_served(
    tier: RedisTier, redis_server: RedisServer
) -> None:
    """The lookup missed (its MGET read the generations), another gateway invalidated, then the
    answer generated meanwhile is stored: stamped with what the lookup read, it is refused."""
    other = RedisTier(tier.settings)
    try:
        looked = query()
        assert await tier.lookup(looked) is None
        writes_only = query(bytes(16))  # a REFRESH: marked before its engine request
        await tier.mark(writes_only)
        await other.invalidate("ns", "")
        tier.store(looked, ANSWER)
        tier.store(writes_only, ANSWER)
        await written(tier)
        assert await tier.lookup(query()) is None
        assert await tier.lookup(query(bytes(16))) is None
        # Begun after the invalidation: stored and served.
        fresh = query()
        assert await tier.lookup(fresh) is None
        tier.store(fresh, ANSWER)
        await written(tier)
        assert await tier.lookup(query()) == ANSWER
    finally:
        await other.close()


async def test_an_answer_this_gateway_knows_invalidated_is_not_written(tier: RedisTier) -> None:
    """The invalidation came through this gateway while the answer was generated: the answer is
    not written at all, so it cannot overwrite an entry stored since."""
    looked = query()
    assert await tier.lookup(looked) is None
    await tier.invalidate("ns", "")
    fresh = query()
    assert await tier.lookup(fresh) is None
    tier.store(fresh, CachedAnswer("fresh", (7,), "stop", 4, 1))
    await written(tier)
    before = tier.metrics.l2_invalidated_entries
    tier.store(looked, ANSWER)
    await written(tier)
    assert tier.metrics.l2_invalidated_entries == before + 1
    assert (await tier.get("ns", "m", KEY)).text == "fresh"  # type: ignore[union-attr]


async def test_a_lookup_that_timed_out_is_not_read_again_before_the_engine(
    redis_server: RedisServer,
) -> None:
    """The lookup's MGET timed out: marking the query for its store does not wait on Redis a
    second time (the engine would start one time budget later), and its answer is not written."""
    redis_server.client().flushall()
    tier = RedisTier(RedisSettings(url=redis_server.url, timeout_ms=100.0, mac_key=MAC_KEY))
    try:
        looked = query()
        redis_server.pause()
        try:
            async with asyncio.timeout(30):
                with pytest.raises(TierUnavailable):
                    await tier.lookup(looked)
                await tier.mark(looked)
        finally:
            redis_server.resume()
        assert tier.counters()["l2_timeouts"] == 1
        tier.store(looked, ANSWER)
        await written(tier)
        assert tier.counters()["write_failures"] == 1
        assert await tier.lookup(query()) is None
    finally:
        await tier.close()


async def test_an_invalidation_raises_a_generation_key_that_holds_another_type(
    tier: RedisTier, redis_server: RedisServer
) -> None:
    """A list written at the scope's generation key (INCR refuses it: WRONGTYPE) is replaced by
    the raised generation, so an entry set back after the unlink is still refused."""
    client = redis_server.client()
    name = tier.redis_key("ns", "m", KEY)
    gen = tier.generation_keys("ns", "m", KEY)[1]
    assert await tier.put("ns", "m", KEY, ANSWER)
    copy = client.get(name)
    assert copy is not None
    client.rpush(gen, b"x")
    await tier.invalidate("ns", "")
    client.set(name, copy)
    assert await tier.get("ns", "m", KEY) is None
    assert client.get(gen) == b"1"


async def test_the_redis_roles_eviction_policy_never_evicts_a_generation(
    tier: RedisTier, redis_server: RedisServer
) -> None:
    """A full Redis evicts answers (they carry a TTL), never the generation an invalidation raised:
    evicted, it reads as 0 again, and an answer generated while the invalidation ran (stamped
    with the generation before it) would be served as current."""
    defaults = Path(__file__).resolve().parents[2] / "ansible/roles/redis/defaults/main.yml"
    found = re.search(r"^redis_maxmemory_policy: (\S+)$", defaults.read_text(), re.M)
    assert found is not None
    client = redis_server.client()
    await tier.invalidate("ns", "")
    [gen] = [g for g in tier.generation_keys("ns", "", KEY) if g.endswith(":gen-ns-ns")]
    assert client.get(gen) == b"1"
    used = int(client.info("memory")["used_memory"])
    policy = str(client.config_get("maxmemory-policy")["maxmemory-policy"])
    client.config_set("maxmemory-policy", found.group(1))
    client.config_set("maxmemory", str(used + 2_000_000))
    big = CachedAnswer("x" * 20_000, (1, 2, 3), "stop", 4, 3)
    try:
        for n in range(400):
            await tier.put("ns", f"m{n}", KEY, big)
    finally:
        client.config_set("maxmemory", "0")
        client.config_set("maxmemory-policy", policy)
    assert int(client.info("stats")["evicted_keys"]) > 0
    assert client.get(gen) == b"1"


SENT_BY_GATEWAYS = [
    ["PING"],
    ["HELLO", "2"],
    ["SELECT", "0"],
    ["CLIENT", "SETNAME", "gw"],
    ["GET", "appliance:k"],
    ["SET", "appliance:k", "v", "EX", "10"],
    ["MGET", "appliance:k", "appliance:gen"],
    ["SCAN", "0", "MATCH", "appliance:*", "COUNT", "1000"],
    ["UNLINK", "appliance:k"],
    ["INCR", "appliance:gen"],
    ["INCRBY", "appliance:gen", "2"],
    ["XADD", "appliance:s", "MAXLEN", "~", "10", "1-*", "f", "v"],
    ["XREAD", "COUNT", "1", "STREAMS", "appliance:s", "0-0"],
    ["XREVRANGE", "appliance:s", "+", "-", "COUNT", "1"],
    ["TIME"],
    ["WAIT", "1", "500"],
]
NOT_FOR_GATEWAYS = [
    ["CLIENT", "KILL", "TYPE", "replica"],
    ["CLIENT", "PAUSE", "100000", "WRITE"],
    ["CLIENT", "LIST"],
    ["CLIENT", "UNBLOCK", "1"],
    ["CLIENT", "NO-EVICT", "on"],
    ["GET", "other:k"],
    ["FLUSHALL"],
    ["CONFIG", "SET", "maxmemory", "1"],
]


def test_the_gateways_acl_allows_what_they_send_and_nothing_of_a_server_admin(
    tmp_path: Path,
) -> None:
    """The rules the redis role writes: every command a gateway sends, and none that would let a
    gateway's password kill the replication link, pause the primary or list other clients."""
    acl = tmp_path / "users.acl"
    acl.write_text(
        "user default on nopass ~* &* +@all\n"
        f"user appliance on >gateway-password {gateway_acl_rules()}\n"
    )
    server = RedisServer(tmp_path)
    server.start(["--aclfile", str(acl)])
    try:
        client = server.client()

        def dry_run(command: list[str]) -> str:
            reply = client.execute_command("ACL", "DRYRUN", "appliance", *command)  # type: ignore[no-untyped-call]
            return reply.decode() if isinstance(reply, bytes) else str(reply)

        assert {" ".join(c): dry_run(c) for c in SENT_BY_GATEWAYS} == {
            " ".join(c): "OK" for c in SENT_BY_GATEWAYS
        }
        allowed = [" ".join(c) for c in NOT_FOR_GATEWAYS if dry_run(c) == "OK"]
        assert allowed == []
    finally:
        server.kill()


def _role_persistence() -> list[str]:
    """The persistence settings the redis role writes to redis.conf, as redis-server arguments
    (none: Redis's own defaults)."""
    role = Path(__file__).resolve().parents[2] / "ansible/roles/redis"
    found = re.findall(
        r'^ *- \{ key: (appendonly|appendfsync|save), value: "?(.*?)"? \}$',
        (role / "tasks/main.yml").read_text(),
        re.M,
    )
    defaults = (role / "defaults/main.yml").read_text()
    args = []
    for key, value in found:
        # "{{ 'yes' if VARIABLE | bool else 'no' }}": the variable's default.
        flag = re.fullmatch(r"\{\{ 'yes' if (\w+) \| bool else 'no' \}\}", value)
        if flag is not None:
            default = re.search(rf"^{flag.group(1)}: (\S+)$", defaults, re.M)
            assert default is not None, flag.group(1)
            value = "yes" if default.group(1) == "true" else "no"
        args += [f"--{key}", value]
    return args


def test_a_redis_that_crashes_keeps_the_generations_it_raised(tmp_path: Path) -> None:
    """Killed (OOM killer, crash) and restarted, Redis must come back with every generation it
    had taken: loaded from a snapshot taken before an invalidation, it would hold the old
    generation and the answers the invalidation unlinked, which every gateway that had not read
    the raised generation would serve again."""
    binary = shutil.which("redis-server")
    assert binary is not None
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    argv += _role_persistence()
    client = redis.Redis(port=port)

    def started() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def loaded() -> bool:
            try:
                return int(client.info("persistence")["loading"]) == 0
            except redis.RedisError:
                return False

        until(loaded, "redis-server did not start", timeout=10.0)
        return proc

    proc = started()
    try:
        client.set("appliance:ns:m:00", b"an answer")
        client.bgsave()
        until(
            lambda: int(client.info("persistence")["rdb_bgsave_in_progress"]) == 0,
            "BGSAVE did not end",
            timeout=10.0,
        )
        client.incr("appliance:gen-ns-ns")
        client.unlink("appliance:ns:m:00")
        proc.kill()
        proc.wait()
        proc = started()
        assert (client.get("appliance:gen-ns-ns"), client.exists("appliance:ns:m:00")) == (
            b"1",
            0,
        )
    finally:
        proc.kill()
        proc.wait()
