"""Every authorization rule, positive and negative, against a gateway in the test's event loop
(real gRPC over loopback) with a keys file and a real redis-server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from appliance.cache.l2 import RedisSettings
from appliance.config import CacheConfig
from appliance.gateway.server import RunningGateway
from appliance.security.api_keys import RateLimits
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.cache.redis_server import RedisServer
from tests.conftest import Engine, Tiny
from tests.security.conftest import Keys, bearer, running
from tests.support import gateway_config, until_async

MAC_KEY = b"security-test-mac-key-0123456789"
prompts = iter(range(10**9))


def cache(redis_server: RedisServer) -> CacheConfig:
    return CacheConfig(redis=RedisSettings(url=redis_server.url, timeout_ms=500.0, mac_key=MAC_KEY))


def req(namespace: str = "", prompt: str | None = None, **kw: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model="tiny",
        prompt=prompt or f"auth question {next(prompts)}",
        max_tokens=4,
        temperature=0,
        namespace=namespace,
        **kw,
    )


class Client:
    def __init__(self, gw: RunningGateway) -> None:
        self.gw = gw
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}")
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.admin = pb_grpc.CacheAdminStub(self.channel)

    async def complete(self, request: pb.GenerateRequest, token: str | None) -> pb.CompleteResponse:
        metadata = bearer(token) if token else ()
        reply: pb.CompleteResponse = await self.stub.Complete(
            request, timeout=30, metadata=metadata
        )
        return reply

    async def refused(self, request: pb.GenerateRequest, token: str | None) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await self.complete(request, token)
        return err.value

    async def invalidate(self, token: str | None, **kw: Any) -> pb.InvalidateResponse:
        metadata = bearer(token) if token else ()
        reply: pb.InvalidateResponse = await self.admin.Invalidate(
            pb.InvalidateRequest(**kw), timeout=30, metadata=metadata
        )
        return reply


@pytest.fixture
async def gateway(
    tiny: Tiny, engine: Engine, keys: Keys, redis_server: RedisServer
) -> AsyncIterator[Client]:
    redis_server.client().flushall()
    async with running(
        gateway_config(
            tiny.tokenizer_dir, engine.address, auth=keys.auth(), cache=cache(redis_server)
        )
    ) as gw:
        client = Client(gw)
        yield client
        await client.channel.close()


async def test_a_request_without_a_valid_key_is_unauthenticated(
    gateway: Client, keys: Keys
) -> None:
    token = keys.add(["a"], ["generate"])
    assert gateway.gw.access is not None and gateway.gw.access.keys is not None
    gateway.gw.access.keys.reload()
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    for presented in (None, forged, "not-a-key", token + "x"):
        err = await gateway.refused(req("a"), presented)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, presented
    with pytest.raises(grpc.aio.AioRpcError) as basic:
        await gateway.stub.Complete(req("a"), metadata=(("authorization", f"Basic {token}"),))
    assert basic.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (await gateway.complete(req("a"), token)).final.finish_reason


async def test_namespace_rules(gateway: Client, keys: Keys) -> None:
    one = keys.add(["tenant-a"], ["generate"])
    two = keys.add(["tenant-a", "tenant-b"], ["generate"])
    anywhere = keys.add(["*"], ["generate"])
    assert gateway.gw.access is not None and gateway.gw.access.keys is not None
    gateway.gw.access.keys.reload()
    # A key with one namespace may leave it out: the answer is that namespace's.
    r = req()
    await gateway.complete(r, one)
    hit = await gateway.complete(req("tenant-a", r.prompt), one)
    assert hit.final.cache_tier == pb.CACHE_TIER_EXACT_L1
    # Another tenant's namespace: refused before the cache is looked at, naming only this key's.
    err = await gateway.refused(req("tenant-b", r.prompt), one)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "tenant-b" in (err.details() or "") and "tenant-a" in (err.details() or "")
    # Two namespaces: one must be named.
    err = await gateway.refused(req("", r.prompt), two)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (await gateway.complete(req("tenant-b", r.prompt), two)).final.cache_tier == (
        pb.CACHE_TIER_MISS
    )
    assert (await gateway.complete(req("tenant-a", r.prompt), two)).final.cache_tier == (
        pb.CACHE_TIER_EXACT_L1
    )
    assert (await gateway.complete(req("anyone", r.prompt), anywhere)).final.finish_reason


async def test_cache_only_needs_its_own_scope(gateway: Client, keys: Keys) -> None:
    writer = keys.add(["t"], ["generate"])
    prober = keys.add(["t"], ["cache:read-only-policy"])
    assert gateway.gw.access is not None and gateway.gw.access.keys is not None
    gateway.gw.access.keys.reload()
    r = req("t")
    await gateway.complete(r, writer)
    only = req("t", r.prompt, cache_policy=pb.CACHE_POLICY_ONLY)
    err = await gateway.refused(only, writer)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "cache:read-only-policy" in (err.details() or "")
    assert (await gateway.complete(only, prober)).final.cache_tier == pb.CACHE_TIER_EXACT_L1
    assert (await gateway.refused(req("t"), prober)).code() == grpc.StatusCode.PERMISSION_DENIED


async def _entries(gw: RunningGateway, redis_server: RedisServer) -> tuple[int, int]:
    await asyncio.sleep(0)
    cascade = gw.pipeline.cache
    assert cascade is not None
    await until_async(  # the write-backs to Redis have landed
        lambda: (
            not any(
                getattr(t.get_coro(), "__qualname__", "") == "RedisTier._write"
                for t in asyncio.all_tasks()
            )
        ),
        "the write-backs to Redis never landed",
        10.0,
    )
    return cascade.counters()["l1_entries"], len(redis_server.client().keys("appliance:*"))


async def test_invalidate_needs_admin_and_refused_calls_remove_nothing(
    gateway: Client, keys: Keys, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    user = keys.add(["a"], ["generate"])
    tenant_admin = keys.add(["a"], ["admin", "generate"])
    operator = keys.add(["*"], ["admin"])
    user_b = keys.add(["b"], ["generate"])
    assert gateway.gw.access is not None and gateway.gw.access.keys is not None
    gateway.gw.access.keys.reload()
    await gateway.complete(req("a"), user)
    await gateway.complete(req("b"), user_b)
    before = await _entries(gateway.gw, redis_server)
    assert before == (2, 2)
    caplog.set_level(logging.INFO, logger="appliance.access")
    refusals: list[tuple[str | None, dict[str, Any], grpc.StatusCode]] = [
        (None, {"all": True}, grpc.StatusCode.UNAUTHENTICATED),
        ("ak_000000000000_nonsense", {"all": True}, grpc.StatusCode.UNAUTHENTICATED),
        (user, {"namespace": "a"}, grpc.StatusCode.PERMISSION_DENIED),
        (tenant_admin, {"all": True}, grpc.StatusCode.PERMISSION_DENIED),
        (tenant_admin, {"namespace": "b"}, grpc.StatusCode.PERMISSION_DENIED),
        (tenant_admin, {"model": "tiny"}, grpc.StatusCode.PERMISSION_DENIED),
    ]
    for token, fields, code in refusals:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await gateway.invalidate(token, **fields)
        assert err.value.code() == code, (fields, err.value.details())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await gateway.admin.Stats(pb.CacheStatsRequest(), metadata=bearer(tenant_admin))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert await _entries(gateway.gw, redis_server) == before
    removed = await gateway.invalidate(tenant_admin, namespace="a")
    assert (removed.l1_removed, removed.l2_removed) == (1, 1)
    removed = await gateway.invalidate(operator, all=True)
    assert (removed.l1_removed, removed.l2_removed) == (1, 1)
    stats = await gateway.admin.Stats(pb.CacheStatsRequest(), metadata=bearer(operator))
    assert "l2_forged_entries" in stats.counters
    lines = [r.getMessage() for r in caplog.records if r.name == "appliance.access"]
    admin_lines = [line for line in lines if line.startswith("admin ")]
    assert len(admin_lines) == len(refusals) + 4  # each refusal, the Stats refusal, 2 + 1 calls
    assert any("key_id='' " in line and "status=UNAUTHENTICATED" in line for line in admin_lines)
    operator_id = operator[3:15]
    assert any(
        f"key_id='{operator_id}'" in line and "all=True status=OK" in line for line in admin_lines
    )
    for token in (user, tenant_admin, operator, user_b):
        assert not any(token[16:] in line for line in lines)  # never the secret


async def test_the_access_log_names_the_key_and_namespace(
    gateway: Client, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    token = keys.add(["logged"], ["generate"])
    assert gateway.gw.access is not None and gateway.gw.access.keys is not None
    gateway.gw.access.keys.reload()
    caplog.set_level(logging.INFO, logger="appliance.access")
    await gateway.complete(req(), token)
    await gateway.refused(req("elsewhere"), token)
    await gateway.refused(req("logged"), None)
    lines = [r.getMessage() for r in caplog.records if r.name == "appliance.access"]
    key_id = token[3:15]
    assert any(f"key_id='{key_id}' namespace='logged'" in x and "status=OK" in x for x in lines)
    assert any(
        f"key_id='{key_id}' namespace='elsewhere'" in x and "status=PERMISSION_DENIED" in x
        for x in lines
    )
    # Refused before its message is read: the namespace it names is not known.
    assert any("key_id='' namespace=''" in x and "UNAUTHENTICATED" in x for x in lines)
    assert not any(token[16:] in x for x in lines)


async def test_a_caller_without_a_valid_key_is_refused_before_its_message_is_read(
    gateway: Client, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """Translating a message's tools and chat costs work: a caller the keys do not know is
    refused UNAUTHENTICATED whatever its message holds, before it is read (the HTTP API reads no
    body of one either), so the access log has no namespace for it."""
    keys.add(["t"], ["generate"])
    assert gateway.gw.access is not None and gateway.gw.access.keys is not None
    gateway.gw.access.keys.reload()
    caplog.set_level(logging.INFO, logger="appliance.access")
    # Tools beside a prompt: a message whose translation refuses it.
    translated = req("t", tools=pb.Tools(tools=[pb.Tool(name="f")]))
    for token in (None, "ak_000000000000_not-a-key"):
        err = await gateway.refused(translated, token)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
    lines = [r.getMessage() for r in caplog.records if r.name == "appliance.access"]
    assert sum("namespace=''" in x and "status=UNAUTHENTICATED" in x for x in lines) == 2


async def test_a_key_refused_by_rate_scope_or_namespace_is_refused_before_translation(
    gateway: Client, keys: Keys
) -> None:
    """The message's namespace and cache_policy are read as they are, without translating the
    rest: a key over its rate, without the scope or without the namespace is refused for that,
    whatever its message holds (here: tools beside a prompt, which translation refuses)."""
    slow = keys.add(["t"], ["generate"], limits=RateLimits(rate_per_s=0.01, burst=1))
    prober = keys.add(["t"], ["cache:read-only-policy"])
    other = keys.add(["u"], ["generate"])
    assert gateway.gw.access is not None and gateway.gw.access.keys is not None
    gateway.gw.access.keys.reload()
    tools = pb.Tools(tools=[pb.Tool(name="f")])
    await gateway.complete(req("t"), slow)  # its burst
    err = await gateway.refused(req("t", tools=tools), slow)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    err = await gateway.refused(req("t", tools=tools), prober)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
    assert "lacks the scope 'generate'" in (err.details() or "")
    err = await gateway.refused(req("t", tools=tools), other)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
    assert "may not use namespace 't'" in (err.details() or "")
    # Allowed, the same message is translated and refused for what it holds.
    err = await gateway.refused(req("u", tools=tools), other)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()


async def test_rate_and_stream_limits_per_key(gateway: Client, keys: Keys) -> None:
    limited = keys.add(["t"], ["generate"], limits=RateLimits(rate_per_s=1000.0, max_streams=1))
    slow = keys.add(["t"], ["generate"], limits=RateLimits(rate_per_s=0.2, burst=2))
    other = keys.add(["t"], ["generate"])
    assert gateway.gw.access is not None and gateway.gw.access.keys is not None
    gateway.gw.access.keys.reload()
    # Requests/s: the burst passes, the next is refused with a retry hint; other keys are not.
    await gateway.complete(req("t"), slow)
    await gateway.complete(req("t"), slow)
    err = await gateway.refused(req("t"), slow)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    pushback = int(dict(err.trailing_metadata() or ())["grpc-retry-pushback-ms"])
    assert 1000 < pushback <= 5000
    await gateway.complete(req("t"), other)
    # Streams: one open at a time for `limited`.
    long = pb.GenerateRequest(
        model="tiny",
        prompt="Tell me everything",  # greedy, it runs all 1500 tokens
        max_tokens=1500,
        temperature=0.0,
        namespace="t",
        cache_policy=pb.CACHE_POLICY_BYPASS,
    )
    call = gateway.stub.Generate(long, metadata=bearer(limited))
    await call.read()
    err = await gateway.refused(req("t"), limited)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "grpc-retry-pushback-ms" in dict(err.trailing_metadata() or ())
    call.cancel()

    async def slot_freed() -> bool:  # the cancelled stream's slot frees when its handler ends
        try:
            await gateway.complete(req("t"), limited)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            return False
        return True

    await until_async(slot_freed, "the stream slot was never freed", 10.0)


async def test_a_revoked_key_is_refused_after_a_reload(gateway: Client, keys: Keys) -> None:
    token = keys.add(["t"], ["generate"])
    assert gateway.gw.access is not None and gateway.gw.access.keys is not None
    gateway.gw.reload()
    await gateway.complete(req("t"), token)
    keys.entries.clear()
    keys.path.write_text('{"version": 1, "keys": [')  # half-written: the keys in use stay
    gateway.gw.reload()
    await gateway.complete(req("t"), token)
    keys.path.write_text('{"version": 1, "keys": []}')
    gateway.gw.reload()
    assert (await gateway.refused(req("t"), token)).code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_forged_or_moved_redis_entry_is_never_served(
    tiny: Tiny, engine: Engine, redis_server: RedisServer
) -> None:
    """An entry written into Redis by anything but a gateway (no tag, a tag made with another
    key, or a genuine entry copied under another tenant's key) is a counted miss."""
    redis_server.client().flushall()
    config = gateway_config(tiny.tokenizer_dir, engine.address, cache=cache(redis_server))
    a, b = req("tenant-a"), req("tenant-b")
    b.prompt = a.prompt
    async with running(config) as gw:
        client = Client(gw)
        genuine = await client.complete(a, None)
        await client.complete(b, None)
        await _entries(gw, redis_server)
        await client.channel.close()
    r = redis_server.client()
    (key_a,) = redis_server.keys("appliance:tenant-a:*")
    (key_b,) = redis_server.keys("appliance:tenant-b:*")
    value_a = r.get(key_a)
    assert isinstance(value_a, bytes)
    foreign_key = RedisSettings(url=redis_server.url, mac_key=b"another-appliance-key-0123456789")
    forgeries = [
        value_a[16:],  # the body without its tag
        b"\0" * 16 + value_a[16:],  # a made-up tag
        value_a,  # tenant A's genuine entry under tenant B's key
    ]
    from appliance.cache.seal import Sealer

    assert foreign_key.mac_key is not None
    forgeries.append(Sealer(foreign_key.mac_key).seal(key_b, value_a[16:]))
    for n, forged in enumerate(forgeries, start=1):
        r.set(key_b, forged)
        async with running(config) as gw:  # a new gateway: an empty L1
            client = Client(gw)
            answer = await client.complete(b, None)
            counters = dict((await client.admin.Stats(pb.CacheStatsRequest())).counters)
            await client.channel.close()
        assert answer.final.cache_tier == pb.CACHE_TIER_MISS, n
        assert counters["l2_forged_entries"] == 1, n
        assert answer.text == genuine.text  # the engine's own answer (same prompt, same model)
    # The genuine entry under its own key is still an L2 hit.
    async with running(config) as gw:
        client = Client(gw)
        assert (await client.complete(a, None)).final.cache_tier == pb.CACHE_TIER_EXACT_L2
        await client.channel.close()


def test_anonymous_access_only_on_loopback(tmp_path: Path) -> None:
    from appliance.config import ConfigError, load_config

    tok = tmp_path / "tok"
    tok.mkdir()
    base = f'[models.m]\nbackend = "127.0.0.1:1"\ntokenizer_dir = "{tok}"\n'
    path = tmp_path / "g.toml"
    path.write_text('[server]\nlisten = "0.0.0.0:50051"\n' + base)
    with pytest.raises(
        ConfigError,
        match=r"g.toml:2: key 'server.listen': 0.0.0.0:50051 is not a loopback address, and plaintext",
    ):
        load_config(path)
    path.write_text('[server]\nlisten = "0.0.0.0:50051"\nallow_plaintext = true\n' + base)
    with pytest.raises(ConfigError, match=r"key 'server.listen': .*set \[auth\] keys_file"):
        load_config(path)
    path.write_text(
        '[server]\nlisten = "0.0.0.0:50051"\nallow_plaintext = true\n'
        "[auth]\nallow_anonymous = true\n" + base
    )
    assert load_config(path).auth.keys_file is None
    path.write_text('[server]\nlisten = "[::1]:50051"\n' + base)
    assert load_config(path).tls is None
