"""Whose deadline a request ended at is on its outcome: a client that set none and ran out of the
model's default deadline (the server was too slow for its own budget) is told apart from a client
whose own deadline passed (its choice). A stream whose engine stops after its first token shows
as a long wait for a token."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from appliance.config import HttpConfig, MetricsConfig
from appliance.gateway.metrics import longest_wait_us
from appliance.gateway.models import load_models
from appliance.gateway.server import RunningGateway, start_server
from appliance.tools import processes
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny, copy_repository
from tests.gateway.test_latency_discipline import LONG as STREAM
from tests.gateway.test_latency_discipline import EngineProcess
from tests.observability.test_label_bounds import scrape
from tests.observability.test_prometheus import Reports
from tests.support import gateway_config

# A generation of 1500 tokens cannot finish within a millisecond: both deadlines pass.
LONG: dict[str, Any] = {"max_tokens": 1500, "temperature": 0.0}


@pytest.fixture
async def gateway(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    config = gateway_config(
        tiny.tokenizer_dir,
        engine.address,
        http=HttpConfig(listen="127.0.0.1:0"),
        metrics=MetricsConfig(listen="127.0.0.1:0"),
        default_deadline_s=0.001,
    )
    running = await start_server(config, await load_models(config))
    yield running
    await running.drain(0.5)


async def test_a_deadline_exceeded_says_whose_deadline_it_was(gateway: RunningGateway) -> None:
    assert gateway.http is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # no client deadline: the model's
            await stub.Complete(pb.GenerateRequest(model="tiny", prompt="model's", **LONG))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": "client's", "appliance": {"deadline_ms": 1}, **LONG}
        url = f"http://127.0.0.1:{gateway.http.port}/v1/completions"
        async with http.post(url, json=body) as reply:
            assert reply.status == 504, await reply.text()
    outcomes = {
        (d["front_end"], d.get("deadline", ""))
        for d in map(dict, scrape(gateway.metrics_port)["appliance_requests_total"])
        if d["status"] == "DEADLINE_EXCEEDED"
    }
    assert outcomes == {("grpc", "model"), ("http", "client")}


async def test_a_stream_stalled_after_its_first_token_shows_as_a_long_wait(
    tiny: Tiny, tmp_path: Path
) -> None:
    """The engine sends the first tokens of a long answer, then nothing (stopped): the request,
    whose client set no deadline, ends at the model's default deadline, a server-side failure,
    and its wait after the last token it sent is on the longest-wait histogram."""
    proc = EngineProcess(
        copy_repository(tiny.repo, tmp_path / "repo"),
        f"127.0.0.1:{processes.free_port()}",
        tmp_path / "engine.log",
    )
    proc.start()
    try:
        await proc.wait_ready()
        config = gateway_config(
            tiny.tokenizer_dir,
            proc.address,
            metrics=MetricsConfig(listen="127.0.0.1:0"),
            default_deadline_s=3.0,  # far longer than any gap between tokens
            ready_timeout_s=60.0,
        )
        reports = Reports()
        running = await start_server(config, await load_models(config), reports)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                call = pb_grpc.InferenceStub(channel).Generate(
                    pb.GenerateRequest(model="tiny", **STREAM)
                )
                first = await call.read()
                assert first is not grpc.aio.EOF and first.token_ids
                proc.signal(signal.SIGSTOP)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            (report,) = reports.items
            assert (report.status, report.deadline) == ("DEADLINE_EXCEEDED", "model")
            # The stall, from the last token sent to the deadline, is the longest wait.
            stall = report.total_us - report.ttft_us - sum(report.inter_token_us)
            assert longest_wait_us(report) == stall > max(report.inter_token_us, default=0)
            series = scrape(running.metrics_port)
            assert series["appliance_longest_token_wait_seconds_count"] == {(("model", "tiny"),)}
        finally:
            await running.drain(0.5)
    finally:
        proc.stop()
