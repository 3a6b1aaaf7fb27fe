"""Gateway and engine server in the test's event loop (real gRPC over loopback), where a test has to
look at the engine's state or stop it at a chosen moment."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from appliance.config import GatewayConfig
from appliance.engine.runner import EngineStats
from appliance.gateway.models import StartupError, load_models
from appliance.gateway.report import RequestReport
from appliance.gateway.server import RunningGateway, start_server
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny, engine_to_stop
from tests.support import gateway_config, until_async, until_engine


async def _gateway(config: GatewayConfig) -> RunningGateway:
    return await start_server(config, await load_models(config))


@pytest.fixture
async def gateway(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    running = await _gateway(gateway_config(tiny.tokenizer_dir, engine.address))
    yield running
    await running.drain(0.5)


@pytest.fixture
async def stub(gateway: RunningGateway) -> AsyncIterator[pb_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield pb_grpc.InferenceStub(channel)


def long_request(**kw: object) -> pb.GenerateRequest:
    """A request that runs for all its 1500 tokens: the tiny model's greedy answer to this prompt
    never reaches the end-of-sequence token, where a sampled one may end after any token. It always
    reaches the engine: a greedy answer would otherwise be stored and replayed from the cache."""
    fields: dict[str, object] = {
        "temperature": 0.0,
        "cache_policy": pb.CACHE_POLICY_BYPASS,
        **kw,
    }
    return pb.GenerateRequest(model="tiny", prompt="Tell me everything", max_tokens=1500, **fields)  # type: ignore[arg-type]


async def test_client_cancellation_reaches_the_engine(
    engine: Engine, stub: pb_grpc.InferenceStub
) -> None:
    stats: EngineStats = engine.models["tensorrt_llm"].runner.stats
    cancelled, tokens = stats.cancelled, stats.tokens_generated
    call = stub.Generate(long_request())
    seen = 0
    async for message in call:
        seen += len(message.token_ids)
        if seen >= 3:
            break
    call.cancel()
    await until_engine(stats, lambda: stats.cancelled > cancelled and stats.running is None)
    assert stats.tokens_generated - tokens < 1500


async def test_stop_string_stops_the_engine_too(
    engine: Engine, stub: pb_grpc.InferenceStub
) -> None:
    stats: EngineStats = engine.models["tensorrt_llm"].runner.stats
    probe = await stub.Complete(
        pb.GenerateRequest(model="tiny", prompt="Tell me everything", max_tokens=8, temperature=0)
    )
    cancelled = stats.cancelled
    stop = probe.text[2:5]
    reply = await stub.Complete(long_request(stop=[stop]))
    assert reply.final.finish_reason == pb.FINISH_REASON_STOP
    await until_engine(stats, lambda: stats.cancelled > cancelled and stats.running is None)


async def test_engine_unreachable_at_run_time_is_unavailable_fast(
    tiny: Tiny, engine_repo: Path
) -> None:
    address, stop_engine = await engine_to_stop(engine_repo)
    running = await _gateway(gateway_config(tiny.tokenizer_dir, address))
    try:
        await stop_engine()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Complete(
                    pb.GenerateRequest(model="tiny", prompt="hi", max_tokens=4), timeout=30
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # Whether the health monitor saw it first or the request did, the message says where.
            assert f"inference server at {address}" in (err.value.details() or "")
            assert "unavailable" in (err.value.details() or "")
            assert loop.time() - started < 5.0  # refused at once, not a TCP or deadline timeout
    finally:
        await running.drain(0.1)


async def test_a_model_that_is_not_decoupled_is_refused_at_start_up(
    tiny: Tiny, engine: Engine
) -> None:
    with pytest.raises(
        StartupError,
        match=r"model 'sync_llm' .* is not decoupled; streaming needs 'model_transaction_policy \{ decoupled: true \}'",
    ):
        await load_models(
            gateway_config(tiny.tokenizer_dir, engine.address, triton_model="sync_llm")
        )


async def test_earlier_input_names_are_mapped(tiny: Tiny, engine: Engine) -> None:
    running = await _gateway(
        gateway_config(tiny.tokenizer_dir, engine.address, triton_model="legacy_names_llm")
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            r = pb.GenerateRequest(
                model="tiny", prompt="seeded", max_tokens=10, temperature=1.0, seed=5
            )
            a, b = await stub.Complete(r), await stub.Complete(r)
            assert list(a.token_ids) == list(b.token_ids)
    finally:
        await running.drain(0.1)


async def test_drain_ends_in_flight_requests_as_cancelled(tiny: Tiny, engine: Engine) -> None:
    running = await _gateway(gateway_config(tiny.tokenizer_dir, engine.address))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        call = stub.Generate(long_request())
        await call.read()
        drained = asyncio.ensure_future(running.drain(0.2))
        messages = []
        while (message := await call.read()) is not grpc.aio.EOF:
            messages.append(message)
        await drained
    assert messages[-1].final.finish_reason == pb.FINISH_REASON_CANCELLED


async def test_one_client_cancelling_never_stops_another_with_the_same_request_id(
    tiny: Tiny, engine: Engine
) -> None:
    # Two slots at the gateway, so both requests reach the engine (it queues the second).
    running = await _gateway(gateway_config(tiny.tokenizer_dir, engine.address, max_in_flight=2))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            await _same_request_id(engine, pb_grpc.InferenceStub(channel))
    finally:
        await running.drain(0.5)


async def _same_request_id(engine: Engine, stub: pb_grpc.InferenceStub) -> None:
    stats: EngineStats = engine.models["tensorrt_llm"].runner.stats
    other = pb.GenerateRequest(
        model="tiny",
        prompt="Another client",
        max_tokens=20,
        temperature=0,
        request_id="same",
        cache_policy=pb.CACHE_POLICY_BYPASS,
    )
    reference = await stub.Complete(other)
    cancelled = stats.cancelled
    first = stub.Generate(long_request(request_id="same"))
    await first.read()
    second = asyncio.ensure_future(stub.Complete(other))
    await until_async(  # the engine holds both requests (the second queued behind)
        lambda: engine.service.pending_requests() >= 2, "the second request never queued", 5.0
    )
    first.cancel()
    await until_engine(stats, lambda: stats.cancelled > cancelled)
    reply = await second
    assert reply.request_id == "same"
    assert list(reply.token_ids) == list(reference.token_ids)
    assert reply.final.finish_reason == reference.final.finish_reason


class RecordingSink:
    def __init__(self) -> None:
        self.reports: list[RequestReport] = []
        self.changed = asyncio.Event()

    def report(self, r: RequestReport) -> None:
        self.reports.append(r)
        self.changed.set()

    async def wait_for(self, n: int) -> list[RequestReport]:
        while len(self.reports) < n:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 10)
        return self.reports


async def test_every_request_is_reported_once_with_its_facts(tiny: Tiny, engine: Engine) -> None:
    sink = RecordingSink()
    config = gateway_config(tiny.tokenizer_dir, engine.address)
    running = await start_server(config, await load_models(config), sink)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            r = pb.GenerateRequest(
                model="tiny", prompt="Report me", max_tokens=6, temperature=0, request_id="r1"
            )
            miss = await stub.Complete(r)
            await stub.Complete(r)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Complete(pb.GenerateRequest(model="tiny", prompt="x", max_tokens=0))
        first, hit, bad = await sink.wait_for(3)
    finally:
        await running.drain(0.5)
    assert (first.request_id, first.model, first.tier, first.status) == ("r1", "tiny", "miss", "OK")
    assert first.finish_reason in ("stop", "length") and first.answered_by == "tiny"
    assert first.completion_tokens == miss.final.usage.completion_tokens > 0
    assert first.ttft_us == miss.final.timings.ttft_us and first.total_us >= first.ttft_us
    assert len(first.inter_token_us) == first.completion_tokens - 1  # one token a message
    assert (hit.tier, hit.status, hit.completion_tokens) == ("l1", "OK", first.completion_tokens)
    assert (bad.status, bad.tier, bad.completion_tokens) == ("INVALID_ARGUMENT", "miss", 0)
