"""Once a model's breaker has been open for breaker_reset_s, one request probes the engine; the
others are refused as while it was open, with a retry hint, until the probe's outcome closes or
reopens it. A probe that ends without a verdict (its client cancelled it) lets the next request
probe. The gateway runs in the test's event loop against engine server processes (the fixtures of
test_latency_discipline).
"""

from __future__ import annotations

import signal
from typing import Any

import grpc
import pytest

from appliance.gateway.breaker import CircuitBreaker
from appliance.gateway.pipeline import UNAVAILABLE_RETRY_MS
from appliance.gateway.server import RunningGateway
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.gateway.test_latency_discipline import (  # noqa: F401  (fixtures)
    EngineProcess,
    channel,
    engines,
    gateway,
    req,
)
from tests.support import until_async

PRIMARY = {"breaker_failures": 1, "breaker_reset_s": 0.2, "max_in_flight": 2}


async def _half_open(
    running: RunningGateway, to: grpc.aio.Channel
) -> tuple[pb_grpc.InferenceStub, Any, CircuitBreaker]:
    """Opens the primary's breaker and waits until it is half-open: (a stub, the primary's
    admission gate, its breaker)."""
    health = running.pipeline.models["primary"].health
    health.failed("a test opened it")
    await until_async(lambda: health.breaker.state == "half-open", "the breaker never half-opened")
    gate = running.pipeline.admission.gates["primary"]  # type: ignore[attr-defined]
    return pb_grpc.InferenceStub(to), gate, health.breaker


@pytest.mark.parametrize("gateway", [(PRIMARY, {})], indirect=True)
async def test_one_request_probes_a_half_open_breaker_and_the_others_are_refused(
    gateway: RunningGateway,  # noqa: F811
    channel: grpc.aio.Channel,  # noqa: F811
    engines: tuple[EngineProcess, ...],  # noqa: F811
) -> None:
    stub, gate, breaker = await _half_open(gateway, channel)
    engines[0].signal(signal.SIGSTOP)  # the probe waits at the engine
    try:
        probe = stub.Complete(req(prompt="the probe", temperature=0))
        await until_async(lambda: bool(gate.running), "the probe never reached the engine")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Complete(req(prompt="while it probes", temperature=0))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "one request is probing the engine now" in (refused.value.details() or "")
        trailers = dict(refused.value.trailing_metadata() or ())
        assert int(trailers["grpc-retry-pushback-ms"]) >= UNAVAILABLE_RETRY_MS
        assert len(gate.running) == 1  # the refused one never reached the engine
    finally:
        engines[0].signal(signal.SIGCONT)
    assert (await probe).final.model == "primary"
    assert breaker.state == "closed"
    assert (await stub.Complete(req(prompt="after it", temperature=0))).final.model == "primary"


@pytest.mark.parametrize("gateway", [(PRIMARY, {})], indirect=True)
async def test_a_probe_its_client_cancels_lets_the_next_request_probe(
    gateway: RunningGateway,  # noqa: F811
    channel: grpc.aio.Channel,  # noqa: F811
    engines: tuple[EngineProcess, ...],  # noqa: F811
) -> None:
    stub, gate, breaker = await _half_open(gateway, channel)
    engines[0].signal(signal.SIGSTOP)
    try:
        probe = stub.Complete(req(prompt="a probe given up", temperature=0))
        await until_async(lambda: bool(gate.running), "the probe never reached the engine")
        probe.cancel()
        await until_async(lambda: not gate.running, "the cancelled probe kept its slot")
    finally:
        engines[0].signal(signal.SIGCONT)
    # The model sets no TTFT budget, so the cancelled probe said nothing of the engine.
    assert breaker.state == "half-open"
    assert (await stub.Complete(req(prompt="the next probe", temperature=0))).final.model == (
        "primary"
    )
    assert breaker.state == "closed"


@pytest.mark.parametrize(
    "gateway", [({**PRIMARY, "max_in_flight": 1, "fallback": "small"}, {})], indirect=True
)
async def test_while_the_probe_runs_the_fallback_answers_at_once(
    gateway: RunningGateway,  # noqa: F811
    channel: grpc.aio.Channel,  # noqa: F811
    engines: tuple[EngineProcess, ...],  # noqa: F811
) -> None:
    """The probe holds the primary's only slot: the next request goes to the fallback, rather
    than waiting in the primary's line behind the probe."""
    stub, gate, breaker = await _half_open(gateway, channel)
    engines[0].signal(signal.SIGSTOP)
    try:
        probe = stub.Complete(req(prompt="the probe", temperature=0))
        await until_async(lambda: bool(gate.running), "the probe never reached the engine")
        other = await stub.Complete(req(prompt="meanwhile", temperature=0), timeout=30)
        assert (other.final.model, other.final.degraded) == ("small", True)
        assert not gate.waiting
    finally:
        engines[0].signal(signal.SIGCONT)
    assert (await probe).final.model == "primary"
    assert breaker.state == "closed"
