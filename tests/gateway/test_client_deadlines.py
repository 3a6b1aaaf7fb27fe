"""A client's own time limits (its deadline, its TTFT budget) end its own request, at every stage,
with the status the client sees, and never count against the engine's breaker, which every other
client depends on.

The gateway runs in the test's event loop, against engine server processes (the fixtures of
test_latency_discipline) or the in-process engine, so a test can read its gates and breakers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading

import grpc
import pytest

from appliance.gateway.models import load_models
from appliance.gateway.report import RequestReport
from appliance.gateway.server import RunningGateway, start_server
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny
from tests.gateway.test_http_api import _config, _post
from tests.gateway.test_inprocess import RecordingSink
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
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stub = pb_grpc.InferenceStub(channel)
    caplog.set_level(logging.INFO, logger="appliance.access")
    # A cache lookup that never answers (a stalled tier): no timer of the pipeline's runs yet,
    # so it is gRPC that ends the call at its deadline.
    looking = asyncio.Event()

    async def stalled(*_: object) -> None:
        looking.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(gateway.pipeline, "lookup", stalled)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(req(request_id="late", temperature=0), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert looking.is_set()

    def logged() -> RequestReport | None:
        reports = [getattr(r, "access", None) for r in caplog.records]
        return next((r for r in reports if r is not None and r.request_id == "late"), None)

    report = await until_async(logged, "no access line for the late request")
    assert report.status == "DEADLINE_EXCEEDED"
    assert gateway.pipeline.in_flight["primary"] == 0


async def test_the_deadline_bounds_the_wait_for_a_tokenizer_thread(
    tiny: Tiny, engine: Engine
) -> None:
    sink = RecordingSink()
    config = _config(tiny, engine.address)
    running = await start_server(config, await load_models(config), sink)
    assert running.http is not None
    # Every tokenizer thread is busy: a long chat waits for one, and only its deadline ends it.
    busy = threading.Event()
    pool = running.pipeline._tokenizers
    held = [pool.submit(busy.wait) for _ in range(pool._max_workers)]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "word " * 2000}],
        "max_tokens": 4,
        "appliance": {"deadline_ms": 200, "request_id": "waits"},
    }
    posting = asyncio.ensure_future(
        _post(running, "/v1/chat/completions", json.dumps(body).encode())
    )
    try:
        [report] = await sink.wait_for(1)  # the request ends while the threads are still busy
        status, _, reply = await posting
    finally:
        posting.cancel()
        busy.set()
        await asyncio.wrap_future(held[0])
        await running.drain(0.5)
    assert status == 504, reply
    assert "within the deadline" in reply["error"]["message"]
    assert (report.request_id, report.status) == ("waits", "DEADLINE_EXCEEDED")
    assert running.pipeline.in_flight == {"tiny": 0}


async def test_a_request_cancelled_mid_stream_reports_the_tokens_it_was_sent(
    tiny: Tiny, engine: Engine
) -> None:
    sink = RecordingSink()
    config = _config(tiny, engine.address)
    running = await start_server(config, await load_models(config), sink)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            call = pb_grpc.InferenceStub(channel).Generate(
                pb.GenerateRequest(
                    model="tiny", prompt="Tell me everything", max_tokens=1500, temperature=0,
                    cache_policy=BYPASS,
                )
            )  # fmt: skip
            received = 0
            async for reply in call:
                received += len(reply.token_ids)
                if received >= 3:
                    break
            call.cancel()
            [report] = await sink.wait_for(1)
    finally:
        await running.drain(0.5)
    assert report.status == "CANCELLED"
    assert report.prompt_tokens > 0
    assert received <= report.completion_tokens < 1500  # sent, some perhaps still in transit
