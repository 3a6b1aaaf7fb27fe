"""The engine server stops as Triton 25.12 stops (server main.cc: StopEndpoints with
--exit-timeout-secs, then TRITONSERVER_ServerStop): new calls are refused as gRPC refuses them on a
server shutting down (UNAVAILABLE), a request sent on a stream already open is refused in-band with
Triton's message, requests in flight finish up to the exit timeout, and what still runs then is
cancelled (UNAVAILABLE). The gateway's Triton client takes every refusal as the engine being
unavailable: an engine fault for the breaker, and a reason to fall back.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import jinja2
import pytest
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.backends.base import GREEDY, BackendError, GenerationRequest
from appliance.backends.triton import TritonBackend
from appliance.cli import EXIT_TIMEOUT_SECS, MAX_EXIT_TIMEOUT_SECS
from appliance.engine.runner import CLOSE_TIMEOUT_S
from appliance.engine.server import (
    EXITING,
    NOT_READY,
    STOPPING,
    EngineModel,
    EngineService,
    load_repository,
    start_engine,
    stop_engine,
)
from appliance.gateway.pipeline import ENGINE_FAULTS
from appliance.tools import processes
from tests.conftest import Tiny
from tests.engine.test_conformance import collect, is_final, request, tokens_of
from tests.engine.test_engine_process import engine_cli
from tests.support import until_engine

MODEL = "tensorrt_llm"
REPO = Path(__file__).resolve().parents[2]
# A request that runs far longer than a stop takes to begin: no end id, near the tiny model's
# max_seq_len (2048).
LONG = 2000


@dataclass
class Served:
    server: grpc.aio.Server
    service: EngineService
    address: str
    stopped: bool = False

    async def stop(self, exit_timeout_s: float) -> int:
        self.stopped = True
        return await stop_engine(self.server, self.service, exit_timeout_s)


@pytest.fixture(scope="module")
def models(engine_repo: Path) -> Iterator[dict[str, EngineModel]]:
    loaded = load_repository(engine_repo)
    yield loaded
    for model in loaded.values():
        model.runner.close()


@pytest.fixture
async def served(models: dict[str, EngineModel]) -> AsyncIterator[Served]:
    server, service, port = await start_engine(models, "127.0.0.1:0")
    s = Served(server, service, f"127.0.0.1:{port}")
    yield s
    if not s.stopped:
        await s.stop(0.0)


async def _refused(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


@dataclass
class Spawned:
    """An `appliance engine` process serving the tiny model; `code`: its exit status once the
    block that spawned it has ended."""

    address: str
    proc: subprocess.Popen[bytes]
    log: Path
    code: int | None = None


@contextlib.asynccontextmanager
async def _engine_process(
    tiny: Tiny, tmp_path: Path, exit_timeout_secs: int, stop_timeout_s: float
) -> AsyncIterator[Spawned]:
    """The engine with `--exit-timeout-secs`, ready; at the end it is awaited (SIGKILL after
    `stop_timeout_s`: the test sends its own SIGTERM)."""
    address = f"127.0.0.1:{processes.free_port()}"
    log = tmp_path / "engine.log"
    argv = ["engine", "--repository", str(tiny.repo), "--listen", address]
    spawned = Spawned(
        address, processes.spawn([*argv, "--exit-timeout-secs", str(exit_timeout_secs)], log), log
    )
    try:
        await asyncio.to_thread(processes.wait_engine, address, spawned.proc, log)
        yield spawned
    finally:
        spawned.code = await asyncio.to_thread(processes.stop, spawned.proc, stop_timeout_s, True)


async def test_sigterm_lets_the_stream_in_flight_finish_and_refuses_new_calls(
    tiny: Tiny, tmp_path: Path
) -> None:
    async with (
        _engine_process(tiny, tmp_path, 120, 150.0) as engine,
        grpc.aio.insecure_channel(engine.address) as channel,
    ):
        stub = ts_grpc.GRPCInferenceServiceStub(channel)
        running = stub.ModelStreamInfer()
        await running.write(request("in-flight", max_tokens=LONG))
        first = (await running.read()).infer_response
        engine.proc.send_signal(signal.SIGTERM)
        stopping = await asyncio.to_thread(
            processes.wait_for_line, engine.log, "engine stopping", engine.proc
        )
        assert "waiting up to 120 s (--exit-timeout-secs) for 1 requests in flight" in stopping
        # New calls: refused by the stopping gRPC server, as Triton's are (retryable).
        for call in (
            stub.ServerReady(ts.ServerReadyRequest(), timeout=5),
            stub.ModelReady(ts.ModelReadyRequest(name=MODEL), timeout=5),
        ):
            assert (await _refused(call)).code() == grpc.StatusCode.UNAVAILABLE
        fresh = collect(stub, request("new", max_tokens=2))
        assert (await _refused(fresh)).code() == grpc.StatusCode.UNAVAILABLE
        rest = []
        while (message := await running.read()) is not grpc.aio.EOF:
            assert not message.error_message, message.error_message
            rest.append(message.infer_response)
        assert await running.code() == grpc.StatusCode.OK
    # Every token of the request in flight at the signal, the last response final.
    assert len(tokens_of(first)) + sum(len(tokens_of(r)) for r in rest) == LONG
    assert is_final(rest[-1]) and rest[-1].id == "in-flight"
    text = engine.log.read_text()
    assert engine.code == 0, processes.last_words(engine.log)
    assert "engine stopped in" in text and "exit timeout expired" not in text


async def test_an_engine_that_cut_requests_at_its_exit_timeout_exits_1(
    tiny: Tiny, tmp_path: Path
) -> None:
    """As Triton's: a stop that had to cancel requests in flight is a failed stop."""
    async with (
        _engine_process(tiny, tmp_path, 0, 60.0) as engine,
        grpc.aio.insecure_channel(engine.address) as channel,
    ):
        running = ts_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
        await running.write(request("cut", max_tokens=LONG))
        await running.read()
        engine.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            while await running.read() is not grpc.aio.EOF:
                pass
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    assert engine.code == 1, processes.last_words(engine.log)
    text = engine.log.read_text()
    assert "exit timeout expired: 1 requests still in flight were cancelled" in text


async def test_a_request_sent_while_stopping_is_refused_as_triton_refuses_it(
    served: Served,
) -> None:
    """Between the signal and the gRPC server's own refusal a call may still reach the service:
    it gets Triton's answer for that state, every one UNAVAILABLE."""
    backend = TritonBackend(served.address, MODEL)  # the gateway's client, ready before the stop
    await backend.wait_ready(30)
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = ts_grpc.GRPCInferenceServiceStub(channel)
        running = stub.ModelStreamInfer()
        await running.write(request("running", max_tokens=LONG))
        await running.read()
        served.service.stop_streams()
        refusals = {
            "ServerLive": await _refused(stub.ServerLive(ts.ServerLiveRequest())),
            "ServerReady": await _refused(stub.ServerReady(ts.ServerReadyRequest())),
            "ModelReady": await _refused(stub.ModelReady(ts.ModelReadyRequest(name=MODEL))),
            "ModelMetadata": await _refused(
                stub.ModelMetadata(ts.ModelMetadataRequest(name=MODEL))
            ),
            "ModelStatistics": await _refused(stub.ModelStatistics(ts.ModelStatisticsRequest())),
            "RepositoryIndex": await _refused(stub.RepositoryIndex(ts.RepositoryIndexRequest())),
            "ModelInfer": await _refused(
                stub.ModelInfer(request("unary", model="sync_llm", streaming=False))
            ),
        }
        assert {name: (e.code(), e.details()) for name, e in refusals.items()} == {
            "ServerLive": (grpc.StatusCode.UNAVAILABLE, EXITING),
            "ServerReady": (grpc.StatusCode.UNAVAILABLE, EXITING),
            "ModelReady": (grpc.StatusCode.UNAVAILABLE, NOT_READY),
            "ModelMetadata": (grpc.StatusCode.UNAVAILABLE, NOT_READY),
            "ModelStatistics": (grpc.StatusCode.UNAVAILABLE, NOT_READY),
            "RepositoryIndex": (grpc.StatusCode.UNAVAILABLE, NOT_READY),
            "ModelInfer": (grpc.StatusCode.UNAVAILABLE, STOPPING),
        }
        # Core looks a model's config up without asking whether the server is ready.
        config = await stub.ModelConfig(ts.ModelConfigRequest(name=MODEL))
        assert config.config.name == MODEL
        # On a stream already open: refused in-band, naming the request; the request in flight
        # on it goes on.
        await running.write(request("late", max_tokens=2))
        while not (message := await running.read()).error_message:
            assert message.infer_response.id == "running"
        assert (message.error_message, message.infer_response.id) == (STOPPING, "late")
        # With Triton's header, out of band: the stream ends with the refusal's status.
        header = stub.ModelStreamInfer(metadata=(("triton_grpc_error", "true"),))
        await header.write(request("late-too", max_tokens=2))
        refused = await _refused(header.read())
        assert (refused.code(), refused.details()) == (grpc.StatusCode.UNAVAILABLE, STOPPING)
        running.cancel()
    # The gateway's client takes the refusal as the engine unavailable, not the request at fault.
    try:
        g = GenerationRequest("via-gateway", [1, 300, 301], 4, None, None, GREEDY, 30.0)
        with pytest.raises(BackendError) as err:
            async for _ in backend.stream(g):
                pass
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.code in ENGINE_FAULTS
        assert STOPPING in err.value.message
    finally:
        await backend.close()


async def test_a_stream_still_running_at_the_exit_timeout_is_cancelled(
    served: Served, models: dict[str, EngineModel]
) -> None:
    stats = models[MODEL].runner.stats
    cancelled = stats.cancelled
    async with grpc.aio.insecure_channel(served.address) as channel:
        stub = ts_grpc.GRPCInferenceServiceStub(channel)
        running = stub.ModelStreamInfer()
        await running.write(request("cut", max_tokens=LONG))
        got = len(tokens_of((await running.read()).infer_response))
        assert await served.stop(0.2) == 1  # still in flight when the exit timeout expired
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while (message := await running.read()) is not grpc.aio.EOF:
                got += len(tokens_of(message.infer_response))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # as when Triton exits
    assert got < LONG
    await until_engine(stats, lambda: stats.cancelled > cancelled and stats.running is None)


@pytest.mark.parametrize("value", ["-1", str(MAX_EXIT_TIMEOUT_SECS + 1), "1.5", "soon"])
def test_exit_timeout_out_of_range_is_refused_naming_the_option(tmp_path: Path, value: str) -> None:
    done = engine_cli(tmp_path, "--exit-timeout-secs", value)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("appliance engine: error: argument --exit-timeout-secs: "), last
    assert value in last


def test_systemd_waits_longer_than_the_engine_stop_takes() -> None:
    """TimeoutStopSec exceeds the exit timeout plus the compute threads' join (Runner.close):
    the unit's for its default, the role's drop-in for the role's value."""
    unit = (REPO / "systemd/appliance-engine.service").read_text()
    assert "--exit-timeout-secs ${ENGINE_EXIT_TIMEOUT_SECS}" in unit
    default = re.search(r"ENGINE_EXIT_TIMEOUT_SECS=(\d+)", unit)
    stop = re.search(r"^TimeoutStopSec=(\d+)s$", unit, re.M)
    assert default and stop
    assert int(default.group(1)) == EXIT_TIMEOUT_SECS
    assert int(stop.group(1)) > EXIT_TIMEOUT_SECS + CLOSE_TIMEOUT_S
    role = REPO / "ansible/roles/appliance"
    defaults = (role / "defaults/main.yml").read_text()
    assert f"appliance_engine_exit_timeout_secs: {EXIT_TIMEOUT_SECS}\n" in defaults
    template = jinja2.Template((role / "templates/engine-stop.conf.j2").read_text())
    for secs in (0, EXIT_TIMEOUT_SECS, MAX_EXIT_TIMEOUT_SECS):
        text = template.render(appliance_engine_exit_timeout_secs=secs, ansible_managed="test")
        drop_in = re.search(r"^TimeoutStopSec=(\d+)s$", text, re.M)
        assert drop_in and int(drop_in.group(1)) > secs + CLOSE_TIMEOUT_S, text
    env = (role / "templates/engine.env.j2").read_text()
    assert "ENGINE_EXIT_TIMEOUT_SECS={{ appliance_engine_exit_timeout_secs }}" in env
