"""Two gateways as one fleet (real engine server and gateway processes): a client channel from
`connect_fleet` balances over both, stops sending to a gateway told to drain (SIGUSR1: health
NOT_SERVING, requests still answered) and to one that stopped, and no request fails."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from grpc_health.v1 import health_pb2

from appliance import sdnotify
from appliance.client import connect, connect_fleet, fleet_target, generate
from appliance.config import CacheConfig
from appliance.gateway import quiesce as quiesce_module
from appliance.gateway.health import health_name
from appliance.gateway.models import load_models
from appliance.gateway.server import SERVICE_NAME, start_server
from appliance.v1 import inference_pb2 as pb
from tests.conftest import Engine, Tiny, copy_repository
from tests.gateway.stack import MODEL, Stack, engine_and_gateway
from tests.support import gateway_config, until, until_async


@pytest.fixture(scope="module")
def fleet(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Stack]]:
    with ExitStack() as stack:
        hosts = []
        for name in ("a", "b"):
            work = tmp_path_factory.mktemp(f"host-{name}")
            own = Tiny(tiny.model_dir, copy_repository(tiny.repo, work / "repo"))
            hosts.append(stack.enter_context(engine_and_gateway(own, work)))
        yield hosts


def answered(host: Stack) -> int:
    return sum(" appliance.access " in line for line in host.log_lines())


def health(address: str) -> int:
    """`appliance health`'s exit status for one gateway."""
    return subprocess.run(
        [sys.executable, "-m", "appliance", "health", "--gateway", address],
        capture_output=True,
        check=False,
        timeout=30,
    ).returncode


async def send(addresses: list[str], n: int) -> list[str]:
    """n requests through one fleet channel; the failures' codes."""
    channel, stub = connect_fleet(addresses)
    failures = []
    async with channel:
        for k in range(n):
            request = pb.GenerateRequest(model=MODEL, prompt=f"q {k}", max_tokens=2, temperature=1)
            try:
                await generate(stub, request, timeout=30)
            except Exception as exc:  # counted, not raised: the assertion lists them
                failures.append(repr(exc))
    return failures


def test_fleet_target_forms() -> None:
    assert fleet_target("dns:///gw.example.net:50051") == "dns:///gw.example.net:50051"
    assert fleet_target(["10.0.0.1:1", "10.0.0.2:2"]) == "ipv4:10.0.0.1:1,10.0.0.2:2"
    assert fleet_target("[::1]:5,[fe80::1]:6") == "ipv6:[::1]:5,[fe80::1]:6"
    assert fleet_target(["localhost:7"]).endswith(":7")
    for bad, message in [
        ([], "no gateway address"),
        (["10.0.0.1"], "expected HOST:PORT"),
        (["10.0.0.1:1", "[::1]:2"], "mix IPv4 and IPv6"),
    ]:
        with pytest.raises(ValueError, match=message):
            fleet_target(bad)


async def test_a_draining_gateway_gets_no_new_requests(fleet: list[Stack]) -> None:
    a, b = fleet
    addresses = [a.address, b.address]
    assert await send(addresses, 8) == []
    await asyncio.to_thread(  # round-robin over both
        until,
        lambda: answered(a) > 0 and answered(b) > 0,
        "timed out waiting for both gateways' access lines",
    )

    os.kill(a.gateway_pid, signal.SIGUSR1)
    await asyncio.to_thread(
        until, lambda: health(a.address) == 1, "timed out waiting for a's health NOT_SERVING"
    )
    assert health(b.address) == 0
    before_a, before_b = answered(a), answered(b)
    assert await send(addresses, 8) == []
    await asyncio.to_thread(
        until, lambda: answered(b) == before_b + 8, "timed out waiting for b's access lines"
    )
    assert answered(a) == before_a

    # A client that ignores health still gets answers from the draining gateway.
    channel, stub = connect(a.address)
    async with channel:
        request = pb.GenerateRequest(model=MODEL, prompt="direct", max_tokens=2)
        reply = await generate(stub, request, timeout=30)
    assert reply.final.finish_reason == pb.FINISH_REASON_LENGTH
    await asyncio.to_thread(
        until,
        lambda: any(" drained: " in line for line in a.log_lines()),
        "timed out waiting for drained",
    )


async def test_quiesce_holds_not_serving_and_says_when_drained(
    tiny: Tiny, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process: the readiness polls do not bring SERVING back, and the status line follows the
    requests in flight until none has been for the quiet time."""
    config = gateway_config(
        tiny.tokenizer_dir,
        {MODEL: engine.address},
        cache=CacheConfig(enabled=False),
    )
    running = await start_server(config, await load_models(config))
    lines: list[str] = []

    def notify(*fields: str) -> bool:  # what systemd would receive
        lines.extend(fields)
        return True

    monkeypatch.setattr(sdnotify, "notify", notify)
    in_flight = {MODEL: 1}
    task = asyncio.ensure_future(quiesce_module.quiesce(running.monitor, in_flight, quiet_s=0.05))
    try:
        await until_async(
            lambda: "STATUS=draining: 1 requests in flight, health NOT_SERVING" in lines,
            lambda: f"never said draining; said {lines}",
        )
        await running.monitor.check()  # a readiness round: the engine is fine
        for name in ("", SERVICE_NAME, health_name(SERVICE_NAME, MODEL)):
            reply = await running.health.Check(health_pb2.HealthCheckRequest(service=name), None)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING, name
        in_flight[MODEL] = 0
        await until_async(
            lambda: any(line.startswith("STATUS=drained: ") for line in lines),
            lambda: f"never said drained; said {lines}",
        )
    finally:
        task.cancel()
        await running.drain(0.2)
