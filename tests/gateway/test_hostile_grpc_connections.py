"""The gRPC port against clients that hold connections (many idle ones, more than the limit) and
that flood one connection with resets or pings; clients that behave keep being answered."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from appliance.gateway.server import RunningGateway
from tests.conftest import Engine, Tiny
from tests.gateway.hostile_client import HTTP2_PREFACE, _frame
from tests.gateway.test_http_api import _config, _gateway

ROOT = Path(__file__).resolve().parents[2]
ENHANCE_YOUR_CALM = 0xB


async def _limited(tiny: Tiny, engine: Engine, idle_s: float) -> AsyncIterator[RunningGateway]:
    config = _config(tiny, engine.address)
    server = dataclasses.replace(config.server, max_connections=3, idle_connection_s=idle_s)
    running = await _gateway(dataclasses.replace(config, server=server))
    yield running
    await running.drain(0.5)


@pytest.fixture
async def limited(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    """A gateway whose gRPC port holds 3 connections and closes one idle for 0.5 s."""
    async for running in _limited(tiny, engine, 0.5):
        yield running


@pytest.fixture
async def capped(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    """A gateway whose gRPC port holds 3 connections, none closed for idling while a test runs
    (a slow runner must not free a slot before the test asks for one too many)."""
    async for running in _limited(tiny, engine, 300.0):
        yield running


async def _http2(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that sends the HTTP/2 preface and its SETTINGS, then nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(HTTP2_PREFACE + _frame(0x4, 0, 0, b""))
    await writer.drain()
    return reader, writer


async def _check(port: int) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    """The gateway's health over a new channel, which connects again while it is refused."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10, wait_for_ready=True
        )
    return reply.status


async def test_an_idle_connection_is_closed_with_goaway(limited: RunningGateway) -> None:
    reader, writer = await _http2(limited.port)
    # The server's SETTINGS, its ack, then GOAWAY "connection idle" and the close.
    received = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert b"connection idle" in received, received
    # A channel that sits idle is closed the same way and connects again for its next call.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{limited.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 10)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_connections_over_the_limit_are_closed_at_accept(
    capped: RunningGateway,
) -> None:
    held = [await _http2(capped.port) for _ in range(3)]
    # Each held connection has had its SETTINGS answered: all three are the server's.
    for reader, _ in held:
        assert await asyncio.wait_for(reader.read(9), 10)
    reader, writer = await asyncio.open_connection("127.0.0.1", capped.port)
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    # Slots come back as connections close.
    for _, held_writer in held:
        held_writer.close()
    status = await _check(capped.port)
    assert status == health_pb2.HealthCheckResponse.SERVING


async def _flooder(kind: str, port: int) -> asyncio.subprocess.Process:
    settings = json.dumps({"flood": kind, "grpc": f"127.0.0.1:{port}"})
    flooder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.gateway.hostile_client",
        settings,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert flooder.stdout is not None
    assert await asyncio.wait_for(flooder.stdout.readline(), 30) == b"flooding\n"
    return flooder


async def _result(flooder: asyncio.subprocess.Process, stop: bool = True) -> dict[str, object]:
    """What the flooder printed once it ended: on its own (the server closed its connection), or
    when `stop` closes its stdin."""
    assert flooder.stdin is not None and flooder.stdout is not None
    if stop:
        flooder.stdin.close()
    out = await asyncio.wait_for(flooder.stdout.read(), 30)
    await flooder.wait()
    result: dict[str, object] = json.loads(out.splitlines()[-1])
    return result


async def test_a_rapid_reset_flood_leaves_other_clients_answered(
    tiny: Tiny, engine: Engine
) -> None:
    running = await _gateway(_config(tiny, engine.address))
    try:
        flooder = await _flooder("reset", running.port)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            # Every check is answered, whether the flood still runs or the server ended it.
            for _ in range(30):
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        result = await _result(flooder)
        assert isinstance(result["sent"], int) and result["sent"] > 0, result
    finally:
        await running.drain(0.5)


async def test_a_ping_flood_is_sent_goaway(limited: RunningGateway) -> None:
    flooder = await _flooder("ping", limited.port)
    assert flooder.stdout is not None
    # gRPC's own limit: GOAWAY ENHANCE_YOUR_CALM "too_many_pings", after which the server reads
    # nothing more from the connection. The GOAWAY is read, or lost when the server's close of a
    # connection with pings unread resets it.
    line = await asyncio.wait_for(flooder.stdout.readline(), 30)
    if line.startswith(b"goaway "):
        assert int(line.split()[1]) == ENHANCE_YOUR_CALM
        await _result(flooder)
    else:
        assert json.loads(line)["closed"] is True, line
        await flooder.wait()
    assert await _check(limited.port) == health_pb2.HealthCheckResponse.SERVING
