"""A request's own budgets govern only that request, not the followers of a flight it leads (that
they leave the engine's breaker alone: test_client_deadlines.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from appliance.gateway.models import load_models
from appliance.gateway.pipeline import Pipeline
from appliance.gateway.server import RunningGateway, start_server
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.cache.test_cache_e2e import cache_config
from tests.conftest import Engine, Tiny
from tests.support import gateway_config, until_async


@pytest.fixture
async def one_slot(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    """A gateway with L1 only and one generation at the engine at a time."""
    config = gateway_config(
        tiny.tokenizer_dir, engine.address, cache=cache_config(None), max_in_flight=1
    )
    running = await start_server(config, await load_models(config))
    yield running
    await running.drain(0.2)


async def test_a_follower_is_not_refused_for_its_leaders_ttft_budget(
    one_slot: RunningGateway,
) -> None:
    pipeline: Pipeline = one_slot.service.pipeline
    async with grpc.aio.insecure_channel(f"127.0.0.1:{one_slot.port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        # The only slot is held until the test lets it go.
        blocker = stub.Generate(
            pb.GenerateRequest(
                model="tiny",
                prompt="Tell me everything",
                max_tokens=1500,
                temperature=0,
                cache_policy=pb.CACHE_POLICY_BYPASS,
            )
        )
        await blocker.read()
        ask = {"model": "tiny", "prompt": "a flight in line", "max_tokens": 8, "temperature": 0}
        leader = stub.Complete(pb.GenerateRequest(**ask, ttft_budget_ms=300))  # type: ignore[arg-type]
        await until_async(lambda: len(pipeline.flights) == 1, "no flight started", 10.0, 0.01)
        joined = pipeline.flights.joined
        follower = asyncio.ensure_future(
            stub.Complete(pb.GenerateRequest(**ask), timeout=60)  # type: ignore[arg-type]
        )
        await until_async(
            lambda: pipeline.flights.joined > joined, "the follower never joined", 10.0, 0.01
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await leader
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The leader's budget has passed; the follower, which set none, is still in line.
        assert not follower.done()
        blocker.cancel()
        answer = await follower
    assert answer.final.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert answer.final.cache_tier == pb.CACHE_TIER_MISS
