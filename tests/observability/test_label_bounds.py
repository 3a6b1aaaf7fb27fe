"""A hostile client cannot grow the gateway's /metrics: hundreds of requests, each with a model
name, a namespace, an API key or a request id of its own, over gRPC and HTTP, leave only label
values from fixed sets (served models and "unknown", gRPC status names, front ends, tiers), and
the process's own memory and file descriptors are on the page to watch."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.config import HttpConfig, MetricsConfig
from appliance.gateway.models import load_models
from appliance.gateway.server import RunningGateway, start_server
from appliance.security.api_keys import RateLimits, write_entries
from appliance.security.secretfile import write_secret
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny
from tests.security.conftest import Keys
from tests.support import gateway_config

ROUNDS = 60
UNLIMITED = RateLimits(None, None, None)
# Every value each label may take, whatever the clients send.
BOUNDS = {
    "model": {"tiny", "unknown"},
    "answered_by": {"tiny"},
    "tier": {"miss", "l1"},
    "status": {code.name for code in grpc.StatusCode},
    "finish_reason": {"stop", "length", "cancelled", "none"},
    "front_end": {"grpc", "http"},
    "deadline": {"client", "model", ""},
    "reason": {"estimate", "expired", "host", "cross_origin"},
}


def scrape(port: int) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """Label sets by sample name (le, the bucket bound, left out)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            found.setdefault(s.name, set()).add(labels)
    return found


@pytest.fixture
async def gateway(
    tiny: Tiny, engine: Engine, tmp_path: Path
) -> AsyncIterator[tuple[RunningGateway, str]]:
    pepper = tmp_path / "pepper"
    write_secret(pepper)
    keys = Keys(tmp_path / "keys.json", pepper)
    write_entries(keys.path, [])
    token = keys.add(["ns"], ["generate"], limits=UNLIMITED)
    config = gateway_config(
        tiny.tokenizer_dir,
        engine.address,
        http=HttpConfig(listen="127.0.0.1:0"),
        metrics=MetricsConfig(listen="127.0.0.1:0"),
        auth=keys.auth(limits=UNLIMITED),
    )
    running = await start_server(config, await load_models(config))
    yield running, token
    await running.drain(0.5)


async def test_hostile_label_values_leave_the_metrics_bounded(
    gateway: tuple[RunningGateway, str],
) -> None:
    running, token = gateway
    assert running.http is not None
    url = f"http://127.0.0.1:{running.http.port}/v1/completions"
    valid = (("authorization", f"Bearer {token}"),)
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
        aiohttp.ClientSession() as http,
    ):
        stub = pb_grpc.InferenceStub(channel)
        for i in range(ROUNDS):
            asks = [
                (pb.GenerateRequest(model=f"model-{i}\x1b[2J", namespace="ns"), valid),
                (pb.GenerateRequest(model="tiny", namespace=f"ns-{i}\n"), valid),
                (
                    pb.GenerateRequest(model="tiny", namespace="ns"),
                    (("authorization", f"Bearer ak_{i:012x}_x"),),
                ),
                (
                    pb.GenerateRequest(model="tiny", namespace="ns", request_id=f"id-{i}", top_p=5),
                    valid,
                ),
                (
                    pb.GenerateRequest(
                        model="tiny", namespace="ns", request_id=f"id-{i}", prompt=f"q{i % 3}"
                    ),
                    valid,
                ),
            ]
            for ask, metadata in asks:
                ask.max_tokens = 1
                ask.prompt = ask.prompt or "hi"
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.Complete(ask, metadata=metadata, timeout=10)
            for body, key in (
                ({"model": f"m-{i}", "prompt": "hi", "max_tokens": 1}, token),
                (
                    {
                        "model": "tiny",
                        "prompt": "hi",
                        "max_tokens": 1,
                        "appliance": {"namespace": f"n{i}"},
                    },
                    token,
                ),
                ({"model": "tiny", "prompt": "hi", "max_tokens": 1}, f"ak_{i:012x}_y"),
                ({"model": "tiny", "prompt": ["x"] * 3, "max_tokens": f"{i}"}, token),
            ):
                headers = {
                    "Authorization": f"Bearer {key}",
                    "User-Agent": f"agent-{i}",
                    "X-Request-Id": f"x-{i}",
                }
                async with http.post(url, json=body, headers=headers) as reply:
                    await reply.read()
    series = scrape(running.metrics_port)
    appliance = {name: sets for name, sets in series.items() if name.startswith("appliance_")}
    for name, label_sets in appliance.items():
        for labels in label_sets:
            for key, value in labels:
                assert value in BOUNDS.get(key, {value}), (name, key, value)
    assert sum(len(sets) for sets in appliance.values()) < 200
    statuses = {dict(ls)["status"] for ls in series["appliance_requests_total"]}
    assert {
        "NOT_FOUND",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "INVALID_ARGUMENT",
        "OK",
    } <= statuses
    assert {"process_resident_memory_bytes", "process_open_fds"} <= set(series)
