"""The HTTP listener's TLS context across a reload: a client CA taken out of `client_ca_file` is
refused from the next handshake on, and ALPN offers only what the HTTP server speaks."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import pytest

from appliance.config import HttpConfig
from appliance.logline import Throttled
from appliance.security import tls as tls_module
from appliance.security.tls import ServerTls, TlsSettings
from tests.conftest import Engine, Tiny
from tests.security.certs import CA, Issued
from tests.security.conftest import running
from tests.support import gateway_config


@asynccontextmanager
async def tls_server(tls: ServerTls) -> AsyncIterator[int]:
    """An asyncio TLS server on the listener's context that answers each connection b"ok"."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"ok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=tls.ssl_context())
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def client_context(ca: CA, client: Issued | None, alpn: list[str] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=ca.pem.decode())
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    if alpn:
        context.set_alpn_protocols(alpn)
    return context


async def handshake(port: int, context: ssl.SSLContext) -> tuple[bytes, str | None]:
    """What the server sends after the handshake (b"" when it refused the client's certificate,
    which TLS 1.3 reports only at the first read) and the negotiated ALPN protocol."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="localhost"
    )
    try:
        data = await reader.read(2)
    except (ssl.SSLError, ConnectionResetError):
        data = b""
    obj = writer.get_extra_info("ssl_object")
    protocol = obj.selected_alpn_protocol() if obj is not None else None
    writer.close()
    with suppress(ssl.SSLError, ConnectionResetError):
        await writer.wait_closed()
    return data, protocol


def replace(path: Path, data: bytes) -> None:
    """As an operator renews a file: write beside it, rename over it."""
    new = path.with_suffix(".new")
    new.write_bytes(data)
    os.replace(new, path)


async def test_a_client_ca_removed_on_reload_is_refused_over_https(tmp_path: Path) -> None:
    old_ca, new_ca = CA(tmp_path, "old-ca"), CA(tmp_path, "new-ca")
    server_cert = old_ca.issue("server", "gateway")
    old_client = old_ca.issue("old-client", "client-old", client=True)
    new_client = new_ca.issue("new-client", "client-new", client=True)
    client_ca_file = tmp_path / "client-ca.pem"
    client_ca_file.write_bytes(old_ca.pem)
    tls = ServerTls(TlsSettings(server_cert.cert, server_cert.key, client_ca_file=client_ca_file))

    async with tls_server(tls) as port:
        assert (await handshake(port, client_context(old_ca, old_client)))[0] == b"ok"
        assert (await handshake(port, client_context(old_ca, new_client)))[0] == b""

        replace(client_ca_file, new_ca.pem)
        assert tls.refresh()
        assert (await handshake(port, client_context(old_ca, old_client)))[0] == b""
        assert (await handshake(port, client_context(old_ca, new_client)))[0] == b"ok"
        assert (await handshake(port, client_context(old_ca, None)))[0] == b""


async def test_a_renewed_file_is_used_at_the_next_handshake_without_sighup(tmp_path: Path) -> None:
    old_ca, new_ca = CA(tmp_path, "old-ca"), CA(tmp_path, "new-ca")
    cert = old_ca.issue("server", "gateway")
    tls = ServerTls(TlsSettings(cert.cert, cert.key))
    async with tls_server(tls) as port:
        assert (await handshake(port, client_context(old_ca, None)))[0] == b"ok"
        renewed = new_ca.issue("server-renewed", "gateway")
        replace(cert.key, renewed.key_pem)
        replace(cert.cert, renewed.cert_pem)
        assert (await handshake(port, client_context(new_ca, None)))[0] == b"ok"
        with pytest.raises(ssl.SSLCertVerificationError):
            await handshake(port, client_context(old_ca, None))


async def test_https_offers_only_http_1_1_in_alpn(tmp_path: Path) -> None:
    ca = CA(tmp_path, "ca")
    cert = ca.issue("server", "gateway")
    tls = ServerTls(TlsSettings(cert.cert, cert.key))
    async with tls_server(tls) as port:
        data, protocol = await handshake(port, client_context(ca, None, ["h2", "http/1.1"]))
        assert (data, protocol) == (b"ok", "http/1.1")


async def test_a_tls_handshake_that_never_finishes_is_dropped_on_both_ports(
    tiny: Tiny, engine: Engine, tmp_path: Path
) -> None:
    """A client that connects and sends nothing is cut off after client_timeout_s (asyncio's
    default is 60 s, gRPC's 120 s)."""
    ca = CA(tmp_path, "ca")
    cert = ca.issue("server", "gateway")
    config = dataclasses.replace(
        gateway_config(tiny.tokenizer_dir, engine.address, tls=TlsSettings(cert.cert, cert.key)),
        http=HttpConfig(listen="127.0.0.1:0", client_timeout_s=1.0),
    )
    async with running(config) as gw:
        assert gw.http is not None
        for port in (gw.port, gw.http.port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            # EOF well before the library defaults; nothing was sent, so nothing comes back.
            assert await asyncio.wait_for(reader.read(), 20) == b""
            writer.close()


def test_a_pair_renewed_while_it_is_read_is_never_served_mismatched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The certificate renamed into place, the reload reads it and the old key, then the key is
    renamed into place before the pair is checked: the check passes on the files, so the bytes
    read (a new certificate with the old key, which gRPC serves) must not be taken."""
    ca = CA(tmp_path, "ca")
    old, new = ca.issue("old", "gateway"), ca.issue("new", "gateway")
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    replace(cert, old.cert_pem)
    replace(key, old.key_pem)
    tls = ServerTls(TlsSettings(cert, key))
    replace(cert, new.cert_pem)
    check = tls_module._check

    def key_renamed_meanwhile(settings: TlsSettings) -> ssl.SSLContext:
        if key.read_bytes() != new.key_pem:
            replace(key, new.key_pem)
        return check(settings)

    monkeypatch.setattr(tls_module, "_check", key_renamed_meanwhile)
    pairs = {(old.cert_pem, old.key_pem), (new.cert_pem, new.key_pem)}
    for _ in range(2):  # the second reload, if needed, reads the pair as it now is
        tls.refresh()
        material = tls._material  # what gRPC is handed
        assert (material.cert, material.key) in pairs
    assert (material.cert, material.key) == (new.cert_pem, new.key_pem)


def test_an_expired_certificate_is_said_and_never_replaces_a_valid_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tls_module, "_throttled", Throttled(tls_module.log))
    ca = CA(tmp_path, "ca")
    valid, expired = ca.issue("valid", "gateway"), ca.issue("expired", "gateway", expired=True)
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    replace(cert, valid.cert_pem)
    replace(key, valid.key_pem)
    tls = ServerTls(TlsSettings(cert, key))
    # A renewal that copied the wrong (expired) files: the valid certificate stays.
    replace(cert, expired.cert_pem)
    replace(key, expired.key_pem)
    with caplog.at_level(logging.WARNING, logger="appliance.security.tls"):
        assert not tls.refresh()
    assert tls._material.cert == valid.cert_pem
    assert any("expired" in r.getMessage() and str(cert) in r.getMessage() for r in caplog.records)
    # Served anyway when it is all there is, and said at start-up.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="appliance.security.tls"):
        started = ServerTls(TlsSettings(cert, key))
    assert started._material.cert == expired.cert_pem
    assert any("expired" in r.getMessage() and str(cert) in r.getMessage() for r in caplog.records)


def test_an_expired_renewal_is_read_once_not_at_every_handshake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each handshake asks whether the files changed; an expired pair refused once is not read,
    parsed and refused again at every handshake until the files change once more."""
    monkeypatch.setattr(tls_module, "_throttled", Throttled(tls_module.log))
    ca = CA(tmp_path, "ca")
    valid, expired = ca.issue("valid", "gateway"), ca.issue("expired", "gateway", expired=True)
    renewed = ca.issue("renewed", "gateway")
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    replace(cert, valid.cert_pem)
    replace(key, valid.key_pem)
    tls = ServerTls(TlsSettings(cert, key))
    replace(cert, expired.cert_pem)
    replace(key, expired.key_pem)
    loads = []
    load = tls_module._load

    def counted(settings: TlsSettings) -> object:
        loads.append(settings)
        return load(settings)

    monkeypatch.setattr(tls_module, "_load", counted)
    for _ in range(3):  # three handshakes
        assert not tls.refresh()
    assert len(loads) == 1
    assert tls._material.cert == valid.cert_pem
    replace(cert, renewed.cert_pem)
    replace(key, renewed.key_pem)
    assert tls.refresh()
    assert tls._material.cert == renewed.cert_pem
