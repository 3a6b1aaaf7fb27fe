"""The semantic lookup overlapping the engine's start (`overlap_engine`): the in-process engine
server, a real embedder, and a real redis-server where the test says so.

The tests decide when the semantic lookup ends: the tier's embedder waits for the test before it
embeds the paraphrase, so "the engine is generating while the lookup runs" is a fact the test
waited for, not a race it hopes to win.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest

from appliance.config import CacheConfig
from appliance.engine.runner import EngineStats
from appliance.gateway.models import load_models
from appliance.gateway.report import RequestReport
from appliance.gateway.server import start_server
from appliance.v1 import inference_pb2 as pb
from tests.cache.redis_server import RedisServer
from tests.cache.test_cache_e2e import Gateway, counters_until, settle, started
from tests.cache.test_semantic_e2e import (
    MISS,
    QUESTION,
    SEMANTIC,
    HeldEmbedding,
    ask,
    semantic_config,
    semantic_tier,
    stored,
)
from tests.conftest import Engine, Tiny, engine_to_stop
from tests.support import gateway_config, until_async, until_engine

PARAPHRASE = "How can I get rid of acne?"
# Long enough that a generation is still running when the lookup ends (the test cancels it).
LONG = 400


async def overlap_gateway(
    tiny: Tiny,
    cache: CacheConfig,
    backends: dict[str, str],
    overlap: bool = True,
    fallbacks: dict[str, str] | None = None,
    **model: Any,
) -> Gateway:
    """A gateway serving a model per backend address; `model`: ModelConfig fields every model
    gets."""
    cache = dataclasses.replace(
        cache, semantic=dataclasses.replace(cache.semantic, overlap_engine=overlap)
    )
    config = gateway_config(
        tiny.tokenizer_dir,
        backends,
        per_model={name: {"fallback": to} for name, to in (fallbacks or {}).items()},
        cache=cache,
        **model,
    )
    running = await start_server(config, await load_models(config))
    return Gateway(running, grpc.aio.insecure_channel(f"127.0.0.1:{running.port}"))


@pytest.fixture
def reports(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[RequestReport]]]:
    """The reports of the requests finished so far (from the access log's records)."""
    with caplog.at_level(logging.INFO, logger="appliance.access"):
        yield lambda: [r.access for r in caplog.records if hasattr(r, "access")]


@pytest.fixture
async def gw(tiny: Tiny, engine: Engine, embedder_dir: Path) -> AsyncIterator[Gateway]:
    """Overlap on, the tier this gateway's own (no Redis: always in step)."""
    g = await overlap_gateway(tiny, semantic_config(None, embedder_dir), {"tiny": engine.address})
    yield g
    await g.close()


@dataclass
class Overlapping:
    """A paraphrase asked while its semantic lookup is held and the engine runs its generation."""

    answer: pb.CompleteResponse  # the cached question's
    held: HeldEmbedding
    call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]
    cancelled: int  # the engine's count of cancelled generations before the paraphrase


async def paraphrase_while_generating(gw: Gateway, engine: Engine) -> Overlapping:
    answer = await gw.stub.Complete(ask(QUESTION, max_tokens=LONG))
    await stored(gw, 1)
    held = HeldEmbedding(semantic_tier(gw), PARAPHRASE)
    stats = engine.stats()
    before, cancelled = stats.started, stats.cancelled
    call = gw.stub.Generate(ask(PARAPHRASE, max_tokens=LONG))
    await until_async(
        lambda: stats.started > before and stats.running is not None,
        "the engine never started the paraphrase",
        interval=0.005,
    )
    return Overlapping(answer, held, call, cancelled)


async def engine_cancelled(stats: EngineStats, before: int) -> None:
    await until_engine(stats, lambda: stats.cancelled > before)


async def test_a_hit_while_the_engine_generates_answers_and_cancels_the_generation(
    gw: Gateway, engine: Engine, reports: Callable[[], list[RequestReport]]
) -> None:
    running = await paraphrase_while_generating(gw, engine)
    first = running.answer
    running.held.release.set()
    messages = [m async for m in running.call]
    # Exactly a semantic hit's shape: one delta with the cached answer, then the final message.
    assert [m.HasField("final") for m in messages] == [False, True]
    final = messages[-1].final
    assert (final.cache_tier, messages[0].text) == (SEMANTIC, first.text)
    assert list(messages[0].token_ids) == list(first.token_ids)
    assert final.similarity > 0.8 and final.cache_entry
    await engine_cancelled(engine.stats(), running.cancelled)
    assert (await gw.counters())["engine_cancelled_by_hit"] == 1
    scrape = generate_latest(gw.running.metrics.registry).decode()
    assert "appliance_cache_engine_cancelled_by_semantic_hit_total 1.0" in scrape
    assert reports()[-1].overlap == "cancelled" and reports()[-1].tier == "semantic"
    assert len(gw.running.pipeline.flights) == 0


async def test_a_request_that_joined_a_flight_and_then_hit_is_no_follower(
    gw: Gateway, engine: Engine
) -> None:
    """The same paraphrase twice while its lookup is held: the second joins the first's flight
    beside its own lookup, then both hit; neither followed a generation."""
    running = await paraphrase_while_generating(gw, engine)
    flights = gw.running.pipeline.flights
    second = gw.stub.Generate(ask(PARAPHRASE, max_tokens=LONG))
    await until_async(lambda: flights.joined, "the second never joined", interval=0.005)
    running.held.release.set()
    for call in (running.call, second):
        messages = [m async for m in call]
        assert messages[-1].final.cache_tier == SEMANTIC
    await engine_cancelled(engine.stats(), running.cancelled)
    assert (await gw.counters())["single_flight_followers"] == 0
    assert len(flights) == 0


async def test_a_paraphrase_whose_vector_is_recent_starts_no_generation(
    gw: Gateway, engine: Engine, reports: Callable[[], list[RequestReport]]
) -> None:
    first = await gw.stub.Complete(ask(QUESTION))
    await stored(gw, 1)
    hit = await gw.stub.Complete(ask(PARAPHRASE))  # embeds: overlaps a generation
    assert hit.final.cache_tier == SEMANTIC
    cancelled = (await gw.counters())["engine_cancelled_by_hit"]
    started = engine.stats().started
    for _ in range(2):
        hit = await gw.stub.Complete(ask(PARAPHRASE))
        assert (hit.final.cache_tier, hit.text) == (SEMANTIC, first.text)
        # The lookup answered from the recent vector before a generation was started.
        assert reports()[-1].overlap == ""
    assert engine.stats().started == started
    assert (await gw.counters())["engine_cancelled_by_hit"] == cancelled
    assert len(gw.running.pipeline.flights) == 0


async def test_a_miss_answers_as_without_overlap_and_is_stored_in_every_tier(
    tiny: Tiny,
    engine: Engine,
    redis_server: RedisServer,
    embedder_dir: Path,
    reports: Callable[[], list[RequestReport]],
) -> None:
    redis_server.client().flushall()
    on = await overlap_gateway(
        tiny, semantic_config(redis_server, embedder_dir), {"tiny": engine.address}
    )
    off = await overlap_gateway(
        tiny, semantic_config(None, embedder_dir), {"tiny": engine.address}, overlap=False
    )
    try:
        await counters_until(on, lambda c: c["semantic_in_sync"] == 1)
        request = ask("What is the capital of Australia?", max_tokens=24)
        overlapped = [m async for m in on.stub.Generate(request)]
        assert reports()[-1].overlap == "missed"
        plain = [m async for m in off.stub.Generate(request)]
        assert reports()[-1].overlap == ""
        for messages in (overlapped, plain):
            assert messages[-1].final.cache_tier == MISS
        assert [(m.text, list(m.token_ids)) for m in overlapped[:-1]] == [
            (m.text, list(m.token_ids)) for m in plain[:-1]
        ]
        a, b = overlapped[-1].final, plain[-1].final
        assert (a.finish_reason, a.usage, a.model) == (b.finish_reason, b.usage, b.model)
        # Written to every tier: L1 answers the same request, Redis holds the exact entry and
        # the semantic record, and the tier a paraphrase.
        assert (await on.stub.Complete(request)).final.cache_tier == pb.CACHE_TIER_EXACT_L1
        await stored(on, 1)
        await settle()
        keys = redis_server.keys("appliance:sem:*")
        assert len(keys) == 2 and sum(b":sem-" in k for k in keys) == 1
        paraphrase = ask("What's the capital of Australia?", max_tokens=24)
        assert (await on.stub.Complete(paraphrase)).final.cache_tier == SEMANTIC
    finally:
        await on.close()
        await off.close()


async def test_a_hit_answers_when_the_engine_is_gone(
    tiny: Tiny, engine_repo: Path, embedder_dir: Path, reports: Callable[[], list[RequestReport]]
) -> None:
    address, stop = await engine_to_stop(engine_repo)
    g = await overlap_gateway(tiny, semantic_config(None, embedder_dir), {"tiny": address})
    try:
        first = await g.stub.Complete(ask(QUESTION))
        await stored(g, 1)
        await stop()
        # The generation fails, or is cancelled still connecting (the paraphrase's vector is
        # reused), or cannot start once the breaker is open: the hit answers each time.
        for _ in range(3):
            hit = await g.stub.Complete(ask(PARAPHRASE))
            assert (hit.final.cache_tier, hit.text) == (SEMANTIC, first.text)
            assert reports()[-1].overlap in ("ended", "failed", "cancelled", "unstarted", "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await g.stub.Complete(ask("Where is the nearest train station?"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # a miss fails as it always did
        assert reports()[-1].overlap in ("missed", "")
    finally:
        await g.close()


async def test_a_hit_answers_when_admission_refuses_the_generation(
    tiny: Tiny, engine: Engine, embedder_dir: Path, reports: Callable[[], list[RequestReport]]
) -> None:
    g = await overlap_gateway(
        tiny,
        semantic_config(None, embedder_dir),
        {"tiny": engine.address},
        max_in_flight=1,
        max_queue=0,
    )
    try:
        first = await g.stub.Complete(ask(QUESTION))
        await stored(g, 1)
        busy = g.stub.Generate(ask("Tell me a long story.", max_tokens=1500))
        await busy.read()  # it holds the one slot
        gate = g.running.pipeline.admission.gates["tiny"]  # type: ignore[attr-defined]
        refused = gate.refused
        hit = await g.stub.Complete(ask(PARAPHRASE))
        assert (hit.final.cache_tier, hit.text) == (SEMANTIC, first.text)
        assert gate.refused == refused + 1 and reports()[-1].overlap == "ended"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await g.stub.Complete(ask("Where is the nearest train station?"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        busy.cancel()
    finally:
        await g.close()


async def test_a_miss_with_the_engine_gone_fails_over_to_the_fallback(
    tiny: Tiny,
    engine: Engine,
    engine_repo: Path,
    embedder_dir: Path,
    reports: Callable[[], list[RequestReport]],
) -> None:
    address, stop = await engine_to_stop(engine_repo)
    cache = semantic_config(None, embedder_dir)
    # Both models that lose their engine use one; only `tiny` has a fallback.
    g = await overlap_gateway(
        tiny,
        cache,
        {"tiny": address, "lone": address, "small": engine.address},
        fallbacks={"tiny": "small"},
    )
    try:
        await stop()
        answer = await g.stub.Complete(ask("Which planet is the largest?"))
        assert (answer.final.model, answer.final.degraded) == ("small", True)
        assert answer.final.cache_tier == MISS and reports()[-1].overlap == "missed"
        lone = ask("Which planet is the largest?")
        lone.model = "lone"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await g.stub.Complete(lone)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await g.close()


async def test_a_client_cancelling_during_the_lookup_stops_both(
    gw: Gateway, engine: Engine, reports: Callable[[], list[RequestReport]]
) -> None:
    running = await paraphrase_while_generating(gw, engine)
    running.call.cancel()
    await engine_cancelled(engine.stats(), running.cancelled)
    overlapping = {"TierCascade.lookup", "Flight._run", "Pipeline.engine"}

    def pending() -> list[asyncio.Task[object]]:
        return [
            t
            for t in asyncio.all_tasks()
            if getattr(t.get_coro(), "__qualname__", "") in overlapping
        ]

    await until_async(
        lambda: not pending() and reports(), lambda: f"still pending: {pending()}", 10.0
    )
    running.held.release.set()
    assert reports()[-1].status == "CANCELLED" and reports()[-1].overlap == ""
    assert len(gw.running.pipeline.flights) == 0
    assert (await gw.counters())["engine_cancelled_by_hit"] == 0


async def test_only_and_requests_the_tier_does_not_take_never_overlap(
    gw: Gateway, engine: Engine, reports: Callable[[], list[RequestReport]]
) -> None:
    await gw.stub.Complete(ask(QUESTION))
    await stored(gw, 1)
    before = started(engine)
    only = await gw.stub.Complete(ask(PARAPHRASE, cache_policy=pb.CACHE_POLICY_ONLY))
    assert only.final.cache_tier == SEMANTIC and reports()[-1].overlap == ""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await gw.stub.Complete(ask("Unheard of?", cache_policy=pb.CACHE_POLICY_ONLY))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert started(engine) == before  # ONLY never starts a generation
    for request in (
        ask(PARAPHRASE, semantic_cache=False),
        ask(PARAPHRASE, namespace="off"),
        ask("?!..."),
    ):
        reply = await gw.stub.Complete(request)
        assert reply.final.cache_tier == MISS and reports()[-1].overlap == "", request
