"""Whose deadline a request ended at is on its outcome: a client that set none and ran out of the
model's default deadline (the server was too slow for its own budget) is told apart from a client
whose own deadline passed (its choice)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest

from appliance.config import HttpConfig, MetricsConfig
from appliance.gateway.models import load_models
from appliance.gateway.server import RunningGateway, start_server
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny
from tests.observability.test_label_bounds import scrape
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
