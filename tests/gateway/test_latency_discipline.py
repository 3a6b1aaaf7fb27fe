"""Admission, budgets, breaker, fallback and health against real engine server processes.

The gateway runs in the test's event loop (real gRPC over loopback) so a test can read its gates;
each engine server is a process the test kills, stops and restarts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.gateway.health import health_name
from appliance.gateway.models import load_models
from appliance.gateway.server import SERVICE_NAME, RunningGateway, start_server
from appliance.tools import processes
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Tiny, copy_repository
from tests.support import gateway_config, until_async

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class EngineProcess:
    repo: Path
    address: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = processes.spawn(
            ["engine", "--repository", str(self.repo), "--listen", self.address], self.log
        )

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            processes.stop(self.proc, 5)

    async def wait_ready(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = ts_grpc.GRPCInferenceServiceStub(channel)

            async def ready() -> bool:
                assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
                try:
                    return bool((await stub.ServerReady(ts.ServerReadyRequest(), timeout=1)).ready)
                except grpc.aio.AioRpcError:
                    return False

            await until_async(ready, "engine server did not start", timeout=60.0, interval=0.1)

    async def requests_seen(self) -> int:
        """Requests the engine server received (Triton's ModelStatistics)."""
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = ts_grpc.GRPCInferenceServiceStub(channel)
            stats = await stub.ModelStatistics(ts.ModelStatisticsRequest(name="tensorrt_llm"))
            return sum(m.inference_count for m in stats.model_stats)


@pytest.fixture
def engines(tiny: Tiny, tmp_path: Path) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    pair = tuple(
        EngineProcess(
            copy_repository(tiny.repo, tmp_path / f"repo{i}"),
            f"127.0.0.1:{processes.free_port()}",
            tmp_path / f"e{i}.log",
        )
        for i in range(2)
    )
    for e in pair:
        e.start()
    yield pair  # type: ignore[misc]
    for e in pair:
        e.stop()


@pytest.fixture
async def gateway(
    request: pytest.FixtureRequest, tiny: Tiny, engines: tuple[EngineProcess, EngineProcess]
) -> AsyncIterator[RunningGateway]:
    primary_kw, small_kw = getattr(request, "param", ({}, {}))
    for e in engines:
        await e.wait_ready()
    config = gateway_config(
        tiny.tokenizer_dir,
        {"primary": engines[0].address, "small": engines[1].address},
        per_model={"primary": primary_kw, "small": small_kw},
        ready_timeout_s=60.0,
    )
    running = await start_server(config, await load_models(config))
    yield running
    await running.drain(0.5)


@pytest.fixture
async def channel(gateway: RunningGateway) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as ch:
        yield ch


async def health_becomes(channel: grpc.aio.Channel, service: str, status: int) -> None:
    """Waits on the health service's own Watch stream (events, not time) for a status."""
    stub = health_pb2_grpc.HealthStub(channel)
    async with asyncio.timeout(30):
        async for reply in stub.Watch(health_pb2.HealthCheckRequest(service=service)):
            if reply.status == status:
                return


def req(model: str = "primary", **kw: Any) -> pb.GenerateRequest:
    kw.setdefault("prompt", "The appliance answers")
    kw.setdefault("max_tokens", 8)
    return pb.GenerateRequest(model=model, **kw)


# Greedy: the tiny model's answer to this prompt runs all 1500 tokens (a sampled one may end early).
LONG: dict[str, Any] = dict(
    prompt="Tell me everything",
    max_tokens=1500,
    temperature=0.0,
    cache_policy=pb.CACHE_POLICY_BYPASS,
)


@pytest.mark.parametrize("gateway", [({"max_queue": 3}, {})], indirect=True)
async def test_waiters_whose_budget_passes_never_reach_the_engine(
    gateway: RunningGateway, channel: grpc.aio.Channel, engines: tuple[EngineProcess, ...]
) -> None:
    stub = pb_grpc.InferenceStub(channel)
    gate = gateway.pipeline.admission.gates["primary"]  # type: ignore[attr-defined]
    seen = await engines[0].requests_seen()
    # Nothing finished yet, so the gate has no estimate: the waiters are let in line, then their
    # TTFT budget passes while the long generation holds the only slot.
    long = stub.Generate(req(**LONG))
    await long.read()
    waiters = [
        stub.Complete(req(ttft_budget_ms=300, cache_policy=pb.CACHE_POLICY_BYPASS))
        for _ in range(3)
    ]
    codes = []
    for call in waiters:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        codes.append((err.value.code(), err.value.details()))
    long.cancel()
    assert all(c == grpc.StatusCode.RESOURCE_EXHAUSTED for c, _ in codes), codes
    assert all("budget passed" in (d or "") for _, d in codes), codes
    assert gate.expired == 3 and not gate.waiting
    assert await engines[0].requests_seen() <= seen + 1  # only the long one


@pytest.mark.parametrize("gateway", [({"max_queue": 2}, {})], indirect=True)
async def test_overload_is_refused_at_once_with_a_retry_hint(
    gateway: RunningGateway, channel: grpc.aio.Channel, engines: tuple[EngineProcess, ...]
) -> None:
    stub = pb_grpc.InferenceStub(channel)
    gate = gateway.pipeline.admission.gates["primary"]  # type: ignore[attr-defined]
    # Learn the engine's speed from finished generations first.
    for _ in range(2):
        await stub.Complete(req(max_tokens=64, cache_policy=pb.CACHE_POLICY_BYPASS))
    assert gate.estimate.samples >= 2
    seen = await engines[0].requests_seen()
    long = stub.Generate(req(**LONG))
    await long.read()
    # Budgets far below what the running generation still needs: refused, never queued.
    calls = [
        stub.Complete(req(ttft_budget_ms=1, max_tokens=64, cache_policy=pb.CACHE_POLICY_BYPASS))
        for _ in range(6)
    ]
    refused = 0
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "estimated time to first token" in (err.value.details() or "")
        trailers = dict(err.value.trailing_metadata() or ())
        assert int(trailers["grpc-retry-pushback-ms"]) >= 1
        refused += 1
    assert refused == 6 and gate.refused == 6 and not gate.waiting
    # Without a budget, the line is bounded by count: two wait, the third is refused.
    queued = [
        stub.Generate(req(max_tokens=4, cache_policy=pb.CACHE_POLICY_BYPASS)) for _ in range(2)
    ]
    await until_async(lambda: len(gate.waiting) == 2, "the two never queued", timeout=10.0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(req(max_tokens=4, cache_policy=pb.CACHE_POLICY_BYPASS))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "overloaded" in (err.value.details() or "")
    long.cancel()
    for call in queued:
        assert [m async for m in call][-1].final.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert await engines[0].requests_seen() == seen + 3  # the long one and the two that waited


@pytest.mark.parametrize(
    "gateway",
    [({"fallback": "small", "breaker_failures": 1, "breaker_reset_s": 0.5}, {})],
    indirect=True,
)
async def test_engine_killed_falls_back_then_recovers(
    gateway: RunningGateway, channel: grpc.aio.Channel, engines: tuple[EngineProcess, ...]
) -> None:
    stub = pb_grpc.InferenceStub(channel)
    greedy = req(temperature=0, prompt="Which model answers?")
    first = await stub.Complete(greedy)
    assert (first.final.model, first.final.degraded) == ("primary", False)
    await stub.Complete(greedy)  # now cached under the primary's identity

    engines[0].signal(signal.SIGKILL)
    engines[0].proc.wait()  # type: ignore[union-attr]
    # With a fallback, the model keeps serving (degraded); the gateway as a whole too.
    await health_becomes(channel, health_name(SERVICE_NAME, "primary"), SERVING)
    fresh = req(temperature=0, prompt="Asked while the engine is down", max_tokens=6)
    answers = [await stub.Complete(fresh) for _ in range(2)]
    # The first may have found the engine gone itself: it went to the fallback before answering.
    assert [(a.final.model, a.final.degraded) for a in answers] == [("small", True)] * 2
    # Fallback answers are cached under the fallback's identity, which the primary's lookups never
    # use: both were generated.
    assert [a.final.cache_tier for a in answers] == [pb.CACHE_TIER_MISS] * 2
    fallback_entry = answers[0].final.cache_entry  # the fallback's key, named to the client
    assert answers[1].final.cache_entry == fallback_entry != ""
    cached = await stub.Complete(greedy)  # the primary's cached answer is still served
    assert cached.final.cache_tier == pb.CACHE_TIER_EXACT_L1 and cached.text == first.text
    assert cached.final.cache_entry == first.final.cache_entry

    engines[0].start()  # same port
    await engines[0].wait_ready()

    async def from_primary() -> pb.CompleteResponse | None:
        reply = await stub.Complete(fresh)
        return reply if reply.final.model == "primary" else None

    again = await until_async(from_primary, "the primary never answered again", 10.0, 0.1)
    assert (again.final.model, again.final.degraded) == ("primary", False)
    assert again.final.cache_tier == pb.CACHE_TIER_MISS  # never the fallback's cached answer
    assert again.final.cache_entry not in ("", fallback_entry)


async def test_health_flips_when_an_engine_without_fallback_dies_and_comes_back(
    gateway: RunningGateway, channel: grpc.aio.Channel, engines: tuple[EngineProcess, ...]
) -> None:
    stub = pb_grpc.InferenceStub(channel)
    await health_becomes(channel, "", SERVING)
    engines[1].signal(signal.SIGKILL)
    engines[1].proc.wait()  # type: ignore[union-attr]
    await health_becomes(channel, health_name(SERVICE_NAME, "small"), NOT_SERVING)
    await health_becomes(channel, "", NOT_SERVING)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(req("small"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no fallback model is configured" in (err.value.details() or "")
    ok = await stub.Complete(req("primary"))  # the other model is unaffected
    assert ok.final.model == "primary"
    engines[1].start()
    await engines[1].wait_ready()
    await health_becomes(channel, "", SERVING)
    assert (await stub.Complete(req("small"))).final.model == "small"


@pytest.mark.parametrize(
    "gateway",
    [({"ttft_budget_ms": 500, "breaker_failures": 2, "default_deadline_s": 2.0}, {})],
    indirect=True,
)
async def test_hung_engine_budgets_hold_and_the_breaker_opens(
    gateway: RunningGateway, channel: grpc.aio.Channel, engines: tuple[EngineProcess, ...]
) -> None:
    stub = pb_grpc.InferenceStub(channel)
    await stub.Complete(req())
    engines[0].signal(signal.SIGSTOP)
    try:
        # The client's deadline is far off: the model's TTFT budget (500 ms) ends each wait.
        codes = []
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Complete(req(cache_policy=pb.CACHE_POLICY_BYPASS), timeout=20)
            codes.append(err.value.code())
        assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}
        await health_becomes(channel, health_name(SERVICE_NAME, "primary"), NOT_SERVING)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Complete(req(cache_policy=pb.CACHE_POLICY_BYPASS), timeout=20)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # at once: the breaker is open
    finally:
        engines[0].signal(signal.SIGCONT)
    await health_becomes(channel, health_name(SERVICE_NAME, "primary"), SERVING)
