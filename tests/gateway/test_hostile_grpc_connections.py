"""The gRPC port against clients that hold connections (many idle ones, more than the limit) and
that flood one connection with resets or pings; clients that behave keep being answered."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import struct
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from appliance.gateway.server import RunningGateway
from appliance.grpc_limits import MAX_REQUEST_BYTES
from tests.conftest import Engine, Tiny
from tests.gateway.hostile_client import HTTP2_PREFACE, _frame, _literal
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


REFUSED_STREAM = 0x7


async def _frames(reader: asyncio.StreamReader) -> AsyncIterator[tuple[int, int, bytes]]:
    """The server's frames as (type, stream id, payload), until it closes the connection."""
    while header := await asyncio.wait_for(reader.read(9), 10):
        header += await asyncio.wait_for(reader.readexactly(9 - len(header)), 10)
        length, kind = int.from_bytes(header[:3], "big"), header[3]
        stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
        yield kind, stream, await asyncio.wait_for(reader.readexactly(length), 10)


async def test_streams_on_one_connection_are_bounded(tiny: Tiny, engine: Engine) -> None:
    """Each open stream may hold up to 4 MiB of what its client sent (the stream window gRPC's
    core announces): the streams one connection may hold open bound what it makes the gateway
    buffer (without keys, in any call; with keys, a client without one in health Watch calls),
    and the bound leaves room for a key's default 32 calls at once and `appliance bench` at
    concurrency 64 over one channel."""
    running = await _gateway(_config(tiny, engine.address))
    try:
        await _bounded_streams(running.port)
    finally:
        await running.drain(0.5)


async def _bounded_streams(port: int) -> None:
    reader, writer = await _http2(port)
    frames = _frames(reader)
    announced = None
    async for kind, _, payload in frames:
        if kind == 0x4 and payload:  # the server's SETTINGS (not the ack of ours)
            fields = dict(
                struct.unpack(">HI", payload[i : i + 6]) for i in range(0, len(payload), 6)
            )
            announced = fields.get(0x3)  # SETTINGS_MAX_CONCURRENT_STREAMS
            break
    assert announced is not None and announced >= 64
    assert announced * MAX_REQUEST_BYTES <= 512 * 2**20, announced
    # One stream more than announced, each a call whose message never comes: the one past the
    # bound is reset, the others stay open.
    headers = b"".join(
        [
            b"\x83\x86",  # :method POST, :scheme http
            _literal(b":path", b"/appliance.v1.Inference/Complete"),
            _literal(b":authority", b"localhost"),
            _literal(b"content-type", b"application/grpc"),
            _literal(b"te", b"trailers"),
        ]
    )
    last = 1 + 2 * announced
    writer.write(b"".join(_frame(0x1, 0x4, s, headers) for s in range(1, last + 1, 2)))
    await writer.drain()
    refused = []
    async for kind, stream, payload in frames:
        if kind == 0x3:  # RST_STREAM
            refused.append((stream, struct.unpack(">I", payload)[0]))
            if stream == last:
                break
    writer.close()
    # gRPC 1.85 resets it ENHANCE_YOUR_CALM; REFUSED_STREAM is HTTP/2's own code for it.
    assert [stream for stream, _ in refused] == [last], refused
    assert refused[0][1] in (REFUSED_STREAM, ENHANCE_YOUR_CALM), refused
