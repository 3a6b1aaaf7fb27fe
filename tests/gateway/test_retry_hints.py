"""Retry hints and the admission estimate: a refusal says when trying again can succeed, and never
invites a retry storm; the wait estimate follows the engine's actual pace. The gate's arithmetic runs
on a clock the test moves; the UNAVAILABLE hints come from a real gateway in the test's event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from appliance.gateway.admission import (
    UNKNOWN_WAIT_RETRY_MS,
    Limit,
    ModelGate,
    OverBudget,
    ServiceEstimate,
)
from appliance.gateway.errors import RequestError
from appliance.gateway.json_body import INLINE_BYTES
from appliance.gateway.pipeline import UNAVAILABLE_RETRY_MS
from appliance.gateway.server import RunningGateway
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny, engine_to_stop
from tests.gateway.test_http_api import _config, _gateway, _post
from tests.support import until_async


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _gate(clock: Clock, max_queue: int = 4) -> ModelGate:
    # 1 ms per prompt token, 10 ms per generated token; answers use a tenth of their limit.
    estimate = ServiceEstimate(
        prefill_s_per_token=0.001, decode_s_per_token=0.01, token_fraction=0.1, samples=5
    )
    return ModelGate("m", slots=1, max_queue=max_queue, estimate=estimate, clock=clock)


async def _queued(gate: ModelGate, *args: float | None) -> asyncio.Future[object]:
    """An admit() that joined the line (it is waiting when this returns)."""
    task: asyncio.Future[object] = asyncio.ensure_future(gate.admit(*args))  # type: ignore[arg-type]
    await until_async(lambda: gate.waiting, "the admit never joined the line", interval=0)
    return task


# -- the wait estimate --------------------------------------------------------------------------


async def test_a_slowed_engine_keeps_the_wait_estimate_above_zero_while_it_generates() -> None:
    """A busy host halves the engine's pace: the learned pace would call the generation done at
    its token limit's time (10.1 s) while it has half its tokens still to make."""
    clock = Clock()
    gate = _gate(clock)
    ticket = await gate.admit(100, 1000, None)
    clock.now += 0.1
    ticket.first_token()
    ticket.generated(1)
    for _ in range(21):  # 0.5 s at a time, 25 tokens each: 0.02 s a token
        clock.now += 0.5
        ticket.generated(25)
        # Its own pace, over the average answer's tokens (it may stop at any token).
        assert gate.estimated_wait(clock.now) == pytest.approx(0.02 * 100)
    assert clock.now - 100.0 == pytest.approx(10.6)  # past what the learned pace allowed it


async def test_a_generation_near_its_token_limit_is_estimated_by_the_tokens_it_has_left() -> None:
    clock = Clock()
    gate = _gate(clock)
    ticket = await gate.admit(100, 1000, None)
    clock.now += 0.1
    ticket.first_token()
    clock.now += 0.02 * 960
    ticket.generated(1 + 960)  # the first token, then 960 at 0.02 s a token
    assert gate.estimated_wait(clock.now) == pytest.approx(0.02 * 39, rel=1e-3)


# -- admitted TTFT within the budget -------------------------------------------------------------


async def test_a_slot_is_not_handed_to_a_waiter_whose_prefill_no_longer_fits() -> None:
    """The waiter's estimate fitted when it joined; the slot came free later than estimated, with
    less of its budget left than its prefill takes: refused with a hint, never started."""
    clock = Clock()
    gate = _gate(clock)
    running = await gate.admit(10, 10, None)  # estimated to need 0.11 s
    waiter = await _queued(gate, 500, 10, clock.now + 1.0)  # 0.51 s to its first token, 1 s budget
    clock.now += 0.6  # 0.4 s of budget left
    running.release(0)
    with pytest.raises(RequestError) as err:
        await waiter
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "expected prefill of 510 ms" in err.value.message
    assert err.value.retry_after_ms is not None and err.value.retry_after_ms >= 600
    assert (gate.running, gate.expired) == ([], 1)
    # The slot went to nobody: the next request starts at once.
    await gate.admit(10, 10, None)


async def test_a_waiter_whose_prefill_fits_gets_the_slot() -> None:
    clock = Clock()
    gate = _gate(clock)
    running = await gate.admit(10, 10, None)
    waiter = await _queued(gate, 500, 10, clock.now + 1.0)
    clock.now += 0.4  # 0.6 s left for 0.51 s to the first token
    running.release(0)
    await waiter
    assert (len(gate.running), gate.expired) == (1, 0)


async def test_a_waiter_leaves_the_line_when_its_prefill_would_pass_the_budget() -> None:
    """Waiting out the budget in the line: a refusal with a retry hint (the gate's real timer,
    set to the budget less the expected prefill)."""
    gate = ModelGate("m", slots=1, max_queue=4)  # the real clock; no estimate learned yet
    await gate.admit(10, 10, None)
    with pytest.raises(RequestError) as err:
        await gate.admit(10, 10, gate.clock() + 0.05)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "budget passed" in err.value.message
    # No estimate says when the line moves: the hint is at least the time it waited in vain.
    assert err.value.retry_after_ms is not None and err.value.retry_after_ms >= 50
    assert (gate.expired, len(gate.waiting)) == (1, 0)


async def test_a_waiter_whose_deadline_passes_in_line_is_told_so() -> None:
    """A deadline (no TTFT budget) that passes while the request waits, with no prefill expected
    to end the wait sooner, is DEADLINE_EXCEEDED as at every other stage, naming the deadline."""
    gate = ModelGate("m", slots=1, max_queue=4)  # the real clock; no estimate learned yet
    await gate.admit(10, 10, None)
    deadline = Limit("the request's deadline", "give the request a longer deadline", True)
    with pytest.raises(RequestError) as err:
        await gate.admit(10, 10, gate.clock() + 0.05, deadline)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "the request's deadline passed; give the request a longer deadline" in err.value.message
    assert isinstance(err.value, OverBudget)  # the request's own: a follower may still be admitted
    assert (gate.expired, len(gate.waiting)) == (1, 0)


# -- closing (the drain's grace is over) ----------------------------------------------------------


async def test_a_closed_gate_refuses_waiters_and_newcomers_with_a_hint() -> None:
    clock = Clock()
    gate = _gate(clock)
    running = await gate.admit(10, 10, None)
    waiter = await _queued(gate, 10, 10, None)
    gate.close("stopping", 1000)
    with pytest.raises(RequestError) as err:
        await waiter
    assert (err.value.code, err.value.retry_after_ms) == (grpc.StatusCode.UNAVAILABLE, 1000)
    running.release(3)
    assert gate.running == [] and not gate.waiting
    with pytest.raises(RequestError, match="stopping"):
        await gate.admit(10, 10, None)


# -- a full line before the gate has learned anything ---------------------------------------------


async def test_a_full_line_with_nothing_learned_yet_is_refused_with_a_sane_retry_hint(
    tiny: Tiny, engine: Engine
) -> None:
    """No generation has finished, so the gate knows nothing of how long one takes: its wait
    estimate is zero, which is no reason to have the client retry at once."""
    running = await _gateway(_config(tiny, engine.address, max_in_flight=1, max_queue=0))
    gate = running.pipeline.admission.gates["tiny"]  # type: ignore[attr-defined]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            # Greedy, it runs all 1500 tokens: it holds the only slot while the others ask.
            holder = stub.Generate(
                pb.GenerateRequest(
                    model="tiny", prompt="Tell me everything", max_tokens=1500, temperature=0,
                    cache_policy=pb.CACHE_POLICY_BYPASS,
                )
            )  # fmt: skip
            await holder.read()
            assert gate.estimate.samples == 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Complete(pb.GenerateRequest(model="tiny", prompt="hi", max_tokens=4))
            status, headers, _ = await _post(
                running, "/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 4}'
            )
            holder.cancel()
    finally:
        await running.drain(0.1)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "overloaded" in (err.value.details() or "")
    trailers = dict(err.value.trailing_metadata() or ())
    assert int(trailers["grpc-retry-pushback-ms"]) >= UNKNOWN_WAIT_RETRY_MS
    assert status == 429
    assert int(headers["retry-after-ms"]) >= UNKNOWN_WAIT_RETRY_MS


# -- UNAVAILABLE while the engine is down ---------------------------------------------------------


@pytest.fixture
async def gateway_without_engine(tiny: Tiny, engine_repo: Path) -> AsyncIterator[RunningGateway]:
    address, stop_engine = await engine_to_stop(engine_repo)
    running = await _gateway(_config(tiny, address))
    await stop_engine()
    await running.monitor.check()  # the readiness poll finds it gone
    yield running
    await running.drain(0.1)


async def test_an_unreachable_engine_is_refused_with_a_sane_retry_hint(
    gateway_without_engine: RunningGateway,
) -> None:
    running = gateway_without_engine
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Complete(pb.GenerateRequest(model="tiny", prompt="hi", max_tokens=4))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    trailers = dict(err.value.trailing_metadata() or ())
    assert int(trailers["grpc-retry-pushback-ms"]) >= UNAVAILABLE_RETRY_MS
    status, headers, _ = await _post(
        running, "/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 4}'
    )
    assert status == 503
    assert int(headers["retry-after-ms"]) >= UNAVAILABLE_RETRY_MS
    assert int(headers["Retry-After"]) >= 1


async def test_an_open_breaker_advertises_the_time_it_stays_open(
    tiny: Tiny, engine: Engine
) -> None:
    running = await _gateway(_config(tiny, engine.address, breaker_reset_s=30.0))
    try:
        health = running.models["tiny"].health
        for _ in range(health.breaker.threshold):
            health.failed("test: engine failing")
        assert health.breaker.state == "open"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Complete(pb.GenerateRequest(model="tiny", prompt="hi", max_tokens=4))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        trailers = dict(err.value.trailing_metadata() or ())
        assert 25_000 <= int(trailers["grpc-retry-pushback-ms"]) <= 30_000
    finally:
        await running.drain(0.1)


async def test_a_body_whose_decoder_dies_is_refused_with_a_retry_hint(
    tiny: Tiny, engine: Engine
) -> None:
    """A body past INLINE_BYTES is decoded in a worker process; one that dies refuses the body
    waiting on it with 503 and the same hint as the gateway's other 503s."""
    config = _config(tiny, engine.address)
    config = dataclasses.replace(
        config, http=dataclasses.replace(config.http, max_body_bytes=4 * INLINE_BYTES)
    )
    running = await _gateway(config)
    try:
        large = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "user": "u" * INLINE_BYTES}
        body = json.dumps(large).encode()
        before = set(multiprocessing.active_children())
        status, _, _ = await _post(running, "/v1/completions", body)
        assert status == 200
        (worker,) = set(multiprocessing.active_children()) - before
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        status, headers, reply = await _post(running, "/v1/completions", body)
        assert (status, reply["error"]["type"]) == (503, "service_unavailable_error")
        assert int(headers["retry-after-ms"]) == UNAVAILABLE_RETRY_MS
        assert int(headers["Retry-After"]) >= 1
        # The next large body gets a new worker.
        status, _, _ = await _post(running, "/v1/completions", body)
        assert status == 200
    finally:
        await running.drain(0.1)
