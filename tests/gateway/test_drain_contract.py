"""SIGTERM's drain, against real engine server and gateway processes: every stream the gateway
accepted ends with a final message that counts what it delivered, or, if it never started, with a
clean refusal that carries a retry hint before any text; the gateway exits 0 and logs no stray task
failure.

The gateway has one slot and a drain of one second: the stream that holds the slot is still
generating when the grace ends, and the streams queued behind it have not started then. Their
1500 tokens each take longer than any slack the gateway may add after the grace, so a queued stream
the gateway started after the grace would still be generating when that slack ended too.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from appliance.tools import processes
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Tiny
from tests.gateway.stack import MODEL, Stack, engine_and_gateway
from tests.support import until_async

LONG_TOKENS = 1500
QUEUED = 3
# Statuses a stream that never started may be refused with during a drain.
REFUSALS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class Ports:
    def __init__(self) -> None:
        self.metrics = processes.free_port()
        self.http = processes.free_port()

    def edit(self, text: str) -> str:
        text = text.replace("drain_seconds = 5.0", "drain_seconds = 1.0")
        text = text.replace("max_output_tokens = 512", "max_output_tokens = 2000")
        return (
            text.replace("ready_timeout_s", "max_in_flight = 1\nready_timeout_s", 1)
            + f'\n[metrics]\nlisten = "127.0.0.1:{self.metrics}"\n'
            + f'\n[http]\nlisten = "127.0.0.1:{self.http}"\n'
        )


@pytest.fixture(params=["grpc", "stream socket"])
def stack(
    tiny: Tiny, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Stack, Ports]]:
    """The gateway reaches the engine over gRPC, or over the engine's stream socket."""
    ports = Ports()
    over_socket = request.param == "stream socket"
    with engine_and_gateway(tiny, tmp_path, ports.edit, stream_socket=over_socket) as s:
        yield s, ports
    # The gateway has exited (teardown checked its status): its whole log is there.
    lines = s.log_lines()
    assert not [
        line
        for line in lines
        if "never retrieved" in line or line.startswith("Traceback") or " ERROR " in line
    ], "\n".join(lines[-60:])


def gauge(ports: Ports, name: str) -> float:
    """One of the gateway's per-model gauges, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{ports.metrics}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(f'{name}{{model="{MODEL}"}}'):
                return float(line.split()[-1])
    return 0.0


async def until_gauge(ports: Ports, name: str, at_least: int = 1) -> None:
    async def reached() -> bool:
        return await asyncio.to_thread(gauge, ports, name) >= at_least

    await until_async(reached, f"{name} never reached {at_least}", interval=0.05)


def long_request(prompt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model=MODEL,
        prompt=prompt,
        max_tokens=LONG_TOKENS,
        temperature=0.0,
        cache_policy=pb.CACHE_POLICY_BYPASS,
    )


class GrpcStream:
    """What a client saw of one Generate: token ids, the final message, or the error and trailers."""

    def __init__(self, call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]):
        self.call = call
        self.tokens = 0
        self.final: pb.Final | None = None
        self.error: grpc.aio.AioRpcError | None = None

    async def read_one(self) -> None:
        message = await self.call.read()
        assert message is not grpc.aio.EOF
        self.tokens += len(message.token_ids)

    async def read_all(self) -> GrpcStream:
        try:
            while (message := await self.call.read()) is not grpc.aio.EOF:
                self.tokens += len(message.token_ids)
                if message.HasField("final"):
                    self.final = message.final
        except grpc.aio.AioRpcError as exc:
            self.error = exc
        return self


def assert_ended_cleanly(seen: GrpcStream, started: bool) -> None:
    """A final message that counts every token delivered; or, before any token, a refusal that
    says when to retry."""
    if seen.final is not None:
        assert seen.error is None
        assert seen.final.usage.completion_tokens == seen.tokens
        assert seen.final.usage.prompt_tokens > 0
        assert seen.final.finish_reason in (pb.FINISH_REASON_CANCELLED, pb.FINISH_REASON_LENGTH)
        return
    assert seen.error is not None
    assert not started and seen.tokens == 0, (seen.tokens, seen.error)
    assert seen.error.code() in REFUSALS, seen.error
    trailers = dict(seen.error.trailing_metadata() or ())
    assert int(trailers["grpc-retry-pushback-ms"]) >= 100, trailers


async def test_sigterm_ends_running_and_queued_grpc_streams_cleanly(
    stack: tuple[Stack, Ports],
) -> None:
    gateway, ports = stack
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        running = GrpcStream(stub.Generate(long_request("Tell me everything")))
        await running.read_one()
        queued = [
            GrpcStream(stub.Generate(long_request(f"Tell me more {k}"))) for k in range(QUEUED)
        ]
        reading = [asyncio.ensure_future(q.read_all()) for q in queued]
        await until_gauge(ports, "appliance_requests_waiting", QUEUED)
        gateway.terminate()
        await running.read_all()
        await asyncio.gather(*reading)
    assert running.final is not None, running.error
    assert running.final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert_ended_cleanly(running, started=True)
    for q in queued:
        assert_ended_cleanly(q, started=False)


async def _sse(port: int, body: dict[str, object]) -> tuple[int, dict[str, str], list[bytes]]:
    """One streamed completion over raw HTTP/1.1: status, headers and every `data:` payload."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    events = [line[6:] for line in rest.split(b"\n") if line.startswith(b"data: ")]
    return int(status_line.split()[1]), headers, events


def assert_sse_ended_cleanly(status: int, headers: dict[str, str], events: list[bytes]) -> None:
    if status != 200:  # refused before any text: a retry hint
        assert status in (429, 503), (status, events)
        assert int(headers["retry-after-ms"]) >= 100 and int(headers["retry-after"]) >= 1
        return
    assert events[-1] == b"[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-2:]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("abort", "length")
    usage = chunks[-1]["usage"]
    # Every text chunk but a closing flush carries at least one token: the count covers them.
    delivered = sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"])
    assert delivered > 0 and usage["completion_tokens"] >= delivered - 1 > 0


async def test_sigterm_ends_running_and_queued_http_streams_cleanly(
    stack: tuple[Stack, Ports],
) -> None:
    gateway, ports = stack
    body: dict[str, object] = {
        "model": MODEL,
        "max_tokens": LONG_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "appliance": {"cache_policy": "bypass"},
    }
    first = asyncio.ensure_future(_sse(ports.http, {**body, "prompt": "Tell me everything"}))
    await until_gauge(ports, "appliance_engine_generating")  # the first holds the slot
    queued = [
        asyncio.ensure_future(_sse(ports.http, {**body, "prompt": f"Tell me more {k}"}))
        for k in range(QUEUED)
    ]
    await until_gauge(ports, "appliance_requests_waiting", QUEUED)
    gateway.terminate()
    status, headers, events = await first
    assert status == 200
    assert_sse_ended_cleanly(status, headers, events)
    for q in queued:
        assert_sse_ended_cleanly(*await q)
