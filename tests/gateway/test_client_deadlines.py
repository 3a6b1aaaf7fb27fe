"""A client's own time limits (its deadline, its TTFT budget, its cancelling) end its own request
and never count against the engine's breaker, which every other client depends on.

The gateway runs in the test's event loop against real engine server processes (the fixtures of
test_latency_discipline), so a test can read its gates and breakers.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

import grpc
import pytest

from appliance.gateway.report import RequestReport
from appliance.gateway.server import RunningGateway
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.gateway.test_latency_discipline import (  # noqa: F401  (fixtures)
    EngineProcess,
    channel,
    engines,
    gateway,
    req,
)
from tests.support import until_async

BYPASS = pb.CACHE_POLICY_BYPASS


@pytest.mark.parametrize("gateway", [({"breaker_failures": 1}, {})], indirect=True)
async def test_a_clients_ttft_budget_below_the_engines_ttft_leaves_the_breaker_closed(
    gateway: RunningGateway,  # noqa: F811
    channel: grpc.aio.Channel,  # noqa: F811
    engines: tuple[EngineProcess, ...],  # noqa: F811
) -> None:
    stub = pb_grpc.InferenceStub(channel)
    model = gateway.pipeline.models["primary"]
    gate = gateway.pipeline.admission.gates["primary"]  # type: ignore[attr-defined]
    # One engine fault opens the breaker; the model sets no TTFT budget of its own.
    await stub.Complete(req(cache_policy=BYPASS))
    # The engine is stopped while the request reaches it: its first token comes well after the
    # client's 1 ms, and the free slot admits the request whatever its budget.
    engines[0].signal(signal.SIGSTOP)
    try:
        call = stub.Complete(req(ttft_budget_ms=1, cache_policy=BYPASS))
        await until_async(lambda: bool(gate.running), "the request never reached the engine")
    finally:
        engines[0].signal(signal.SIGCONT)
    answer = await call
    assert answer.final.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert model.health.breaker.state == "closed", model.health.last_failure
    # Every other client still reaches the engine.
    assert (await stub.Complete(req(cache_policy=BYPASS))).final.model == "primary"


async def test_a_call_grpc_ends_at_its_deadline_is_logged_as_deadline_exceeded(
    gateway: RunningGateway,  # noqa: F811
    channel: grpc.aio.Channel,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    stub = pb_grpc.InferenceStub(channel)
    caplog.set_level(logging.INFO, logger="appliance.access")
    # Every tokenizer thread is busy: a long chat waits for one past its deadline, before the
    # pipeline's own deadline timer starts, so it is gRPC that ends the call.
    busy = threading.Event()
    pool = gateway.pipeline._tokenizers
    held = [pool.submit(busy.wait) for _ in range(pool._max_workers)]
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="word " * 2000)])
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Complete(
                pb.GenerateRequest(model="primary", request_id="late", messages=chat, max_tokens=4),
                timeout=0.2,
            )
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        def logged() -> RequestReport | None:
            reports = [getattr(r, "access", None) for r in caplog.records]
            return next((r for r in reports if r is not None and r.request_id == "late"), None)

        report = await until_async(logged, "no access line for the late request")
    finally:
        busy.set()
    await asyncio.wrap_future(held[0])
    assert report.status == "DEADLINE_EXCEEDED"
    assert gateway.pipeline.in_flight["primary"] == 0
