"""The HTTP API against clients that hold connections (many idle ones, a head sent a byte at a
time) and against web pages of another origin; the SDK's own requests pass unchanged."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from appliance.config import AuthConfig
from appliance.gateway.server import RunningGateway
from appliance.security.tls import TlsSettings
from tests.conftest import Engine, Tiny
from tests.gateway.test_http_api import _client, _config, _gateway, _url, gateway  # noqa: F401
from tests.security.certs import CA
from tests.support import until_async

REFUSED_METRIC = "appliance_http_connections_refused_total"
REFUSED_REQUESTS = "appliance_http_requests_refused_total"


def _refused_requests(running: RunningGateway, reason: str) -> float | None:
    return running.metrics.registry.get_sample_value(REFUSED_REQUESTS, {"reason": reason})


def _refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "appliance.gateway.http_api" and "refused" in r.getMessage()
    ]


@pytest.fixture
async def limited(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    """A gateway whose HTTP API holds 3 connections and cuts off a silent one after 0.5 s."""
    config = _config(tiny, engine.address)
    http = dataclasses.replace(config.http, max_connections=3, client_timeout_s=0.5)
    running = await _gateway(dataclasses.replace(config, http=http))
    yield running
    await running.drain(0.5)


def _open(running: RunningGateway) -> int:
    assert running.http is not None
    return running.http.connections


async def test_connections_over_the_limit_are_refused_at_accept(limited: RunningGateway) -> None:
    assert limited.http is not None
    port = limited.http.port
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    await until_async(lambda: _open(limited) == 3)
    # One more: answered 503 with a retry hint and closed, before it sends a byte.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    assert b"\r\nRetry-After: 1\r\n" in head + b"\r\n"
    assert b"\r\nConnection: close\r\n" in head + b"\r\n"
    error = json.loads(body)["error"]
    assert "max_connections" in error["message"]
    assert error["type"] == "service_unavailable_error"
    # The SDK reads that answer (its request is read and dropped, not reset) and would retry.
    async with _client(limited) as client:
        with pytest.raises(openai.InternalServerError) as refused:
            await client.completions.create(model="tiny", prompt="hi" * 10_000, max_tokens=2)
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after-ms"] == "1000"
    assert limited.metrics.registry.get_sample_value(REFUSED_METRIC) == 2.0
    assert _open(limited) == 3
    # Slots come back as connections close: the SDK is answered again.
    for _, held_writer in held:
        held_writer.close()
    await until_async(lambda: _open(limited) == 0)
    async with _client(limited) as client:
        reply = await client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert reply.choices[0].text is not None


async def test_connections_accepted_at_once_are_bounded_too(limited: RunningGateway) -> None:
    """Connections the listener accepts in one pass of the event loop: each is counted as it is
    accepted, not when aiohttp first sees it."""
    assert limited.http is not None
    port = limited.http.port
    opened = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(20)))
    # Refused ones are answered at once; held ones, silent, are closed after client_timeout_s.
    answers = await asyncio.gather(*(asyncio.wait_for(r.read(), 10) for r, _ in opened))
    for _, writer in opened:
        writer.close()
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 503 ")]
    assert (len(refused), answers.count(b"")) == (17, 3), answers
    assert limited.metrics.registry.get_sample_value(REFUSED_METRIC) == 17.0
    await until_async(lambda: _open(limited) == 0)


@pytest.fixture
async def limited_tls(
    tiny: Tiny, engine: Engine, tmp_path: Path
) -> AsyncIterator[tuple[RunningGateway, ssl.SSLContext]]:
    """A gateway whose HTTP API, over TLS, holds 3 connections; and a client's TLS context."""
    ca = CA(tmp_path, "test-ca")
    cert = ca.issue("server", "gateway")
    config = _config(tiny, engine.address, tls=TlsSettings(cert.cert, cert.key))
    http = dataclasses.replace(config.http, max_connections=3, client_timeout_s=30.0)
    running = await _gateway(dataclasses.replace(config, http=http))
    yield running, ssl.create_default_context(cadata=ca.pem.decode())
    await running.drain(0.5)


async def test_tls_connections_count_from_their_accept(
    limited_tls: tuple[RunningGateway, ssl.SSLContext],
) -> None:
    """A TLS connection holds its place from its accept, through its handshake: clients that
    never begin one are refused past max_connections, and their places come back."""
    running, context = limited_tls
    assert running.http is not None
    port = running.http.port
    silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    await until_async(lambda: _open(running) == 3)
    # One more is refused: the SDK reads the 503 and its retry hint (no reset).
    base = f"https://localhost:{port}/v1"
    http_client = openai.DefaultAsyncHttpxClient(verify=context)
    async with AsyncOpenAI(
        base_url=base, api_key="k", max_retries=0, http_client=http_client
    ) as client:
        for _ in range(3):
            with pytest.raises(openai.InternalServerError) as refused:
                await client.completions.create(model="tiny", prompt="hi" * 10_000, max_tokens=2)
            assert refused.value.status_code == 503
            assert refused.value.response.headers["retry-after-ms"] == "1000"
        # A handshake that fails (plaintext sent to the TLS port) gives its place back, and so
        # do handshakes the clients leave.
        _, plain = silent.pop()
        plain.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        await until_async(lambda: _open(running) == 2)
        for _, writer in silent:
            writer.close()
        await until_async(lambda: _open(running) == 0)
        reply = await client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert reply.choices[0].text is not None
    assert running.metrics.registry.get_sample_value(REFUSED_METRIC) == 3.0


async def test_a_head_sent_a_byte_at_a_time_is_cut_off(limited: RunningGateway) -> None:
    assert limited.http is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", limited.http.port)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"a" * 10_000
    closed = asyncio.ensure_future(reader.read())
    sent = 0
    while not closed.done() and sent < len(head):
        writer.write(head[sent : sent + 1])
        sent += 1
        await asyncio.wait([closed], timeout=0.02)  # one byte each 20 ms: 200 s for the head
    assert closed.done() and await closed == b"", f"still open after {sent} bytes"
    writer.close()
    await until_async(lambda: _open(limited) == 0)


async def test_an_idle_keep_alive_connection_is_closed(limited: RunningGateway) -> None:
    assert limited.http is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", limited.http.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 ") and b"Connection: close" not in head
    # The connection is kept for a next request, then closed when none comes.
    assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"}")
    assert reader.at_eof()
    writer.close()


# -- cross-origin requests ---------------------------------------------------------------------

SAME_HOST = "same-host"  # stands for the gateway's own origin, http://127.0.0.1:PORT


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Sec-Fetch-Site": "cross-site"}, 403),
        ({"Sec-Fetch-Site": "same-site"}, 403),
        ({"Sec-Fetch-Site": "cross-site", "Origin": SAME_HOST}, 403),
        ({"Origin": "https://evil.example"}, 403),  # a browser without Sec-Fetch-Site
        ({"Origin": "null"}, 403),  # a sandboxed frame, a data: URL
        ({"Origin": "http://[::1"}, 403),  # no URL at all
        ({"Sec-Fetch-Site": "same-origin"}, 200),
        ({"Sec-Fetch-Site": "none"}, 200),  # typed into the address bar
        ({"Origin": SAME_HOST}, 200),
        ({}, 200),  # no browser: curl, the SDKs
    ],
)
async def test_a_cross_origin_post_is_403(
    gateway: RunningGateway,  # noqa: F811
    headers: dict[str, str],
    status: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="appliance.gateway.http_api")
    url = _url(gateway)
    headers = {k: url if v == SAME_HOST else v for k, v in headers.items()}
    # No Content-Type: what a page's fetch() of a Blob body sends (form and text types are 415).
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    async with (
        aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as session,
        session.post(url + "/v1/completions", data=body, headers=headers) as r,
    ):
        reply = await r.json()
    assert r.status == status, reply
    # Counted by reason, and one line without the client's header values.
    assert _refused_requests(gateway, "cross_origin") == (1.0 if status == 403 else 0.0)
    assert _refused_requests(gateway, "host") == 0.0
    lines = _refusal_lines(caplog)
    assert len(lines) == (1 if status == 403 else 0), lines
    for line in lines:
        assert "cross-origin" in line and "127.0.0.1" in line, line
        assert not any(value in line for value in headers.values()), line
    if status == 403:
        error = reply["error"]
        assert error["type"] == "permission_denied_error"
        assert error["code"] == "cross_origin_request"
        assert "from a server" in error["message"]
        # Reading is no risk: a page cannot see the answer without CORS.
        async with (
            aiohttp.ClientSession() as session,
            session.get(url + "/v1/models", headers=headers) as r,
        ):
            assert r.status == 200


async def test_the_sdk_passes_the_cross_origin_check(
    gateway: RunningGateway,  # noqa: F811
) -> None:
    async with AsyncOpenAI(base_url=_url(gateway) + "/v1", api_key="k", max_retries=0) as client:
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        stream = await client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, stream=True
        )
        chunks = [chunk async for chunk in stream]
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chunks


# -- DNS rebinding -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("evil.example:{port}", 403),  # a page's name, rebound to 127.0.0.1
        ("evil.example", 403),
        ("localhost.evil.example:{port}", 403),
        ("127.0.0.1.evil.example", 403),
        ("10.0.0.1:{port}", 403),
        ("", 403),
        ("127.0.0.1:{port}", 200),
        ("127.9.8.7", 200),
        ("localhost:{port}", 200),
        ("localhost.:{port}", 200),
        ("localhost..", 403),
        (".", 403),
        ("LocalHost", 200),
        ("[::1]:{port}", 200),
        ("[::1]", 200),
    ],
)
async def test_an_anonymous_gateway_answers_loopback_host_names_only(
    gateway: RunningGateway,  # noqa: F811
    host: str,
    status: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without API keys a request is answered only when its Host is a loopback name: a web page
    whose name is rebound to 127.0.0.1 is of the same origin for the browser and would read it.
    Each refusal is counted; the log says so at most once an interval, without the Host."""
    caplog.set_level(logging.WARNING, logger="appliance.gateway.http_api")
    assert gateway.http is not None
    headers = {"Host": host.format(port=gateway.http.port)}
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    async with aiohttp.ClientSession() as session:
        for method, path, data in (("GET", "/v1/models", None), ("POST", "/v1/completions", body)):
            async with session.request(
                method, _url(gateway) + path, data=data, headers=headers
            ) as r:
                reply = await r.json()
            assert r.status == status, (path, reply)
            if status == 403:
                error = reply["error"]
                assert error["type"] == "permission_denied_error"
                assert error["code"] == "host_not_loopback"
                assert "API keys" in error["message"] and "127.0.0.1" in error["message"]
    assert _refused_requests(gateway, "host") == (2.0 if status == 403 else 0.0)
    assert _refused_requests(gateway, "cross_origin") == 0.0
    lines = _refusal_lines(caplog)
    assert len(lines) == (1 if status == 403 else 0), lines  # two refusals, one line
    for line in lines:
        assert "Host" in line and "evil" not in line and "10.0.0.1" not in line, line


async def test_anonymous_on_a_non_loopback_address_answers_any_host_name(
    tiny: Tiny, engine: Engine
) -> None:
    """On a non-loopback address without keys (`allow_anonymous`: anyone who reaches it may use
    it, by whatever name) no Host is refused."""
    config = _config(tiny, engine.address)
    http = dataclasses.replace(config.http, listen="0.0.0.0:0")
    auth = AuthConfig(allow_anonymous=True)
    running = await _gateway(dataclasses.replace(config, http=http, auth=auth))
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(_url(running) + "/v1/models", headers={"Host": "evil.example"}) as r,
        ):
            assert r.status == 200
    finally:
        await running.drain(0.5)
