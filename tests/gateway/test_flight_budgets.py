"""A request's own budgets govern only that request, not the followers of a flight it leads (that
they leave the engine's breaker alone: test_client_deadlines.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from appliance.gateway.admission import (
    TTFT_BUDGET,
    GatedAdmission,
    Limit,
    ServiceEstimate,
    Ticket,
)
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


def hold_the_slot_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model="tiny",
        prompt="Tell me everything",
        max_tokens=1500,
        temperature=0,
        cache_policy=pb.CACHE_POLICY_BYPASS,
    )


def hold_the_slot(stub: pb_grpc.InferenceStub) -> grpc.aio.UnaryStreamCall:
    """A long generation, never cached: once its first message is read it holds the engine's
    slot until the test cancels it."""
    return stub.Generate(hold_the_slot_request())


async def test_a_follower_is_not_refused_for_its_leaders_ttft_budget(
    one_slot: RunningGateway,
) -> None:
    pipeline: Pipeline = one_slot.service.pipeline
    async with grpc.aio.insecure_channel(f"127.0.0.1:{one_slot.port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        # The only slot is held until the test lets it go.
        blocker = hold_the_slot(stub)
        await blocker.read()
        ask = {"model": "tiny", "prompt": "a flight in line", "max_tokens": 8, "temperature": 0}
        leader = stub.Complete(pb.GenerateRequest(**ask, ttft_budget_ms=300))  # type: ignore[arg-type]
        await until_async(lambda: len(pipeline.flights) == 1, "no flight started", 10.0, 0.01)
        joined = pipeline.flights.joined
        followers = [
            asyncio.ensure_future(
                stub.Complete(pb.GenerateRequest(**ask), timeout=60)  # type: ignore[arg-type]
            )
            for _ in range(2)
        ]
        await until_async(
            lambda: pipeline.flights.joined == joined + 2, "the followers never joined", 10.0, 0.01
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await leader
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The leader's budget has passed; the followers, which set none, are still in line.
        assert not any(f.done() for f in followers)
        blocker.cancel()
        answers = await asyncio.gather(*followers)
    for answer in answers:
        assert answer.final.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert answer.final.cache_tier == pb.CACHE_TIER_MISS
    # Each follower counts once, however many flights it followed.
    assert pipeline.cache is not None
    assert pipeline.cache.metrics.single_flight_followers == 2


@pytest.fixture
async def no_queue(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    """A gateway with L1 only, one generation at the engine at a time and nobody waiting."""
    config = gateway_config(
        tiny.tokenizer_dir,
        engine.address,
        cache=cache_config(None),
        max_in_flight=1,
        max_queue=0,
    )
    running = await start_server(config, await load_models(config))
    yield running
    await running.drain(0.2)


FOLLOWERS = 3


async def test_a_refusal_for_any_request_reaches_each_follower_once(
    no_queue: RunningGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline: Pipeline = no_queue.service.pipeline
    admission = pipeline.admission
    assert isinstance(admission, GatedAdmission)
    gate = admission.gates["tiny"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{no_queue.port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        blocker = hold_the_slot(stub)
        await blocker.read()  # it holds the only slot
        # The leader's flight asks the gate once every follower has joined it.
        asked: list[str] = []
        joined = asyncio.Event()
        admit = admission.admit

        async def admit_when_joined(
            model: str,
            prompt_tokens: int,
            max_tokens: int,
            first_token_by: float | None,
            limit: Limit = TTFT_BUDGET,
        ) -> Ticket:
            asked.append(model)
            await joined.wait()
            return await admit(model, prompt_tokens, max_tokens, first_token_by, limit)

        monkeypatch.setattr(admission, "admit", admit_when_joined)
        ask = pb.GenerateRequest(model="tiny", prompt="a full line", max_tokens=8, temperature=0)
        before = pipeline.flights.joined
        leader = asyncio.ensure_future(stub.Complete(ask, timeout=60))
        await until_async(lambda: asked, "the flight never asked for a slot", 10.0, 0.01)
        followers = [
            asyncio.ensure_future(stub.Complete(ask, timeout=60)) for _ in range(FOLLOWERS)
        ]
        await until_async(
            lambda: pipeline.flights.joined == before + FOLLOWERS, "never joined", 10.0, 0.01
        )
        joined.set()
        ended = await asyncio.gather(leader, *followers, return_exceptions=True)
        blocker.cancel()
    assert all(isinstance(e, grpc.aio.AioRpcError) for e in ended), ended
    errors = [e for e in ended if isinstance(e, grpc.aio.AioRpcError)]
    assert {e.code() for e in errors} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    # The same refusal, with the same retry hint, for each of them.
    assert len({e.details() for e in errors}) == 1
    hints = {dict(e.trailing_metadata() or ())["grpc-retry-pushback-ms"] for e in errors}
    assert len(hints) == 1
    # One admission, refused once; each follower counted once.
    assert (asked, gate.refused) == (["tiny"], 1)
    assert pipeline.cache is not None
    assert pipeline.cache.metrics.single_flight_followers == FOLLOWERS


@pytest.fixture
async def one_slot_short_default(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    """One generation at the engine at a time; a request that sets no deadline gets 2.5 s."""
    config = gateway_config(
        tiny.tokenizer_dir,
        engine.address,
        cache=cache_config(None),
        max_in_flight=1,
        default_deadline_s=2.5,
    )
    running = await start_server(config, await load_models(config))
    yield running
    await running.drain(0.2)


@pytest.mark.parametrize(
    ("ttft_budget_ms", "timeout", "named"),
    [
        (None, 2.5, "the request's deadline"),
        (None, None, "the model's default deadline"),
        (2500, 60.0, "the request's time-to-first-token budget"),
    ],
)
async def test_a_waiter_refused_in_line_is_told_which_limit_its_wait_would_pass(
    one_slot_short_default: RunningGateway,
    ttft_budget_ms: int | None,
    timeout: float | None,
    named: str,
) -> None:
    """A request that sets no TTFT budget waits in line within its deadline (its own, or the
    model's default): its refusal names that limit, not a budget it never set, and what to change.
    The status is the gate's: RESOURCE_EXHAUSTED with a retry hint, since it leaves the line
    before the limit passes (once its expected prefill no longer fits)."""
    pipeline: Pipeline = one_slot_short_default.service.pipeline
    admission = pipeline.admission
    assert isinstance(admission, GatedAdmission)
    gate = admission.gates["tiny"]
    # A learned estimate: the running generation ends at once, the waiter's prefill takes 2.2 s
    # of its 2.5: it joins the line, and leaves it within a third of a second.
    prompt_tokens = len(pipeline.models["tiny"].text.encode_prompt("hi"))
    gate.estimate = ServiceEstimate(
        prefill_s_per_token=2.2 / prompt_tokens,
        decode_s_per_token=0.0,
        token_fraction=0.0,
        samples=5,
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{one_slot_short_default.port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        blocker = stub.Generate(hold_the_slot_request(), timeout=60)
        await blocker.read()
        request = pb.GenerateRequest(
            model="tiny", prompt="hi", max_tokens=8, cache_policy=pb.CACHE_POLICY_BYPASS
        )
        if ttft_budget_ms is not None:
            request.ttft_budget_ms = ttft_budget_ms
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Complete(request, timeout=timeout)
        blocker.cancel()
    assert gate.expired == 1
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = refused.value.details() or ""
    assert named in details, details
    assert ("deadline" in details) == ("deadline" in named), details
