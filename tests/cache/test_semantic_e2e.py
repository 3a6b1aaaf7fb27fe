"""The semantic tier in the gateway's request path: the tiny engine server and a real redis-server."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from appliance.cache.embedder import EmbeddingCancelled, EmbedRun, Vector
from appliance.cache.keys import SamplingKey, cache_key
from appliance.cache.seal import Sealer
from appliance.cache.semantic import SemanticTier, encode_record
from appliance.config import CacheConfig, HttpConfig, SemanticConfig
from appliance.gateway.server import keep_long_lived_from_gc
from appliance.heap import freeze_heap
from appliance.v1 import inference_pb2 as pb
from tests.cache.redis_server import RedisServer, gateway_acl_rules
from tests.cache.test_cache_e2e import (
    MAC_KEY,
    Gateway,
    PausedEngine,
    cache_config,
    counters_until,
    gateway,
    settle,
    started,
)
from tests.conftest import Engine, Tiny
from tests.gateway.test_e2e import cache_cli
from tests.support import until_async

MISS, L1, L2 = pb.CACHE_TIER_MISS, pb.CACHE_TIER_EXACT_L1, pb.CACHE_TIER_EXACT_L2
SEMANTIC = pb.CACHE_TIER_SEMANTIC
QUESTION = "How do I get rid of acne?"
PARAPHRASE = "How can I get rid of acne?"


def semantic_config(
    redis_server: RedisServer | None, embedder_dir: Path, **semantic: object
) -> CacheConfig:
    settings = dataclasses.replace(
        SemanticConfig(
            enabled=True,
            namespaces=("sem", "other"),
            embedder_dir=embedder_dir,
            follow_block_ms=100,
        ),
        **semantic,  # type: ignore[arg-type]
    )
    return dataclasses.replace(cache_config(redis_server), semantic=settings)


@pytest.fixture
async def gw(
    tiny: Tiny, engine: Engine, redis_server: RedisServer, embedder_dir: Path
) -> AsyncIterator[Gateway]:
    redis_server.client().flushall()
    g = await gateway(tiny, engine, semantic_config(redis_server, embedder_dir))
    await counters_until(g, lambda c: c["semantic_in_sync"] == 1)
    yield g
    await g.close()


def ask(text: str, namespace: str = "sem", **kw: Any) -> pb.GenerateRequest:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    kw.setdefault("semantic_cache", True)
    if "messages" not in kw:
        kw["prompt"] = text
    return pb.GenerateRequest(model="tiny", namespace=namespace, **kw)


def chat(*turns: tuple[str, str], **kw: Any) -> pb.GenerateRequest:
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in turns])
    return ask("", messages=messages, **kw)


def semantic_tier(g: Gateway) -> SemanticTier:
    cache = g.running.pipeline.cache
    assert cache is not None and isinstance(cache.tiers[-1], SemanticTier)
    return cache.tiers[-1]


class HeldEmbedding:
    """Holds the tier's embedding of one text until `release` is set (on the embedding thread),
    and notes how each of that text's runs ended."""

    def __init__(self, semantic: SemanticTier, text: str) -> None:
        self.release = threading.Event()
        self.outcomes: list[str] = []
        self._real = semantic.embedder.embed
        self._text = text
        semantic.embedder.embed = self._embed  # type: ignore[method-assign]

    def _embed(self, text: str, run: EmbedRun | None = None) -> Vector | None:
        if text != self._text:
            return self._real(text, run)
        self.release.wait(30)
        try:
            vector = self._real(text, run)
        except EmbeddingCancelled:
            self.outcomes.append("cancelled")
            raise
        self.outcomes.append("embedded")
        return vector


async def stored(g: Gateway, n: int) -> None:
    await counters_until(g, lambda c: c["semantic_stored"] >= n)


async def test_a_paraphrase_is_answered_from_the_semantic_tier_with_its_audit_fields(
    gw: Gateway, engine: Engine, tiny: Tiny, caplog: pytest.LogCaptureFixture
) -> None:
    first = await gw.stub.Complete(ask(QUESTION))
    assert first.final.cache_tier == MISS
    await stored(gw, 1)
    before = started(engine)
    with caplog.at_level(logging.INFO, logger="appliance.access"):
        hit = await gw.stub.Complete(ask(PARAPHRASE, request_id="audited"))
    (line,) = [r.getMessage() for r in caplog.records if "request_id='audited'" in r.getMessage()]
    assert " tier=semantic " in line
    assert line.endswith(
        f" similarity={hit.final.similarity:.3f} cache_entry={hit.final.cache_entry}"
    )
    assert hit.final.cache_tier == SEMANTIC
    assert (hit.text, list(hit.token_ids)) == (first.text, list(first.token_ids))
    assert 0.8 < hit.final.similarity <= 1.0
    model = gw.running.pipeline.models["tiny"].identity
    key = cache_key("sem", model, QUESTION, (), SamplingKey(8, True, 0.0, 1.0, 1, None, ()))
    assert hit.final.cache_entry == key.hex()
    # Not copied into the exact tiers: the same paraphrase again is again a semantic hit.
    again = await gw.stub.Complete(ask(PARAPHRASE))
    assert again.final.cache_tier == SEMANTIC
    assert started(engine) == before
    assert first.final.cache_entry == key.hex()  # the key its answer was cached under
    # An exact hit names its own key and says nothing of similarity.
    exact = await gw.stub.Complete(ask(QUESTION))
    assert (exact.final.cache_tier, exact.final.similarity) == (L1, 0)
    assert exact.final.cache_entry == key.hex()


async def test_a_semantic_hit_counts_the_askers_own_prompt_tokens(gw: Gateway, tiny: Tiny) -> None:
    """usage.prompt_tokens is what the asker sent, not the question the answer was cached for."""
    question = "How do I get rid of acne?"
    longer = "How do I get rid of acne quickly and for good, please?"
    first = await gw.stub.Complete(ask(question))
    await stored(gw, 1)
    hit = await gw.stub.Complete(ask(longer))
    assert hit.final.cache_tier == SEMANTIC
    text = gw.running.pipeline.models["tiny"].text
    assert first.final.usage.prompt_tokens == len(text.encode_prompt(question))
    assert hit.final.usage.prompt_tokens == len(text.encode_prompt(longer))
    assert hit.final.usage.prompt_tokens != first.final.usage.prompt_tokens
    assert hit.final.usage.completion_tokens == first.final.usage.completion_tokens


async def test_near_identical_questions_with_other_answers_miss(gw: Gateway) -> None:
    await gw.stub.Complete(ask("How do I convert Celsius to Fahrenheit?"))
    await gw.stub.Complete(ask("How do I reverse a list in Python?"))
    await stored(gw, 2)
    for text in ("How do I convert Fahrenheit to Celsius?", "How do I reverse a list in Java?"):
        assert (await gw.stub.Complete(ask(text))).final.cache_tier == MISS


async def test_scope_namespace_model_sampling_stops_and_earlier_messages(gw: Gateway) -> None:
    await gw.stub.Complete(ask(QUESTION))
    await gw.stub.Complete(chat(("system", "Be brief."), ("user", QUESTION)))
    await stored(gw, 2)
    # A hit is never stored under its own key, so these leave the misses below untouched.
    assert (await gw.stub.Complete(ask(PARAPHRASE))).final.cache_tier == SEMANTIC
    hit = await gw.stub.Complete(chat(("system", "Be brief."), ("user", PARAPHRASE)))
    assert hit.final.cache_tier == SEMANTIC
    misses = [
        ask(PARAPHRASE, namespace="other"),  # enabled, but another tenant
        ask(PARAPHRASE, namespace="off"),  # not enabled for the tier
        ask(PARAPHRASE, max_tokens=9),
        ask(PARAPHRASE, temperature=0.5, seed=7),
        ask(PARAPHRASE, stop=["."]),
        ask(PARAPHRASE, semantic_cache=False),
        ask(PARAPHRASE, cache_policy=pb.CACHE_POLICY_BYPASS),
        chat(("system", "Be verbose."), ("user", PARAPHRASE)),
        chat(("user", PARAPHRASE)),
        chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hi"), ("user", PARAPHRASE)),
    ]
    for request in misses:
        final = (await gw.stub.Complete(request)).final
        assert final.cache_tier == MISS, request


async def test_unset_semantic_cache_follows_the_request_default(
    tiny: Tiny, engine: Engine, redis_server: RedisServer, embedder_dir: Path
) -> None:
    redis_server.client().flushall()
    g = await gateway(
        tiny, engine, semantic_config(redis_server, embedder_dir, request_default=True)
    )
    try:
        await counters_until(g, lambda c: c["semantic_in_sync"] == 1)
        await g.stub.Complete(ask(QUESTION))
        await stored(g, 1)
        unset = pb.GenerateRequest(
            model="tiny", namespace="sem", prompt=PARAPHRASE, temperature=0, max_tokens=8
        )
        assert (await g.stub.Complete(unset)).final.cache_tier == SEMANTIC
    finally:
        await g.close()


async def test_bad_texts_never_fail_a_request(gw: Gateway) -> None:
    for text in ("", "?!...", "\u200b\u200b", "word " * 600, "\x00\x01 binary \x7f"):
        request = ask(text, max_tokens=2)
        if not text:
            request = chat(("user", ""), max_tokens=2)
        final = (await gw.stub.Complete(request)).final
        assert final.cache_tier in (MISS, L1)


async def test_another_gateway_finds_the_entry_and_a_restarted_one_rebuilds(
    gw: Gateway, tiny: Tiny, engine: Engine, redis_server: RedisServer, embedder_dir: Path
) -> None:
    config = semantic_config(redis_server, embedder_dir)
    other = await gateway(tiny, engine, config)
    try:
        await counters_until(other, lambda c: c["semantic_in_sync"] == 1)
        first = await gw.stub.Complete(ask(QUESTION))
        await counters_until(other, lambda c: c["semantic_entries"] >= 1)
        hit = await other.stub.Complete(ask(PARAPHRASE))
        assert (hit.final.cache_tier, hit.text) == (SEMANTIC, first.text)
    finally:
        await other.close()
    restarted = await gateway(tiny, engine, config)
    try:
        counters = await counters_until(restarted, lambda c: c["semantic_in_sync"] == 1)
        assert counters["semantic_entries"] >= 1 and counters["semantic_rebuilds"] >= 1
        hit = await restarted.stub.Complete(ask(PARAPHRASE))
        assert hit.final.cache_tier == SEMANTIC
    finally:
        await restarted.close()


async def test_an_l2_hit_cancels_the_embedding_its_lookup_prepared(
    gw: Gateway,
    tiny: Tiny,
    engine: Engine,
    redis_server: RedisServer,
    embedder_dir: Path,
) -> None:
    """The embedding starts when L1 misses; when L2 then answers, it is cancelled (it would hold
    the embedding thread for nothing), and the tier goes on answering paraphrases."""
    other = await gateway(tiny, engine, semantic_config(redis_server, embedder_dir))
    try:
        await counters_until(other, lambda c: c["semantic_in_sync"] == 1)
        first = await gw.stub.Complete(ask(QUESTION))
        await settle()  # its L2 entry is written
        # The embedding is held until L2 has answered, so L2 always answers first here.
        held = HeldEmbedding(semantic_tier(other), QUESTION)
        from_l2 = await other.stub.Complete(ask(QUESTION))
        held.release.set()
        assert (from_l2.final.cache_tier, from_l2.text) == (L2, first.text)
        assert (await other.counters())["semantic_embeddings_cancelled"] == 1
        await counters_until(other, lambda c: c["semantic_entries"] >= 1)
        hit = await other.stub.Complete(ask(PARAPHRASE))
        assert (hit.final.cache_tier, hit.text) == (SEMANTIC, first.text)
        assert held.outcomes == ["cancelled"]
    finally:
        await other.close()


async def test_a_restarted_gateway_answers_once_rebuilt_not_after_the_first_stream_read(
    gw: Gateway, tiny: Tiny, engine: Engine, redis_server: RedisServer, embedder_dir: Path
) -> None:
    await gw.stub.Complete(ask(QUESTION))
    await stored(gw, 1)
    # Nothing more is written: its first stream read blocks the whole minute.
    config = semantic_config(redis_server, embedder_dir, follow_block_ms=60_000)
    restarted = await gateway(tiny, engine, config)
    try:
        await counters_until(
            restarted, lambda c: c["semantic_rebuilds"] >= 1 and c["semantic_in_sync"] == 1
        )
        assert (await restarted.stub.Complete(ask(PARAPHRASE))).final.cache_tier == SEMANTIC
    finally:
        await restarted.close()


async def test_a_rebuild_calls_the_processs_hook_with_the_entries_loaded(
    gw: Gateway, redis_server: RedisServer
) -> None:
    await gw.stub.Complete(ask(QUESTION))
    await stored(gw, 1)
    await until_async(  # the record's write follows the local store
        lambda: redis_server.client().keys("*:*:*:sem-*"), "no semantic record in Redis", 10.0
    )
    semantic = semantic_tier(gw)
    seen: list[int] = []
    semantic.on_rebuilt = lambda: seen.append(len(semantic.index))
    await semantic._rebuild()
    assert seen == [1]


async def test_the_gateway_freezes_its_heap_now_and_after_each_rebuild(gw: Gateway) -> None:
    semantic = semantic_tier(gw)
    try:
        keep_long_lived_from_gc(gw.running)
        assert gc.get_freeze_count() > 0
        assert semantic.on_rebuilt is freeze_heap
    finally:
        gc.unfreeze()


async def test_invalidation_reaches_the_other_gateways(
    gw: Gateway, tiny: Tiny, engine: Engine, redis_server: RedisServer, embedder_dir: Path
) -> None:
    other = await gateway(tiny, engine, semantic_config(redis_server, embedder_dir))
    try:
        await counters_until(other, lambda c: c["semantic_in_sync"] == 1)
        await gw.stub.Complete(ask(QUESTION))
        await counters_until(other, lambda c: c["semantic_entries"] >= 1)
        await gw.admin.Invalidate(pb.InvalidateRequest(namespace="sem"))
        await counters_until(other, lambda c: c["semantic_entries"] == 0)
        assert (await other.stub.Complete(ask(PARAPHRASE))).final.cache_tier == MISS
    finally:
        await other.close()


@pytest.mark.parametrize("case", ["the role's rules", "an older ACL", "stream ahead"])
async def test_the_redis_roles_gateway_user_may_send_what_every_tier_sends(
    tiny: Tiny, engine: Engine, embedder_dir: Path, tmp_path: Path, case: str
) -> None:
    """Two gateways as the ACL user the redis role writes: L2 entries, semantic entries, the
    stream both follow, a rebuild from Redis and an invalidation, with no Redis refusal. So too
    with the rules of the release before TIME, INCR and INCRBY (a rolling upgrade reaches the
    gateways first), and with the streams' last ids ahead of Redis's clock (a failover to a
    replica whose clock lags)."""
    older = case == "an older ACL"
    rules = gateway_acl_rules(*(("+time", "+incr", "+incrby") if older else ()))
    acl = tmp_path / "users.acl"
    acl.write_text(
        "user default on nopass ~* &* +@all\n"  # the test's own PINGs and checks
        f"user appliance on >gateway-password {rules}\n"
    )
    server = RedisServer(tmp_path)
    server.start(["--aclfile", str(acl)])
    if case == "stream ahead":
        seconds, micros = server.client().time()
        ahead = f"{seconds * 1000 + micros // 1000 + 5000}-0"
        for stream in ("appliance:sem-log", "appliance:inv-log"):
            server.client().xadd(stream, {"x": "1"}, id=ahead)
    config = semantic_config(server, embedder_dir)
    assert config.redis is not None and config.redis.key_prefix == "appliance"
    redis_as_gateway = dataclasses.replace(
        config.redis, username="appliance", password="gateway-password"
    )
    config = dataclasses.replace(config, redis=redis_as_gateway)
    first = await gateway(tiny, engine, config)
    try:
        await counters_until(first, lambda c: c["semantic_in_sync"] == 1)
        asked = await first.stub.Complete(ask(QUESTION))
        await stored(first, 1)
        await settle()
        assert (await first.stub.Complete(ask(PARAPHRASE))).final.cache_tier == SEMANTIC
        other = await gateway(tiny, engine, config)  # rebuilds its index from Redis at start
        try:
            counters = await counters_until(other, lambda c: c["semantic_in_sync"] == 1)
            assert counters["semantic_entries"] == 1
            from_l2 = await other.stub.Complete(ask(QUESTION))
            assert (from_l2.final.cache_tier, from_l2.text) == (L2, asked.text)
            await counters_until(other, lambda c: c["l1_feed_in_step"] == 1)
            await first.admin.Invalidate(pb.InvalidateRequest(namespace="sem"))
            await counters_until(other, lambda c: c["semantic_entries"] == 0)
            await counters_until(
                other, lambda c: c["l1_peer_invalidations"] == 1 and c["l1_entries"] == 0
            )
            for g in (first, other):
                counters = await g.counters()
                assert counters["l1_feed_errors"] == 0, counters
                assert counters["semantic_follower_errors"] == 0, counters
                assert counters["semantic_store_failures"] == 0, counters
                assert counters["l2_errors"] == counters["write_failures"] == 0, counters
                assert counters["breaker_opened"] == 0, counters
        finally:
            await other.close()
    finally:
        await first.close()
        server.kill()


async def test_a_wrong_hit_is_dropped_by_its_entry_on_every_gateway(
    gw: Gateway, tiny: Tiny, engine: Engine, redis_server: RedisServer, embedder_dir: Path
) -> None:
    """The operator's answer to a wrong semantic hit: `appliance cache invalidate --entry` with
    the hit's cache_entry drops that one answer from every tier and every gateway's index."""
    other = await gateway(tiny, engine, semantic_config(redis_server, embedder_dir))
    try:
        await counters_until(other, lambda c: c["semantic_in_sync"] == 1)
        await gw.stub.Complete(ask(QUESTION))
        kept = await gw.stub.Complete(ask("Why is the sky blue?"))
        await counters_until(other, lambda c: c["semantic_entries"] == 2)
        await settle()
        hit = await other.stub.Complete(ask(PARAPHRASE))
        assert hit.final.cache_tier == SEMANTIC
        address = f"127.0.0.1:{gw.running.port}"
        args = ("invalidate", "--namespace", "sem", "--entry", hit.final.cache_entry)
        done = await asyncio.to_thread(cache_cli, address, *args)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == (
            "removed 1 from L1, 2 from Redis, 1 from the semantic index (this gateway's counts; "
            "every gateway on the same Redis drops the same)"
        )
        await counters_until(other, lambda c: c["semantic_entries"] == 1)
        assert (await other.stub.Complete(ask(PARAPHRASE))).final.cache_tier == MISS
        again = await other.stub.Complete(ask("Why is the sky blue?"))
        assert (again.final.cache_tier, again.text) == (L2, kept.text)
        # A stream message naming no key: counted, ignored, nothing dropped.
        before = len(semantic_tier(other).index)
        semantic_tier(other)._apply({b"inv": b"sem", b"model": b"", b"entry": b"not hex"})
        counters = await other.counters()
        assert counters["semantic_corrupt_records"] == 1
        assert counters["semantic_entries"] == before > 0
    finally:
        await other.close()


async def test_a_semantic_record_no_gateway_sealed_is_never_an_answer(
    gw: Gateway, tiny: Tiny, engine: Engine, redis_server: RedisServer, embedder_dir: Path
) -> None:
    """Anything that can write to Redis could otherwise plant an answer for a question (and its
    paraphrases): a record sealed by no gateway, or a sealed one copied under another key, is
    counted and skipped, whether it comes through the stream (in a message no gateway sealed,
    dropped as such, or in one sealed with the gateways' key) or by a rebuild."""
    tier = semantic_tier(gw)
    followed: list[bytes] = []
    applied = asyncio.Event()
    apply = tier._apply

    def recording(fields: dict[bytes, bytes]) -> None:
        apply(fields)
        followed.append(fields.get(b"k", b""))
        applied.set()

    tier._apply = recording  # type: ignore[method-assign]
    await gw.stub.Complete(ask(QUESTION))
    await stored(gw, 1)
    ((genuine, vector),) = tier.index.entries()
    client = redis_server.client()
    # The index takes the entry before Redis does, and the follower reads the gateway's own
    # message after that: removed before then, the entry would come back from the stream.
    async with asyncio.timeout(10):
        await applied.wait()
    (name,) = redis_server.keys("*:*:*:sem-*")
    assert followed == [name]
    sealed = client.get(name)
    assert isinstance(sealed, bytes)

    def key_of(entry_id: bytes) -> bytes:
        return name[: name.rindex(b"sem-") + 4] + entry_id.hex().encode()

    # An exact answer's key (its value is sealed with the same key) is never read as a record.
    exact = name.replace(b"sem-", b"")
    assert tier._parse_key(exact) is None and tier._parse_key(name) is not None

    planted = dataclasses.replace(
        genuine, entry_id=b"p" * 16, answer=dataclasses.replace(genuine.answer, text="PLANTED")
    )
    forged = encode_record(planted, vector, time.time())
    tier.index.remove(genuine.entry_id)  # only the planted record could answer now
    message: dict[str, str | bytes] = {"k": key_of(planted.entry_id), "v": forged}
    client.xadd(tier._stream, message)  # type: ignore[arg-type]
    # Sealed as a gateway seals one: at Redis's millisecond, appended under it.
    seconds, micros = client.time()
    at = seconds * 1000 + micros // 1000
    sealed_message: dict[str, str | bytes] = {**message, "from": "x", "seq": "1", "at": str(at)}
    sealed_forged = Sealer(MAC_KEY).seal_message(tier._stream, sealed_message)
    client.xadd(tier._stream, sealed_forged, id=f"{at}-*")  # type: ignore[arg-type]
    counters = await counters_until(
        gw, lambda c: c["semantic_forged_records"] + c["semantic_entries"] >= 1
    )
    assert (counters["semantic_forged_records"], counters["semantic_entries"]) == (1, 0)
    assert counters["semantic_refused_messages"] == 1
    hit = await gw.stub.Complete(ask(PARAPHRASE))
    assert hit.final.cache_tier != SEMANTIC and "PLANTED" not in hit.text
    # Under keys a restarted gateway's rebuild reads: the planted record, and the genuine one
    # copied under another entry's key.
    client.set(key_of(planted.entry_id), forged)
    client.set(key_of(b"c" * 16), sealed)
    other = await gateway(tiny, engine, semantic_config(redis_server, embedder_dir))
    try:
        counters = await counters_until(other, lambda c: c["semantic_in_sync"] == 1)
        assert counters["semantic_forged_records"] == 2
        # The genuine record and the paraphrase's own answer (the engine's, after its miss).
        kept = {entry.entry_id for entry, _ in semantic_tier(other).index.entries()}
        assert len(kept) == 2 and genuine.entry_id in kept
        assert not kept & {planted.entry_id, b"c" * 16}
    finally:
        await other.close()


def texts(g: Gateway) -> set[str]:
    return {entry.text for entry, _ in semantic_tier(g).index.entries()}


async def test_stream_messages_no_gateway_sealed_or_replayed_are_dropped_counted_and_said(
    gw: Gateway,
    tiny: Tiny,
    engine: Engine,
    redis_server: RedisServer,
    embedder_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whatever can write to Redis could otherwise empty every gateway's index (an unsealed
    "inv" of everything) or bring back an invalidated answer (a copy of its entry's message): a
    message without a tag (what a gateway of an older version sends too), one sealed with another
    secret, one sealed long before Redis appended it and a replay are dropped, counted and logged
    once by each gateway; the gateways' own messages still reach each other."""
    other = await gateway(tiny, engine, semantic_config(redis_server, embedder_dir))
    stream = semantic_tier(gw)._stream
    client = redis_server.client()
    everything = {"inv": "", "model": ""}
    now_ms = str(int(time.time() * 1000))

    def append(fields: Any) -> None:
        client.xadd(stream, fields)

    try:
        await counters_until(other, lambda c: c["semantic_in_sync"] == 1)
        await gw.stub.Complete(ask(QUESTION))
        await until_async(lambda: QUESTION in texts(other), "the entry never reached the other")
        # The gateway's own message that carried the entry, replayed after its invalidation.
        messages: Any = client.xrange(stream)
        carried = [fields for _, fields in messages if b"k" in fields]
        with caplog.at_level(logging.WARNING, logger="appliance.cache.semantic"):
            append(everything)
            wrong_key = Sealer(b"another-gateways-secret-0123456")
            append(
                wrong_key.seal_message(
                    stream, {**everything, "from": "x", "seq": "1", "at": now_ms}
                )
            )
            stale = {**everything, "from": "gone", "seq": "1", "at": "1000"}
            append(Sealer(MAC_KEY).seal_message(stream, stale))
            await gw.stub.Complete(ask("Why is the sky blue?"))
            await until_async(lambda: "Why is the sky blue?" in texts(other), "not applied")
            assert texts(other) == texts(gw) == {QUESTION, "Why is the sky blue?"}
            (entry,) = [e for e, _ in semantic_tier(gw).index.entries() if e.text == QUESTION]
            await gw.admin.Invalidate(
                pb.InvalidateRequest(namespace="sem", entry=entry.entry_id.hex())
            )
            await until_async(lambda: QUESTION not in texts(other), "not invalidated")
            append(carried[0])
            await gw.stub.Complete(ask("What is the capital of France?"))
            await until_async(lambda: len(texts(other)) == 2, lambda: f"{texts(other)}")
        for g in (gw, other):
            assert texts(g) == {"Why is the sky blue?", "What is the capital of France?"}
            counters = await g.counters()
            assert counters["semantic_refused_messages"] == 4, counters
        lines = [r.getMessage() for r in caplog.records if r.name == "appliance.cache.semantic"]
        assert len(lines) == 2, lines  # one per gateway
        assert all("it carries no tag" in line and "mac_key_file" in line for line in lines)
    finally:
        await other.close()


async def test_redis_down_means_no_semantic_hits_and_no_failed_request(
    tiny: Tiny, engine: Engine, redis_server: RedisServer, embedder_dir: Path
) -> None:
    redis_server.client().flushall()
    g = await gateway(tiny, engine, semantic_config(redis_server, embedder_dir))
    try:
        await counters_until(g, lambda c: c["semantic_in_sync"] == 1)
        await g.stub.Complete(ask(QUESTION))
        await stored(g, 1)
        redis_server.kill()
        await counters_until(g, lambda c: c["semantic_in_sync"] == 0)
        for text in (PARAPHRASE, "How do I get rid of my acne?", "How can one get rid of acne?"):
            reply = await g.stub.Complete(ask(text), timeout=30)
            assert reply.final.cache_tier == MISS
        assert (await g.counters())["semantic_unsynced"] >= 3
    finally:
        redis_server.start()
        await g.close()


async def test_without_an_embedder_the_gateway_starts_without_the_tier(
    tiny: Tiny, engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="appliance.cache.semantic"):
        g = await gateway(tiny, engine, semantic_config(None, tmp_path / "missing"))
    try:
        lines = [
            r.getMessage() for r in caplog.records if "semantic cache tier off" in r.getMessage()
        ]
        assert len(lines) == 1 and "appliance semantic-setup" in lines[0]
        assert not any(k.startswith("semantic_") for k in await g.counters())
        reply = await g.stub.Complete(ask(QUESTION))
        assert reply.final.cache_tier == MISS
    finally:
        await g.close()


async def test_without_redis_the_tier_is_this_gateways_own(
    tiny: Tiny, engine: Engine, embedder_dir: Path
) -> None:
    g = await gateway(tiny, engine, semantic_config(None, embedder_dir))
    try:
        await g.stub.Complete(ask(QUESTION))
        await stored(g, 1)
        assert (await g.stub.Complete(ask(PARAPHRASE))).final.cache_tier == SEMANTIC
    finally:
        await g.close()


async def test_the_http_api_takes_the_opt_out_and_names_the_answering_entry(
    tiny: Tiny, engine: Engine, embedder_dir: Path
) -> None:
    g = await gateway(
        tiny, engine, semantic_config(None, embedder_dir), http=HttpConfig("127.0.0.1:0")
    )
    assert g.running.http is not None
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{g.running.http.port}/v1", api_key="unused", max_retries=0
    )

    async def chat_over_http(text: str, **appliance: object) -> Any:
        return await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": text}],
            max_tokens=8,
            temperature=0,
            extra_body={"appliance": {"namespace": "sem", **appliance}},
        )

    try:
        first = await chat_over_http(QUESTION)
        await stored(g, 1)
        hit = await chat_over_http(PARAPHRASE, semantic_cache=True)
        facts = hit.model_extra["appliance"]
        assert facts["cache_tier"] == "semantic"
        assert hit.choices[0].message.content == first.choices[0].message.content
        assert 0.8 < facts["similarity"] <= 1.0 and bytes.fromhex(facts["cache_entry"])
        # A semantic hit is not copied into the exact tiers: the first request that does not
        # ask the tier reaches the engine, the next finds its answer in L1 (request_default is
        # off: unset is no).
        for opted_out, tier in (({"semantic_cache": False}, "miss"), ({}, "l1")):
            refused = await chat_over_http(PARAPHRASE, **opted_out)
            assert refused.model_extra["appliance"]["cache_tier"] == tier
            assert "similarity" not in refused.model_extra["appliance"]
        with pytest.raises(openai.BadRequestError) as err:
            await chat_over_http(PARAPHRASE, semantic_cache="yes")
        assert "appliance.semantic_cache must be a boolean, got a string" in str(err.value)
    finally:
        await client.close()
        await g.close()


async def test_an_invalidation_a_stalled_redis_does_not_take_ends_within_its_budget(
    gw: Gateway, redis_server: RedisServer
) -> None:
    """The semantic tier's message to the other gateways is bounded as the exact feed's is: a
    stalled Redis fails it with what happened, not after redis-py's retries or never."""
    tier = semantic_tier(gw)
    await counters_until(gw, lambda c: c["semantic_in_sync"] == 1)
    redis_server.pause()
    try:
        with pytest.raises(TimeoutError, match=r"^redis did not take the message within 2 s$"):
            await tier.invalidate("", "")
    finally:
        redis_server.resume()


@pytest.mark.parametrize("scope", ["namespace", "entry"])
async def test_a_record_set_back_after_its_invalidation_is_never_an_answer(
    gw: Gateway,
    tiny: Tiny,
    engine: Engine,
    redis_server: RedisServer,
    embedder_dir: Path,
    scope: str,
) -> None:
    """Whatever can write to Redis can copy a sealed record and SET it back after an
    invalidation unlinked it: the record's seal covers the generations its writer read, so a
    rebuild (this gateway's after a Redis fault, a restarted gateway's) counts and skips it, and a
    paraphrase is not answered with the invalidated answer."""
    first = await gw.stub.Complete(ask(QUESTION))
    await stored(gw, 1)
    client = redis_server.client()
    names = await until_async(
        lambda: redis_server.keys("*:*:*:sem-*"), "no semantic record in Redis", 10.0
    )
    (name,) = names
    copy = client.get(name)
    assert isinstance(copy, bytes)
    if scope == "namespace":
        await gw.admin.Invalidate(pb.InvalidateRequest(namespace="sem"))
    else:
        entry = first.final.cache_entry
        await gw.admin.Invalidate(pb.InvalidateRequest(namespace="sem", entry=entry))
    await counters_until(gw, lambda c: c["semantic_entries"] == 0)
    assert not redis_server.keys("*:*:*:sem-*")
    client.set(name, copy)
    semantic = semantic_tier(gw)
    await semantic._rebuild()
    assert len(semantic.index) == 0
    assert (await gw.counters())["semantic_invalidated_records"] == 1
    restarted = await gateway(tiny, engine, semantic_config(redis_server, embedder_dir))
    try:
        counters = await counters_until(restarted, lambda c: c["semantic_in_sync"] == 1)
        assert counters["semantic_entries"] == 0
        assert counters["semantic_invalidated_records"] == 1
        reply = await restarted.stub.Complete(ask(PARAPHRASE))
        assert reply.final.cache_tier == MISS
    finally:
        await restarted.close()


async def test_an_answer_generated_across_a_rebuild_is_not_indexed(gw: Gateway) -> None:
    """A rebuild (after the follower lost Redis) may have missed invalidations: an answer whose
    generation began before it is not indexed, and no paraphrase gets it."""
    tier = semantic_tier(gw)
    paused = PausedEngine(gw)
    call = gw.stub.Complete(ask(QUESTION))
    await paused.generating()
    await tier._rebuild()  # what the follower does when Redis answers again
    paused.release.set()
    assert (await call).final.cache_tier == MISS
    await counters_until(gw, lambda c: c["semantic_invalidated_records"] == 1)
    assert len(tier.index) == 0
    assert (await gw.stub.Complete(ask(PARAPHRASE))).final.cache_tier == MISS


async def test_an_answer_generated_while_its_invalidation_ran_never_reaches_an_index(
    gw: Gateway, tiny: Tiny, engine: Engine, redis_server: RedisServer, embedder_dir: Path
) -> None:
    """An answer whose generation began before an invalidation and ended after it is neither
    indexed here nor written for the other gateways (counted), and no paraphrase gets it."""
    other = await gateway(tiny, engine, semantic_config(redis_server, embedder_dir))
    try:
        await counters_until(other, lambda c: c["semantic_in_sync"] == 1)
        paused = PausedEngine(gw)
        call = gw.stub.Complete(ask(QUESTION))
        await paused.generating()
        await gw.admin.Invalidate(pb.InvalidateRequest(namespace="sem"))
        paused.release.set()
        assert (await call).final.cache_tier == MISS
        await counters_until(gw, lambda c: c["semantic_invalidated_records"] == 1)
        assert not redis_server.keys("*:*:*:sem-*")
        for g in (gw, other):
            assert len(semantic_tier(g).index) == 0
        await semantic_tier(other)._rebuild()
        assert len(semantic_tier(other).index) == 0
        assert (await gw.stub.Complete(ask(PARAPHRASE))).final.cache_tier == MISS
    finally:
        await other.close()
