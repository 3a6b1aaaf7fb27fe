"""Two gateways as one fleet (real engine server and gateway processes): a client channel from
`connect_fleet` balances over both, stops sending to a gateway told to drain (SIGUSR1: health
NOT_SERVING, requests still answered) and to one that stopped, and no request fails."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from appliance.client import connect, connect_fleet, fleet_target, generate
from appliance.v1 import inference_pb2 as pb
from tests.conftest import Tiny, copy_repository
from tests.gateway.stack import MODEL, Stack, engine_and_gateway


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


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


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
    assert answered(a) > 0 and answered(b) > 0  # round-robin over both

    os.kill(a.gateway_pid, signal.SIGUSR1)
    await asyncio.to_thread(wait_for, "a's health NOT_SERVING", lambda: health(a.address) == 1)
    assert health(b.address) == 0
    before_a, before_b = answered(a), answered(b)
    assert await send(addresses, 8) == []
    await asyncio.to_thread(wait_for, "b's access lines", lambda: answered(b) == before_b + 8)
    assert answered(a) == before_a

    # A client that ignores health still gets answers from the draining gateway.
    channel, stub = connect(a.address)
    async with channel:
        request = pb.GenerateRequest(model=MODEL, prompt="direct", max_tokens=2)
        reply = await generate(stub, request, timeout=30)
    assert reply.final.finish_reason == pb.FINISH_REASON_LENGTH
    await asyncio.to_thread(
        wait_for, "drained", lambda: any(" drained: " in line for line in a.log_lines())
    )
