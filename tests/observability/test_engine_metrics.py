"""The engine server's /metrics and ModelStatistics count a failed request as Triton does: a
failure by reason (a backend's is BACKEND; REJECTED, CANCELED and OTHER are there at 0), an
execution (the TensorRT-LLM backend reports batch statistics for it), and no inference
(Triton's inference count grows with successes only)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.engine.metrics import FAILURE_REASONS, serve_metrics
from tests.conftest import Engine
from tests.engine.test_conformance import MODEL, collect, request

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def scrape(engine: Engine) -> Iterator[tuple[str, dict[str, str]]]:
    server = serve_metrics(engine.service, engine.models, "127.0.0.1:0")
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics", {}
    server.shutdown()


def samples(url: str) -> tuple[Samples, dict[str, str]]:
    """The model's samples by (family, labels) (the engine's families have one sample each per
    label set), and each family's type as a text-format parser reads it."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    types, found = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            if s.labels.get("model") == MODEL:
                found[family.name, tuple(sorted(s.labels.items()))] = s.value
    return found, types


def value(found: Samples, name: str, **labels: str) -> float:
    return found[name, tuple(sorted({"model": MODEL, "version": "1", **labels}.items()))]


async def statistics(triton: ts_grpc.GRPCInferenceServiceStub) -> ts.ModelStatistics:
    reply = await triton.ModelStatistics(ts.ModelStatisticsRequest(name=MODEL))
    return reply.model_stats[0]


async def test_a_backend_failure_counts_as_tritons_does(
    engine: Engine,
    triton: ts_grpc.GRPCInferenceServiceStub,
    scrape: tuple[str, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, _ = scrape
    await collect(triton, request("fine", max_tokens=2))
    before, rpc_before = samples(url)[0], await statistics(triton)

    def fail(job: object) -> None:
        raise RuntimeError("injected")

    with monkeypatch.context() as patch:
        patch.setattr(engine.models[MODEL].runner, "_run", fail)
        (failed,) = await collect(triton, request("doomed"))
    assert failed.error_message == "engine failure: injected"
    after, types = samples(url)
    rpc_after = await statistics(triton)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    triton_counters = (
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_request_duration_us",
    )
    assert types["process_resident_memory_bytes"] == "gauge"
    assert {name: types.get(name) for name in triton_counters} == dict.fromkeys(
        triton_counters, "counter"
    )
    assert {r: grew("nv_inference_request_failure", reason=r) for r in FAILURE_REASONS} == {
        "REJECTED": 0,
        "CANCELED": 0,
        "BACKEND": 1,
        "OTHER": 0,
    }
    assert grew("nv_inference_request_success") == 0
    assert grew("nv_inference_count") == 0
    assert grew("nv_inference_exec_count") == 1
    assert rpc_after.inference_count == rpc_before.inference_count
    assert rpc_after.execution_count == rpc_before.execution_count + 1
    assert rpc_after.inference_stats.fail.count == rpc_before.inference_stats.fail.count + 1
    assert value(after, "nv_inference_count") == rpc_after.inference_count
    assert value(after, "nv_inference_exec_count") == rpc_after.execution_count
