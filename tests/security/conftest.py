"""A gateway in the test's event loop with TLS settings and a keys file of the test's making."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from appliance.config import AuthConfig, GatewayConfig
from appliance.gateway.models import load_models
from appliance.gateway.server import RunningGateway, start_server
from appliance.security.api_keys import RateLimits, new_key, write_entries
from appliance.security.secretfile import PEPPER_PURPOSE, read_secret, write_secret


@dataclasses.dataclass
class Keys:
    """A keys file and its pepper; `add` returns the new key's token."""

    path: Path
    pepper_file: Path
    entries: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def pepper(self) -> bytes:
        return read_secret(self.pepper_file, PEPPER_PURPOSE)

    def add(
        self,
        namespaces: list[str],
        scopes: list[str],
        identities: list[str] | None = None,
        limits: RateLimits | None = None,
    ) -> str:
        token, entry = new_key(self.pepper, namespaces, scopes, identities, limits)
        self.entries.append(entry)
        write_entries(self.path, self.entries)
        return token

    def auth(self, **kw: Any) -> AuthConfig:
        return AuthConfig(keys_file=self.path, pepper=self.pepper, **kw)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    pepper = tmp_path / "pepper"
    write_secret(pepper)
    k = Keys(tmp_path / "keys.json", pepper)
    write_entries(k.path, [])
    return k


@asynccontextmanager
async def running(config: GatewayConfig) -> AsyncIterator[RunningGateway]:
    gateway = await start_server(config, await load_models(config))
    try:
        yield gateway
    finally:
        await gateway.drain(0.2)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def tls_channel(
    port: int,
    ca: bytes,
    cert: bytes | None = None,
    key: bytes | None = None,
    host: str = "localhost",
) -> grpc.aio.Channel:
    credentials = grpc.ssl_channel_credentials(ca, key, cert)
    # A fresh channel never shares a connection (and so a handshake) with another one.
    return grpc.aio.secure_channel(
        f"{host}:{port}", credentials, options=[("grpc.use_local_subchannel_pool", 1)]
    )
