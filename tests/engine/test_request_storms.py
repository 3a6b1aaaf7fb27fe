"""Storms of streams, cancellations and stops leave the engine server as idle as they found it.

Every request that reaches the compute thread is reported to ModelStatistics (and the metrics
read from it) exactly once, and nothing stays pending, queued or running once the streams are gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.engine import server
from appliance.engine.metrics import EngineCollector
from appliance.engine.runner import Job
from tests.conftest import Engine
from tests.engine.test_conformance import MODEL, collect, is_final, request
from tests.support import until_async, until_engine

LONG = 1500  # tokens no request here lives to generate: each one is cancelled or stopped


async def _open(*requests: ts.ModelInferRequest) -> AsyncIterator[ts.ModelInferRequest]:
    """Sends `requests`, then keeps the stream open until the client cancels it."""
    for r in requests:
        yield r
    await asyncio.Event().wait()


async def _statistics(triton: ts_grpc.GRPCInferenceServiceStub) -> ts.ModelStatistics:
    reply = await triton.ModelStatistics(ts.ModelStatisticsRequest(name=MODEL))
    return reply.model_stats[0]


def _samples(engine: Engine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    collector = EngineCollector(engine.service, engine.models)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
        if s.labels.get("model") == MODEL
    }


async def test_storms_of_streams_cancels_and_stops_leave_the_engine_idle(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub
) -> None:
    stats = engine.stats()
    service = engine.service
    before = await _statistics(triton)
    ended_before = stats.completed + stats.cancelled + stats.failed
    stored_before = stats.kv.stored_blocks

    # Streams cancelled right after sending, and streams cancelled after their first token.
    calls = [
        triton.ModelStreamInfer(_open(request(f"storm-{i}", max_tokens=LONG)), timeout=120)
        for i in range(24)
    ]
    for call in calls[::2]:
        call.cancel()
    for call in calls[1::2]:
        await call.read()
        call.cancel()

    # Stop right after sending, on the same stream, many times over.
    stopped = await asyncio.gather(
        *(
            collect(
                triton, request(f"stopped-{i}", max_tokens=LONG), request(f"stopped-{i}", stop=True)
            )
            for i in range(16)
        )
    )
    for responses in stopped:
        assert [r.error_message for r in responses if r.error_message] == []
        assert sum(is_final(r.infer_response) for r in responses) == 2

    # One id on two streams at once, stopped from a third; stops naming an id that never ran
    # and one that has finished.
    twins = [
        asyncio.ensure_future(collect(triton, request("twin", max_tokens=LONG))) for _ in range(2)
    ]
    await until_async(lambda: len(service._by_id.get((MODEL, "twin"), [])) == 2)
    for stop_id in ("twin", "never-sent", "stopped-0"):
        (answer,) = await collect(triton, request(stop_id, stop=True))
        assert is_final(answer.infer_response) and not answer.infer_response.outputs
    for twin in twins:
        assert is_final((await twin)[-1].infer_response)

    # Every stream's handler has let go of its requests; then one request through the runner is
    # a barrier: the final results queued before it have reached the event loop.
    await until_async(lambda: not service._winding_down)
    (sentinel,) = await collect(triton, request("sentinel", max_tokens=1, streaming=False))
    assert is_final(sentinel.infer_response)
    for call in calls:
        assert await call.code() == grpc.StatusCode.CANCELLED
    # Its final result is emitted from inside its step: the compute thread lets go of it after.
    runner = engine.models[MODEL].runner
    await until_engine(stats, lambda: runner._jobs.empty() and stats.running is None)

    after = await _statistics(triton)
    ended = stats.completed + stats.cancelled + stats.failed - ended_before
    assert after.inference_count - before.inference_count == ended
    assert after.execution_count - before.execution_count == ended
    inference = after.inference_stats
    assert inference.success.count - before.inference_stats.success.count == ended
    assert inference.fail.count == before.inference_stats.fail.count
    for part in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert getattr(inference, part).count == inference.success.count, part
    assert service.pending_requests() == 0 and service.pending_by_model() == {}
    # Cancelled and stopped requests pool none of their blocks.
    assert stats.kv.stored_blocks == stored_before

    samples = _samples(engine)

    def sample(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"model": MODEL, "version": "1", **labels}.items())))]

    assert sample("nv_inference_request_success") == inference.success.count
    assert sample("nv_inference_count") == after.inference_count
    assert sample("nv_inference_pending_request_count") == 0
    for kind in ("active", "waiting"):
        assert sample("nv_trt_llm_request_metrics", request_type=kind) == 0


async def test_closing_a_stream_of_many_requests_under_one_id_is_linear(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client may send any number of requests under one id and close the stream: the server
    forgets each without comparing it with the others (a list would compare them pairwise,
    quadratic work that holds the event loop for seconds at tens of thousands)."""
    compared = 0

    class CountingJob(Job):
        def __eq__(self, other: object) -> bool:
            nonlocal compared
            compared += 1
            return self is other

        __hash__ = object.__hash__

    monkeypatch.setattr(server, "Job", CountingJob)
    service = engine.service
    count = 2000

    async def requests() -> AsyncIterator[ts.ModelInferRequest]:
        for _ in range(count):
            yield request("one-id", max_tokens=LONG)
        await asyncio.Event().wait()

    responses = service.stream(requests())
    first = asyncio.ensure_future(anext(responses))
    await until_async(lambda: service.pending_requests() == count)
    await first
    await responses.aclose()
    assert service.pending_requests() == 0 and (MODEL, "one-id") not in service._by_id
    assert compared <= count
    runner = engine.models[MODEL].runner
    await until_engine(runner.stats, lambda: runner._jobs.empty() and runner.stats.running is None)
