"""The gateway's Triton client keeps its streams open between requests, against a real engine server:
requests one after another share one stream and get exactly their own tokens; a request that ends
early, fails or runs out of time takes its stream down; a kept stream the server ended is replaced
without the request failing; a stopping server refuses new requests in-band and ends idle streams.
Each holds over gRPC and over the engine's stream socket.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.backends import wire
from appliance.backends.base import GREEDY, BackendError, GenerationRequest
from appliance.backends.triton import TritonBackend, inband_error
from appliance.engine.server import (
    STOPPING,
    EngineService,
    load_repository,
    start_engine,
    stop_engine,
)
from tests.conftest import Engine
from tests.engine.test_conformance import is_final, request
from tests.support import until_async, until_engine

MODEL = "tensorrt_llm"


def generation(
    rid: str, prompt: list[int], max_tokens: int = 6, timeout_s: float = 30.0
) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens, None, None, GREEDY, timeout_s)


async def tokens(backend: TritonBackend, g: GenerationRequest) -> list[int]:
    return [t async for step in backend.stream(g) for t in step]


class Counted:
    """Counts the streams the backend opens."""

    def __init__(self, backend: TritonBackend) -> None:
        self.opened = 0
        pool = backend._streams
        open_stream: Callable[[], object] = pool._open

        def counted() -> object:
            self.opened += 1
            return open_stream()

        pool._open = counted


@asynccontextmanager
async def ready_backend(
    address: str, stream_socket: Path | None = None
) -> AsyncIterator[TritonBackend]:
    b = TritonBackend(address, MODEL, stream_socket)
    await b.wait_ready(30)
    try:
        yield b
    finally:
        await b.close()


TRANSPORTS = ["grpc", "stream socket"]


@pytest.fixture(params=TRANSPORTS)
async def backend(engine: Engine, request: pytest.FixtureRequest) -> AsyncIterator[TritonBackend]:
    socket = engine.stream_socket if request.param == "stream socket" else None
    async with ready_backend(engine.address, socket) as b:
        yield b


async def test_requests_one_after_another_share_one_stream_and_get_their_own_tokens(
    backend: TritonBackend, engine: Engine
) -> None:
    a, b = [1, 300, 301, 302], [1, 410, 411, 412, 413]
    async with ready_backend(engine.address) as fresh:
        expected_a = await tokens(fresh, generation("fa", a))
        expected_b = await tokens(fresh, generation("fb", b))
    counted = Counted(backend)
    assert await tokens(backend, generation("a1", a)) == expected_a
    assert await tokens(backend, generation("b1", b)) == expected_b
    assert await tokens(backend, generation("a2", a)) == expected_a
    assert counted.opened == 1 and len(backend._streams) == 1


async def test_a_request_left_early_takes_its_stream_down(
    backend: TritonBackend, engine: Engine, request: pytest.FixtureRequest
) -> None:
    prompt = [1, 500, 501]
    expected = await tokens(backend, generation("whole", prompt))
    counted = Counted(backend)
    cancelled = engine.stats().cancelled
    stops: list[str] = []
    send_stop = backend._send_stop

    async def recorded(request_id: str, some_ids: Sequence[int]) -> None:
        stops.append(request_id)
        await send_stop(request_id, some_ids)

    backend._send_stop = recorded  # type: ignore[method-assign]
    steps = backend.stream(generation("left", [1, 600, 601], max_tokens=2000))
    await anext(steps)
    await steps.aclose()
    await until_engine(engine.stats(), lambda: engine.stats().cancelled > cancelled)
    # Over gRPC a stop request follows (Triton may not see the stream's cancellation); on the
    # stream socket closing the connection is the cancellation.
    over_socket = request.node.callspec.params["backend"] == "stream socket"
    assert stops == ([] if over_socket else ["left"])
    # Nothing of the left request reaches the next one: it runs on a new stream.
    assert await tokens(backend, generation("next", prompt)) == expected
    assert counted.opened == 1


async def test_the_deadline_bounds_a_request_on_a_kept_stream(
    backend: TritonBackend, engine: Engine
) -> None:
    await tokens(backend, generation("keep", [1, 700]))
    assert len(backend._streams) == 1
    cancelled = engine.stats().cancelled
    with pytest.raises(BackendError) as err:
        await tokens(backend, generation("late", [1, 701], max_tokens=2000, timeout_s=0.05))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    await until_engine(engine.stats(), lambda: engine.stats().cancelled > cancelled)
    assert len(backend._streams) == 0


async def test_an_in_band_error_takes_its_stream_down(backend: TritonBackend) -> None:
    await tokens(backend, generation("keep", [1, 800]))
    with pytest.raises(BackendError) as err:
        await tokens(backend, generation("too-long", [1] * 100_000))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(backend._streams) == 0
    assert len(await tokens(backend, generation("after", [1, 801]))) == 6


class PrivateEngine:
    """An engine server of this test's own, which it may stop and start again on its port."""

    def __init__(self, engine_repo: Path, socket: Path) -> None:
        self.models = load_repository(engine_repo)
        self.port = 0
        self.server: grpc.aio.Server | None = None
        self.service: EngineService | None = None
        self.socket = socket

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server, self.service, self.port = await start_engine(
            {MODEL: self.models[MODEL]}, self.address, self.socket
        )

    async def stop(self) -> None:
        if self.server is not None and self.service is not None:
            await stop_engine(self.server, self.service, 0.0)
            self.server = None


@pytest.fixture
async def private(engine_repo: Path, tmp_path: Path) -> AsyncIterator[PrivateEngine]:
    engine = PrivateEngine(engine_repo, tmp_path / "s.sock")
    await engine.start()
    yield engine
    await engine.stop()
    engine.models[MODEL].runner.close()


@pytest.fixture(params=TRANSPORTS)
async def private_backend(
    private: PrivateEngine, request: pytest.FixtureRequest
) -> AsyncIterator[TritonBackend]:
    socket = private.socket if request.param == "stream socket" else None
    async with ready_backend(private.address, socket) as b:
        yield b


async def test_a_kept_stream_the_server_ended_is_replaced(
    private: PrivateEngine, private_backend: TritonBackend
) -> None:
    expected = await tokens(private_backend, generation("before", [1, 900, 901]))
    assert len(private_backend._streams) == 1
    await private.stop()  # the engine restarts: its streams end
    await private.start()
    counted = Counted(private_backend)
    assert await tokens(private_backend, generation("after", [1, 900, 901])) == expected
    assert counted.opened == 1


async def test_kept_streams_close_when_the_server_stops_answering(
    private: PrivateEngine, private_backend: TritonBackend
) -> None:
    await tokens(private_backend, generation("kept", [1, 950]))
    assert len(private_backend._streams) == 1
    await private.stop()
    ready, _ = await private_backend.readiness(1.0)
    assert not ready and len(private_backend._streams) == 0


async def test_a_stopping_engine_refuses_new_requests_in_band_and_ends_idle_streams(
    private: PrivateEngine,
) -> None:
    service = private.service
    assert service is not None
    async with grpc.aio.insecure_channel(private.address) as channel:
        stub = ts_grpc.GRPCInferenceServiceStub(channel)
        idle, busy = stub.ModelStreamInfer(), stub.ModelStreamInfer()
        await idle.write(request("done", max_tokens=2))
        while not is_final((await idle.read()).infer_response):
            pass
        await busy.write(request("running", max_tokens=400))
        first = await busy.read()
        assert first.infer_response.id == "running"
        service.stop_streams()
        assert await idle.read() is grpc.aio.EOF  # nothing ran on it: it ends at once
        await busy.write(request("late", max_tokens=2))
        seen = []
        while (message := await busy.read()) is not grpc.aio.EOF:
            seen.append(message)
        refused = [m for m in seen if m.error_message]
        assert [(m.error_message, m.infer_response.id) for m in refused] == [(STOPPING, "late")]
        running = [m.infer_response for m in seen if not m.error_message]
        assert running and all(r.id == "running" for r in running) and is_final(running[-1])
        await until_async(lambda: idle.done() and busy.done(), "streams did not end")


def test_the_request_id_before_a_triton_core_message_does_not_choose_its_status() -> None:
    """Triton core starts its messages with the request's id; the status comes from the words after
    it, whatever the id holds."""
    words = "input byte size mismatch for input 'request_output_len'. Expected 4, got 3"
    for request_id in ("cancel-not-found", ""):
        error = inband_error(wire.log_request(request_id) + words, request_id)
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT


def test_an_engine_whose_guide_compiles_are_all_taken_is_a_429_not_an_engine_fault() -> None:
    """The engine server refuses a guide that waited too long for a compile slot: the client may
    retry later; the engine is not unwell."""
    words = (
        "the guide was not compiled: 2 other guides were being compiled for 10 s; try again later"
    )
    error = inband_error(words, "g")
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for words in (
        "the EBNF grammar cannot be compiled within 10 s: make it smaller",
        "the guide's grammar took 6.0 s to compute the token masks of 202 tokens, more than 5 s",
    ):
        refused = inband_error(words, "g")
        assert (refused.code, refused.field) == (grpc.StatusCode.INVALID_ARGUMENT, "guide")
