"""Every request the HTTP API answers with an error is one access line and one count in
appliance_requests_total, whatever refused it (the Host check, a missing key, no such route, the
HTTP parser), with its status name, model `unknown` and none of the client's bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from appliance.gateway.report import UNKNOWN_MODEL, RequestReport
from appliance.gateway.server import RunningGateway
from appliance.security.secretfile import write_secret
from tests.conftest import Engine, Tiny
from tests.gateway.test_http_api import _config, _gateway, _url
from tests.security.conftest import Keys

REQUESTS = "appliance_requests_total"
SECRET = "s3cret"
BODY = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()


async def _logged(tiny: Tiny, engine: Engine, keys: Keys | None) -> RunningGateway:
    config = _config(tiny, engine.address, auth=keys.auth() if keys is not None else None)
    server = dataclasses.replace(config.server, access_log=True)
    return await _gateway(dataclasses.replace(config, server=server))


@pytest.fixture
async def anonymous(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    """Without keys, on loopback: the Host check applies."""
    running = await _logged(tiny, engine, None)
    yield running
    await running.drain(0.5)


@pytest.fixture
async def keyed(tiny: Tiny, engine: Engine, tmp_path: Path) -> AsyncIterator[RunningGateway]:
    pepper = tmp_path / "pepper"
    write_secret(pepper)
    keys = Keys(tmp_path / "keys.json", pepper)
    keys.add(["default"], ["generate"])
    running = await _logged(tiny, engine, keys)
    yield running
    await running.drain(0.5)


def _http_reports(caplog: pytest.LogCaptureFixture) -> list[RequestReport]:
    reports = [getattr(r, "access", None) for r in caplog.records]
    return [r for r in reports if isinstance(r, RequestReport) and r.front_end == "http"]


def _counted(running: RunningGateway) -> dict[str, float]:
    """appliance_requests_total of the HTTP front end by status; model `unknown` only."""
    counts: dict[str, float] = {}
    for family in running.metrics.registry.collect():
        for sample in family.samples:
            labels = sample.labels
            if sample.name != REQUESTS or labels.get("front_end") != "http":
                continue
            assert labels["model"] == UNKNOWN_MODEL, labels
            counts[labels["status"]] = counts.get(labels["status"], 0.0) + sample.value
    return counts


async def _send(
    running: RunningGateway, method: str, path: str, headers: dict[str, str], body: bytes | None
) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, _url(running) + path, data=body, headers=headers) as r,
    ):
        assert "error" in await r.json()
        return r.status


def _assert_logged_and_counted(
    running: RunningGateway,
    caplog: pytest.LogCaptureFixture,
    expected: list[str],
) -> None:
    reports = _http_reports(caplog)
    assert sorted(r.status for r in reports) == sorted(expected)
    assert all(r.model == UNKNOWN_MODEL for r in reports)
    wanted: dict[str, float] = {}
    for status in expected:
        wanted[status] = wanted.get(status, 0.0) + 1.0
    assert _counted(running) == wanted
    lines = [r.getMessage() for r in caplog.records if r.name == "appliance.access"]
    assert len(lines) == len(expected)
    assert not any(SECRET in line or "evil" in line for line in lines), lines


async def test_each_refusal_before_a_model_is_one_access_line_and_one_count(
    anonymous: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="appliance.access")
    port = anonymous.http.port if anonymous.http is not None else 0
    local = {"Host": f"127.0.0.1:{port}"}
    rebound, cross = {"Host": "evil.example"}, {"Origin": "http://evil.example"}
    denied = "PERMISSION_DENIED"
    cases: list[tuple[str, str, dict[str, str], bytes | None, int, str]] = [
        ("POST", "/v1/completions", rebound, BODY, 403, denied),
        ("GET", "/v1/models", rebound, None, 403, denied),
        ("GET", "/health", rebound, None, 403, denied),
        ("POST", "/v1/completions", cross, BODY, 403, denied),
        ("POST", "/v1/completions", local, b"{" + SECRET.encode(), 400, "INVALID_ARGUMENT"),
        ("POST", "/v1/completions", local, b"x" * 100_000, 413, "RESOURCE_EXHAUSTED"),
        ("POST", f"/v1/{SECRET}", local, b"{}", 404, "NOT_FOUND"),
        ("GET", f"/v1/models/{SECRET}", local, None, 404, "NOT_FOUND"),
        ("GET", "/v1/completions", local, None, 405, "UNIMPLEMENTED"),
    ]
    for method, path, headers, body, status, _ in cases:
        assert await _send(anonymous, method, path, headers, body) == status, path
    # A request the HTTP parser refuses before any route: its bytes are never logged.
    assert anonymous.http is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", anonymous.http.port)
    writer.write(f"{SECRET} /v1/completions HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert b" 400 " in answer.split(b"\r\n")[0]
    # A probe's own answer refuses nothing: neither a line nor a count.
    async with (
        aiohttp.ClientSession() as session,
        session.get(_url(anonymous) + f"/health?model={SECRET}", headers=local) as r,
    ):
        assert r.status == 404
    expected = [case[-1] for case in cases] + ["INVALID_ARGUMENT"]
    _assert_logged_and_counted(anonymous, caplog, expected)


async def test_a_request_without_a_valid_key_is_one_access_line_on_every_route(
    keyed: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="appliance.access")
    forged = {"Authorization": f"Bearer ak_000000000000_{SECRET}"}
    cases: list[tuple[str, str, dict[str, str], bytes | None]] = [
        ("GET", "/v1/models", {}, None),
        ("GET", "/v1/models", forged, None),
        ("GET", "/v1/models/tiny", {}, None),
        ("POST", "/v1/completions", forged, BODY),
    ]
    for method, path, headers, body in cases:
        assert await _send(keyed, method, path, headers, body) == 401, (path, headers)
    _assert_logged_and_counted(keyed, caplog, ["UNAUTHENTICATED"] * len(cases))
    assert all(r.key_id == "" for r in _http_reports(caplog))


async def test_a_request_the_drain_refuses_is_one_access_line(
    anonymous: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="appliance.access")
    assert anonymous.http is not None
    anonymous.http.draining = True  # what close() sets first, before its grace
    assert await _send(anonymous, "POST", "/v1/completions", {}, BODY) == 503
    _assert_logged_and_counted(anonymous, caplog, ["UNAVAILABLE"])


async def test_an_expectation_the_server_does_not_meet_is_one_access_line_without_its_bytes(
    anonymous: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """`Expect` other than 100-continue: 417 in OpenAI's shape, its value not echoed, and one
    access line and count, on a route that reads a body and on one that does not."""
    caplog.set_level(logging.INFO, logger="appliance.access")
    assert anonymous.http is not None
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
        reader, writer = await asyncio.open_connection("127.0.0.1", anonymous.http.port)
        writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nExpect: {SECRET}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + BODY
        )
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b" 417 " in head.split(b"\r\n")[0], answer
        assert SECRET.encode() not in answer
        assert "error" in json.loads(body)
    _assert_logged_and_counted(anonymous, caplog, ["INVALID_ARGUMENT"] * 2)
