"""An HTTP client that stops reading a stream: the gateway cuts it off after client_timeout_s as it
would a client that disconnected (its request CANCELLED, the engine stopped, nothing counted
against the gateway), with one line that says so and nothing about a failed handler."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket

import pytest

from appliance.engine.runner import EngineStats
from appliance.gateway.models import load_models
from appliance.gateway.server import start_server
from tests.conftest import Engine, Tiny
from tests.gateway.test_http_api import _config
from tests.gateway.test_inprocess import RecordingSink
from tests.support import until_async, until_engine

# Greedy, to max_tokens, with 20 alternatives a token: far more than the sockets between the
# gateway and the client buffer.
BODY = {
    "model": "tiny",
    "prompt": "Tell me everything",
    "max_tokens": 1500,
    "temperature": 0,
    "stream": True,
    "logprobs": 20,
    "appliance": {"cache_policy": "bypass", "request_id": "unread"},
}


async def test_a_stream_nobody_reads_is_cut_off_as_a_disconnect(
    tiny: Tiny, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    stats: EngineStats = engine.stats()
    cancelled = stats.cancelled
    sink = RecordingSink()
    config = _config(tiny, engine.address)
    config = dataclasses.replace(
        config, http=dataclasses.replace(config.http, client_timeout_s=0.3)
    )
    running = await start_server(config, await load_models(config), sink)
    assert running.http is not None
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", running.http.port))
        _, writer = await asyncio.open_connection(sock=client)
        server = running.http._runner.server
        assert server is not None

        def accepted() -> bool:
            assert server is not None
            return bool(server.connections)

        await until_async(accepted, "the gateway never accepted the client")
        # The gateway's side of the connection buffers little too: its writes wait soon.
        for connection in server.connections:
            assert connection.transport is not None
            sock = connection.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        body = json.dumps(BODY).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        [report] = await sink.wait_for(1)
        writer.close()
    finally:
        await running.drain(0.5)
    assert (report.request_id, report.status) == ("unread", "CANCELLED")
    assert running.pipeline.in_flight == {"tiny": 0}
    await until_engine(stats, lambda: stats.cancelled > cancelled and stats.running is None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["HTTP client 127.0.0.1 read nothing for 0.3 s; disconnecting"]
