"""The OpenAI-compatible HTTP API applies the same keys, namespaces and scopes as the gRPC API."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from appliance.config import HttpConfig
from appliance.security.api_keys import RateLimits
from tests.conftest import Engine, Tiny
from tests.security.conftest import Keys, running
from tests.support import gateway_config, until_async


@contextlib.asynccontextmanager
async def _keyed_http(tiny: Tiny, engine: Engine, keys: Keys) -> AsyncIterator[str]:
    """A gateway with the test's keys and the HTTP API on a free port; its base URL."""
    config = dataclasses.replace(
        gateway_config(tiny.tokenizer_dir, engine.address, auth=keys.auth()),
        http=HttpConfig(listen="127.0.0.1:0"),
    )
    async with running(config) as gw:
        assert gw.http is not None
        yield f"http://127.0.0.1:{gw.http.port}"


async def test_http_requests_need_a_key_with_the_namespace_and_scope(
    tiny: Tiny, engine: Engine, keys: Keys
) -> None:
    token = keys.add(["team-a"], ["generate"])
    async with _keyed_http(tiny, engine, keys) as server:
        base = f"{server}/v1"

        def client(key: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)

        ask = dict(model="tiny", prompt="Who answers?", max_tokens=4, temperature=0)
        with pytest.raises(openai.AuthenticationError) as anonymous:
            await client("not-a-key").completions.create(**ask)  # type: ignore[call-overload]
        assert anonymous.value.status_code == 401
        with pytest.raises(openai.PermissionDeniedError):
            await client(token).completions.create(  # type: ignore[call-overload]
                **ask, extra_body={"appliance": {"namespace": "team-b"}}
            )
        with pytest.raises(openai.PermissionDeniedError):  # ONLY needs its own scope
            await client(token).completions.create(  # type: ignore[call-overload]
                **ask, extra_body={"appliance": {"cache_policy": "only"}}
            )
        answer = await client(token).completions.create(**ask)  # type: ignore[call-overload]
        assert answer.choices[0].finish_reason in ("stop", "length")


async def test_listing_models_needs_a_valid_key_and_health_does_not(
    tiny: Tiny, engine: Engine, keys: Keys
) -> None:
    token = keys.add(["team-a"], ["generate"])
    async with _keyed_http(tiny, engine, keys) as base, aiohttp.ClientSession() as session:
        for path in ("/v1/models", "/v1/models/tiny", "/v1/models/other"):
            for headers in ({}, {"Authorization": "Bearer not-a-key"}):
                async with session.get(base + path, headers=headers) as r:
                    assert r.status == 401, path
                    assert "tiny" not in await r.text()
        async with session.get(base + "/v1/models", headers=bearer_header(token)) as r:
            assert r.status == 200 and [m["id"] for m in (await r.json())["data"]] == ["tiny"]
        # A browser never sends a key on its own: with keys, any Host name is answered.
        foreign = {**bearer_header(token), "Host": "evil.example"}
        async with session.get(base + "/v1/models", headers=foreign) as r:
            assert r.status == 200
        async with session.get(base + "/health") as r:
            assert r.status == 200


async def test_a_generation_without_a_key_is_refused_before_its_body_is_read(
    tiny: Tiny, engine: Engine, keys: Keys
) -> None:
    token = keys.add(["team-a"], ["generate"])
    async with _keyed_http(tiny, engine, keys) as base, aiohttp.ClientSession() as session:
        url = f"{base}/v1/chat/completions"
        # A body that is not JSON, in an encoding not taken: 400 or 415 with a key, 401 without.
        for headers, status in (
            ({}, 401),
            ({"Authorization": "Bearer not-a-key"}, 401),
            (bearer_header(token), 415),
        ):
            sent = {**headers, "Content-Encoding": "br"}
            async with session.post(url, data=b"{not json", headers=sent) as r:
                assert r.status == status, await r.text()
                assert (await r.json())["error"]["type"] in (
                    "authentication_error",
                    "invalid_request_error",
                )


async def test_a_key_over_its_rates_or_without_a_generating_scope_is_refused_before_its_body(
    tiny: Tiny, engine: Engine, keys: Keys
) -> None:
    """Rates (requests/s, requests open at once) and whether the key may generate at all need no
    body: such a key is refused for that, and nothing it sent is read."""
    slow = keys.add(["team-a"], ["generate"], limits=RateLimits(rate_per_s=0.01, burst=1))
    one_stream = keys.add(["team-a"], ["generate"], limits=RateLimits(max_streams=1))
    admin = keys.add(["team-a"], ["admin"])
    async with _keyed_http(tiny, engine, keys) as base, aiohttp.ClientSession() as session:
        url = f"{base}/v1/chat/completions"
        unread = {"Content-Encoding": "br"}  # read, the body would be refused with a 415
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with session.post(url, json=ask, headers=bearer_header(slow)) as r:
            assert r.status == 200, await r.text()  # its burst
        async with session.post(
            url, data=b"{not json", headers={**bearer_header(slow), **unread}
        ) as r:
            assert r.status == 429, await r.text()
            assert "rate limit" in (await r.json())["error"]["message"]
            assert "Retry-After" in r.headers
        async with session.post(
            url, data=b"{not json", headers={**bearer_header(admin), **unread}
        ) as r:
            assert r.status == 403, await r.text()
        # One request open: a second is refused while the first waits for its body.
        _, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n"
            b"Authorization: Bearer " + one_stream.encode() + b"\r\n\r\n{"
        )
        await writer.drain()
        try:

            async def refused_while_open() -> bool:
                async with session.post(
                    url, data=b"{not json", headers={**bearer_header(one_stream), **unread}
                ) as r:
                    return r.status == 429

            await until_async(refused_while_open, "a second request was never refused", 10.0)
        finally:
            writer.close()


async def test_a_client_waiting_for_100_continue_is_not_asked_for_a_body_refused_unread(
    tiny: Tiny, engine: Engine, keys: Keys
) -> None:
    """A key over its rate, or without a scope to generate with, is refused before its body is
    read: a client that waits for 100 Continue gets the refusal instead, and sends no body."""
    slow = keys.add(["team-a"], ["generate"], limits=RateLimits(rate_per_s=0.01, burst=1))
    admin = keys.add(["team-a"], ["admin"])
    other = keys.add(["team-a"], ["generate"])
    async with _keyed_http(tiny, engine, keys) as base, aiohttp.ClientSession() as session:
        port = int(base.rsplit(":", 1)[1])
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 10\r\n"
            b"Expect: 100-continue\r\nAuthorization: Bearer "
        )

        async def status_line(token: str) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(head + token.encode() + b"\r\n\r\n")
                await writer.drain()
                return (await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)).rstrip()
            finally:
                writer.close()

        async with session.post(
            f"{base}/v1/chat/completions", json=ask, headers=bearer_header(slow)
        ) as r:
            assert r.status == 200, await r.text()  # its burst
        assert await status_line(slow) == b"HTTP/1.1 429 Too Many Requests"
        assert await status_line(admin) == b"HTTP/1.1 403 Forbidden"
        assert await status_line(other) == b"HTTP/1.1 100 Continue"


def bearer_header(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_an_authorization_header_that_is_not_utf8_is_unauthenticated(
    tiny: Tiny, engine: Engine, keys: Keys
) -> None:
    token = keys.add(["team-a"], ["generate"])
    async with _keyed_http(tiny, engine, keys) as base:
        port = int(base.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        bad = token[:16].encode() + b"\xff" * 43
        writer.write(
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Authorization: Bearer " + bad + b"\r\n\r\n"
        )
        await writer.drain()
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
        assert b"\xff" not in answer
