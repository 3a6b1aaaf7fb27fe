"""`[server] health_socket`: the health service alone on a Unix socket, for local checks of a
gateway whose public port takes only TLS (the Ansible role's wait for SERVING)."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from appliance.config import ConfigError, ServerConfig, load_config
from appliance.gateway.models import StartupError, load_models
from appliance.gateway.server import start_server
from appliance.security.tls import TlsSettings
from tests.conftest import Engine, Tiny
from tests.security.certs import CA
from tests.support import gateway_config


def _health_cli(socket: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance", "health", "--gateway", f"unix:{socket}"],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def _status(socket: Path) -> int:
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="appliance.v1.Inference"), timeout=5
        )
    return int(reply.status)


async def test_a_tls_gateway_answers_health_on_its_socket(
    tiny: Tiny, engine: Engine, tmp_path: Path
) -> None:
    issued = CA(tmp_path, "test-ca").issue("server", "gateway")
    socket = tmp_path / "health.sock"
    config = gateway_config(
        tiny.tokenizer_dir,
        engine.address,
        tls=TlsSettings(issued.cert, issued.key),
        server=dataclasses.replace(
            gateway_config(tiny.tokenizer_dir, engine.address).server, health_socket=socket
        ),
    )
    gateway = await start_server(config, await load_models(config))
    try:
        assert socket.is_socket()
        answered = await asyncio.to_thread(_health_cli, socket)
        assert (answered.returncode, answered.stdout.strip()) == (0, "SERVING"), answered.stderr
        # The public port takes TLS only: a plaintext check there gets no answer.
        with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as plain:
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(plain).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=2
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        # Another gateway given the same socket is refused before it binds anything.
        with pytest.raises(StartupError, match="another process serves it"):
            await start_server(config, await load_models(config))
        assert await _status(socket) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await gateway.drain(0.2)
    assert not socket.exists()


def test_health_socket_is_read_as_a_path_beside_the_file(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    config = tmp_path / "gateway.toml"
    body = (
        '[server]\nhealth_socket = "{}"\n\n[models.m]\nbackend = "127.0.0.1:8001"\n'
        f'tokenizer_dir = "{tokenizer}"\n'
    )
    config.write_text(body.format("run/health.sock"))
    assert load_config(config).server.health_socket == tmp_path / "run" / "health.sock"
    assert ServerConfig().health_socket is None
    config.write_text(body.format("/" + "x" * 200))
    with pytest.raises(ConfigError, match=r"health_socket.*longer than a Unix socket"):
        load_config(config)
