"""The engine's stream socket (appliance/backends/stream_socket.py) against what a client may send
it: frames cut anywhere, a message over the limit refused by its length before its bytes, a
preamble of another protocol, bytes that do not parse, silence; a socket file left by a dead server
is taken over and a live one is not; and a gateway that names the socket serves through it, and
says which socket is missing when the engine is not there.

The same streams over gRPC and over the socket are compared in test_engine_streams.py.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.backends import stream_socket
from appliance.backends.base import GREEDY, BackendError, GenerationRequest
from appliance.backends.stream_socket import (
    PREAMBLE,
    FrameError,
    FrameParser,
    SocketInUse,
    SocketStream,
    StreamSocketServer,
    frame,
)
from appliance.backends.triton import TritonBackend
from appliance.client import generate
from appliance.config import ConfigError, load_config
from appliance.grpc_limits import MAX_REQUEST_BYTES
from appliance.listen import lock_path, serving_problem
from appliance.tools import processes
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny
from tests.engine.test_conformance import MODEL as ENGINE_MODEL
from tests.engine.test_conformance import is_final, request
from tests.engine.test_engine_process import engine_cli
from tests.gateway.stack import MODEL, engine_and_gateway
from tests.gateway.test_e2e import serve_to_exit
from tests.support import until_async, until_engine


def test_frames_cut_anywhere_come_out_whole() -> None:
    messages = [request(f"r{k}", max_tokens=k + 1) for k in range(3)]
    data = b"".join(frame(m) for m in messages)
    for cut in (1, 3, 4, 5, 17, len(data) - 1):
        parser = FrameParser(1 << 20)
        payloads = parser.feed(data[:cut]) + parser.feed(data[cut:])
        assert [ts.ModelInferRequest.FromString(p) for p in payloads] == messages


def test_a_message_over_the_limit_is_refused_by_its_length_alone() -> None:
    parser = FrameParser(100)
    assert parser.feed(struct.pack("<I", 100) + b"x" * 100) == [b"x" * 100]
    with pytest.raises(FrameError, match="101 bytes"):
        parser.feed(struct.pack("<I", 101))  # none of its bytes sent


async def _raw(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_unix_connection(str(path))


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    async with asyncio.timeout(10):
        return await reader.read() == b""


async def _stream_over_raw_socket(
    path: Path, rid: str, sent: ts.ModelInferRequest | None = None
) -> list[ts.ModelStreamInferResponse]:
    reader, writer = await _raw(path)
    writer.write(PREAMBLE + frame(sent if sent is not None else request(rid, max_tokens=3)))
    parser = FrameParser(1 << 20)
    seen: list[ts.ModelStreamInferResponse] = []
    async with asyncio.timeout(30):
        while not seen or not is_final(seen[-1].infer_response):
            for payload in parser.feed(await reader.read(65536)):
                seen.append(ts.ModelStreamInferResponse.FromString(payload))
    writer.close()
    return seen


async def test_a_raw_client_gets_triton_responses(engine: Engine) -> None:
    assert engine.stream_socket is not None
    seen = await _stream_over_raw_socket(engine.stream_socket, "raw")
    assert all(m.infer_response.id == "raw" and not m.error_message for m in seen)
    assert is_final(seen[-1].infer_response)


async def test_a_refusal_after_core_checks_is_the_final_response_grpc_sends(
    engine: Engine,
) -> None:
    """The backend's error response reaches a socket client as Triton's stream handler writes
    it, the request's last: its id, model and final flag with the error."""
    assert engine.stream_socket is not None
    refused = request("late", top_k=-1)
    (seen,) = await _stream_over_raw_socket(engine.stream_socket, "late", refused)
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = ts_grpc.GRPCInferenceServiceStub(channel)
        (over_grpc,) = [m async for m in stub.ModelStreamInfer(iter([refused]), timeout=30)]
    assert seen == over_grpc
    assert (seen.error_message, seen.infer_response.model_name) == (
        "runtime_top_k must be >= 0, got -1",
        "tensorrt_llm",
    )


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", id="another protocol"),
        pytest.param(PREAMBLE + struct.pack("<I", MAX_REQUEST_BYTES + 1), id="over the limit"),
        pytest.param(PREAMBLE + struct.pack("<I", 3) + b"\xff\xff\xff", id="not a request"),
    ],
)
async def test_what_the_protocol_does_not_allow_closes_the_connection(
    engine: Engine, sent: bytes
) -> None:
    assert engine.stream_socket is not None
    reader, writer = await _raw(engine.stream_socket)
    writer.write(sent)
    assert await _closed_by_server(reader)
    writer.close()
    # ... and the server serves the next client.
    assert is_final(
        (await _stream_over_raw_socket(engine.stream_socket, "next"))[-1].infer_response
    )


async def test_a_silent_client_is_dropped(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine.stream_socket is not None
    monkeypatch.setattr(stream_socket, "PREAMBLE_TIMEOUT_S", 0.1)
    reader, writer = await _raw(engine.stream_socket)
    writer.write(PREAMBLE[:5])
    assert await _closed_by_server(reader)
    writer.close()


async def test_a_message_that_stops_partway_is_dropped(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert engine.stream_socket is not None
    monkeypatch.setattr(stream_socket, "FRAME_TIMEOUT_S", 0.1)
    reader, writer = await _raw(engine.stream_socket)
    writer.write(PREAMBLE + struct.pack("<I", 1000) + b"\x0a" * 10)  # 10 bytes of 1,000
    assert await _closed_by_server(reader)
    writer.close()


async def _answers(
    requests: AsyncIterator[ts.ModelInferRequest],
) -> AsyncGenerator[ts.ModelStreamInferResponse, None]:
    """One response per request, with its id."""
    async for r in requests:
        yield ts.ModelStreamInferResponse(infer_response=ts.ModelInferResponse(id=r.id))


@pytest.mark.parametrize("part", ["preamble", "message"])
async def test_bytes_that_arrive_while_the_loop_is_held_are_not_taken_for_a_stall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    """The rest of a message arrives while this process's loop is busy past the timeout: when
    the loop runs again the timer is due and the bytes are there; the message is served."""
    timeout_s = 0.2
    monkeypatch.setattr(stream_socket, "FRAME_TIMEOUT_S", timeout_s)
    monkeypatch.setattr(stream_socket, "PREAMBLE_TIMEOUT_S", timeout_s)
    waiting = {"preamble": asyncio.Event(), "message": asyncio.Event()}
    read_within = stream_socket._read_within

    async def noted(reader: asyncio.StreamReader, size: int, within_s: float) -> bytes:
        waiting["preamble" if size == len(PREAMBLE) else "message"].set()
        return await read_within(reader, size, within_s)

    monkeypatch.setattr(stream_socket, "_read_within", noted)
    server = StreamSocketServer(tmp_path / "s.sock", _answers, 1 << 20)
    await server.start()
    data = PREAMBLE + frame(request("held"))
    cut = 5 if part == "preamble" else len(PREAMBLE) + 10
    reader, writer = await _raw(server.path)
    try:
        writer.write(data[:cut])
        async with asyncio.timeout(10):
            await waiting[part].wait()
        writer.write(data[cut:])
        await writer.drain()
        time.sleep(timeout_s * 3)  # the loop held: the rest is in the socket, the timer due
        parser = FrameParser(1 << 20)
        async with asyncio.timeout(10):
            payloads: list[bytes] = []
            while not payloads:
                received = await reader.read(65536)
                assert received, "the server closed the connection"
                payloads = parser.feed(received)
        assert ts.ModelStreamInferResponse.FromString(payloads[0]).infer_response.id == "held"
    finally:
        writer.close()
        await server.close(0.0)


async def test_a_connection_past_the_limit_is_closed_and_the_others_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_socket, "MAX_CONNECTIONS", 2)
    server = StreamSocketServer(tmp_path / "s.sock", _forever, 1024)
    await server.start()
    streams = [SocketStream(str(server.path), 1024) for _ in range(2)]
    try:
        await asyncio.gather(*(s.write(request(f"kept{k}")) for k, s in enumerate(streams)))
        await until_async(lambda: server.connections == 2)
        reader, writer = await _raw(server.path)
        assert await _closed_by_server(reader)
        writer.close()
        assert not any(s.done() for s in streams)
    finally:
        for s in streams:
            s.cancel()
        await server.close(0.0)


async def test_closing_the_connection_cancels_its_request(engine: Engine) -> None:
    assert engine.stream_socket is not None
    cancelled = engine.stats().cancelled
    reader, writer = await _raw(engine.stream_socket)
    writer.write(PREAMBLE + frame(request("left", max_tokens=2000)))
    await reader.read(1)  # the first response has begun
    writer.close()
    await until_engine(engine.stats(), lambda: engine.stats().cancelled > cancelled)


async def test_closing_the_connection_cancels_a_request_still_queued(engine: Engine) -> None:
    """Nothing is written to a queued request's connection, so only reading notices the close."""
    assert engine.stream_socket is not None
    running_reader, running = await _raw(engine.stream_socket)
    running.write(PREAMBLE + frame(request("running", max_tokens=2000)))
    await running_reader.read(1)
    _, queued = await _raw(engine.stream_socket)
    queued.write(PREAMBLE + frame(request("queued", max_tokens=4)))
    await until_async(
        lambda: set(engine.service._by_id) == {(ENGINE_MODEL, "running"), (ENGINE_MODEL, "queued")}
    )
    queued.close()
    await until_async(lambda: set(engine.service._by_id) == {(ENGINE_MODEL, "running")})
    running.close()
    await until_async(lambda: not engine.service._by_id)


async def _nothing(
    _: AsyncIterator[ts.ModelInferRequest],
) -> AsyncGenerator[ts.ModelStreamInferResponse, None]:
    return
    yield


async def _forever(
    requests: AsyncIterator[ts.ModelInferRequest],
) -> AsyncGenerator[ts.ModelStreamInferResponse, None]:
    """Takes one request and never answers it."""
    await anext(requests)
    await asyncio.Event().wait()
    yield ts.ModelStreamInferResponse()


async def test_a_burst_of_new_streams_all_connect(tmp_path: Path) -> None:
    """Connects that outrun the server's accepts wait in its backlog, and one that finds the
    backlog full tries again, instead of failing the request."""
    server = StreamSocketServer(tmp_path / "s.sock", _forever, 1024)
    await server.start()
    streams = [SocketStream(str(server.path), 1024) for _ in range(300)]
    try:
        await asyncio.gather(*(s.write(request(f"b{k}")) for k, s in enumerate(streams)))
        assert not any(s.done() for s in streams)
    finally:
        for s in streams:
            s.cancel()
        await server.close(0.0)


async def test_streams_cut_at_shutdown_end_quietly(tmp_path: Path) -> None:
    """A stream still running when the server closes is cancelled, and nothing is left for the
    event loop to report (on Python 3.11 a connection task ended cancelled logs a traceback)."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        server = StreamSocketServer(tmp_path / "s.sock", _forever, 1024)
        await server.start()
        reader, writer = await _raw(server.path)
        writer.write(PREAMBLE + frame(request("cut")))
        await until_async(lambda: len(server._connections) == 1)
        await server.close(0.0)
        assert await _closed_by_server(reader)
        writer.close()
        await asyncio.sleep(0)  # callbacks of the closed connection run
        assert not server._connections and not server.path.exists()
    finally:
        loop.set_exception_handler(previous)
    assert reported == []


async def test_cancelled_while_connecting_is_cancelled(tmp_path: Path) -> None:
    """As grpc.aio's write of a call cancelled meanwhile: CancelledError, which the backend turns
    into CANCELLED while the gateway drains (not UNAVAILABLE)."""
    server = StreamSocketServer(tmp_path / "s.sock", _forever, 1024)
    await server.start()
    stream = SocketStream(str(server.path), 1024)
    writing = asyncio.ensure_future(stream.write(request("late")))
    await asyncio.sleep(0)  # the connect is under way
    stream.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing
    assert stream.cancelled()
    await server.close(0.0)


async def test_a_socket_left_by_a_dead_server_is_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # bound, never listening: what a killed server leaves
    dead.close()
    server = StreamSocketServer(path, _nothing, 1024)
    await server.start()
    try:
        assert path.is_socket() and path.stat().st_mode & 0o777 == 0o660
        with pytest.raises(SocketInUse, match="another process serves"):
            await StreamSocketServer(path, _nothing, 1024).start()
    finally:
        await server.close(0.0)
    assert not path.exists()


async def test_a_path_that_is_not_a_socket_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(SocketInUse, match="not a socket"):
        await StreamSocketServer(path, _nothing, 1024).start()
    assert path.read_text() == "keep me"


async def test_a_missing_socket_is_unavailable_and_named(engine: Engine, tmp_path: Path) -> None:
    backend = TritonBackend(engine.address, "tensorrt_llm", tmp_path / "absent.sock")
    await backend.wait_ready(30)
    try:
        with pytest.raises(BackendError) as err:
            async for _ in backend.stream(
                GenerationRequest("x", [1, 2, 3], 2, None, None, GREEDY, 10.0)
            ):
                pass
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert f"engine stream socket {tmp_path / 'absent.sock'} unavailable" in err.value.message
    finally:
        await backend.close()


def _config(tmp_path: Path, line: str) -> Path:
    path = tmp_path / "g.toml"
    path.write_text(
        f'[server]\nlisten = "127.0.0.1:1"\n[models.m]\nbackend = "127.0.0.1:2"\n'
        f'tokenizer_dir = "tok"\n{line}\n'
    )
    return path


def test_the_gateway_reads_the_socket_relative_to_its_configuration(tmp_path: Path) -> None:
    config = load_config(_config(tmp_path, 'stream_socket = "run/engine.sock"'))
    assert config.models["m"].stream_socket == tmp_path / "run" / "engine.sock"


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (f'stream_socket = "/{"x" * 120}"', "longer than a Unix socket's path"),
        (
            'stream_socket = "/run/e.sock"\nbackend_kind = "appliance.backends.triton:TritonBackend"',
            'needs backend_kind = "triton"',
        ),
    ],
)
def test_a_socket_the_gateway_cannot_use_is_refused(tmp_path: Path, line: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_config(tmp_path, line))
    assert "stream_socket" in str(err.value) and says in str(err.value)


def test_the_engine_refuses_a_socket_another_process_serves_before_loading(
    tiny: Tiny, tmp_path: Path
) -> None:
    path = tmp_path / "taken.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(path))
        other.listen()
        done = engine_cli(tiny.repo, "--stream-socket", str(path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"appliance engine: cannot serve the stream socket {path}: another process serves it"
    ], done.stderr
    assert path.is_socket()  # left to its owner


def test_the_engine_refuses_a_socket_in_a_missing_folder_before_loading(
    tiny: Tiny, tmp_path: Path
) -> None:
    path = tmp_path / "absent" / "s.sock"
    done = engine_cli(tiny.repo, "--stream-socket", str(path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"appliance engine: cannot serve the stream socket {path}: its folder "
        f"{path.parent} does not exist"
    ], done.stderr


def test_the_engine_refuses_a_socket_path_too_long_in_one_line(tmp_path: Path) -> None:
    done = engine_cli(tmp_path, "--stream-socket", "/" + "x" * 120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "longer than a Unix socket's path" in lines[0], done.stderr


def _unix_sockets_named(path: Path) -> int:
    """Sockets on this host bound to `path`: a listener and every connection it accepted."""
    return sum(line.rstrip().endswith(" " + str(path)) for line in open("/proc/net/unix"))


async def test_a_gateway_serves_through_the_socket(
    tiny: Tiny, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ask = pb.GenerateRequest(
        model=MODEL,
        prompt="The gateway streams tokens",
        max_tokens=8,
        temperature=0,
        cache_policy=pb.CACHE_POLICY_BYPASS,
    )
    answers = []
    for over_socket in (False, True):
        work = tmp_path_factory.mktemp("socket-gateway")
        with engine_and_gateway(tiny, work, stream_socket=over_socket) as stack:
            async with grpc.aio.insecure_channel(stack.address) as channel:
                answers.append((await generate(pb_grpc.InferenceStub(channel), ask)).token_ids)
            if over_socket:  # the listener, and the gateway's stream kept open on it
                assert _unix_sockets_named(work / "engine.sock") == 2
    assert answers[0] and answers[0] == answers[1]


async def test_a_gateway_whose_socket_is_missing_stops_at_start_in_one_line(
    engine: Engine, tiny: Tiny, tmp_path: Path
) -> None:
    """Readiness is asked over gRPC, so the socket is first tried by the warm-up request: a
    wrong path ends the start, naming the socket, instead of failing the first client."""
    absent = tmp_path / "absent.sock"
    config = processes.write_gateway_config(
        tmp_path / "g.toml",
        f"127.0.0.1:{processes.free_port()}",
        MODEL,
        engine.address,
        tiny.tokenizer_dir,
        stream_socket=absent,
    )
    done = await asyncio.to_thread(serve_to_exit, config)
    assert done.returncode == 1
    assert (done.stdout + done.stderr).strip().splitlines() == [
        f"appliance serve: model '{MODEL}': warm-up request failed: engine stream socket "
        f"{absent} unavailable: No such file or directory"
    ]


async def test_two_servers_started_at_once_cannot_both_take_the_path(tmp_path: Path) -> None:
    """Looking for a live server and binding are two steps; the lock beside the socket makes
    them one. Here the first server's socket file is gone (as if the second had looked before
    the first bound): the second is still refused while the first runs, and takes the path once
    it has stopped."""
    path = tmp_path / "s.sock"
    first = StreamSocketServer(path, _nothing, 1024)
    await first.start()
    path.unlink()
    second = StreamSocketServer(path, _nothing, 1024)
    with pytest.raises(SocketInUse, match="another process serves"):
        await second.start()
    assert serving_problem(path) == "another process serves it"
    assert not path.exists()  # the refused server made nothing
    await first.close(0.0)
    assert serving_problem(path) is None
    await second.start()
    try:
        assert path.is_socket() and lock_path(path).exists()
    finally:
        await second.close(0.0)
