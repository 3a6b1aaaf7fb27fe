"""The engine server's /metrics and ModelStatistics count a failed request as Triton does: a
failure by reason (a backend's is BACKEND; REJECTED, CANCELED and OTHER are there at 0), an
execution (the TensorRT-LLM backend reports batch statistics for it), and no inference
(Triton's inference count grows with successes only). On a GPU the page has Triton's GPU
families, read through NVML."""

from __future__ import annotations

import logging
import types
import urllib.request
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.engine import metrics as engine_metrics
from appliance.engine.metrics import (
    FAILURE_REASONS,
    GpuCollector,
    exposition,
    gpu_uuids,
    serve_metrics,
)
from tests.conftest import Engine
from tests.engine.test_conformance import MODEL, collect, request
from tests.observability.conftest import UUID

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


# Triton's GPU families (triton-inference-server/core src/metrics.cc), one series per GPU by
# `gpu_uuid`: what Triton dashboards, and this repository's, query.
TRITON_GPU_FAMILIES = {
    "nv_gpu_utilization": "gauge",
    "nv_gpu_memory_total_bytes": "gauge",
    "nv_gpu_memory_used_bytes": "gauge",
    "nv_gpu_power_usage": "gauge",
    "nv_gpu_power_limit": "gauge",
    "nv_energy_consumption": "counter",
}


def page(registry: CollectorRegistry) -> dict[str, tuple[str, dict[str, float]]]:
    """family -> (type, {gpu_uuid: value}) of the exposition's GPU families."""
    found: dict[str, tuple[str, dict[str, float]]] = {}
    for family in text_string_to_metric_families(exposition(registry).decode()):
        if family.name in TRITON_GPU_FAMILIES:
            found[family.name] = (
                family.type,
                {s.labels["gpu_uuid"]: s.value for s in family.samples},
            )
    return found


def test_a_gpu_is_exported_in_tritons_names_and_units(nvml: dict[str, int]) -> None:
    registry = CollectorRegistry()
    registry.register(GpuCollector([UUID]))
    assert page(registry) == {
        "nv_gpu_utilization": ("gauge", {UUID: 0.37}),
        "nv_gpu_memory_total_bytes": ("gauge", {UUID: float(141 << 30)}),
        "nv_gpu_memory_used_bytes": ("gauge", {UUID: float(20 << 30)}),
        "nv_gpu_power_usage": ("gauge", {UUID: 412.5}),
        "nv_gpu_power_limit": ("gauge", {UUID: 700.0}),
        # Joules since the server started: the counter NVML keeps since the driver loaded, less
        # its reading when the collector was made.
        "nv_energy_consumption": ("counter", {UUID: 0.0}),
    }
    assert {name for name, _ in GpuCollector.FAMILIES} == set(TRITON_GPU_FAMILIES)
    nvml["energy_mj"] += 250_500
    assert page(registry)["nv_energy_consumption"] == ("counter", {UUID: 250.5})
    assert b"\nnv_energy_consumption{" in exposition(registry)  # Triton's name, no _total
    assert nvml["init"] == 1  # once, not per scrape


def test_no_gpu_or_no_driver_exports_no_gpu_series(
    nvml: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pynvml

    cpu = CollectorRegistry()
    cpu.register(GpuCollector([]))
    assert page(cpu) == {}
    assert nvml["init"] == 0  # an engine on the CPU never opens the driver

    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    missing = CollectorRegistry()
    missing.register(GpuCollector([UUID]))
    assert page(missing) == {}


def test_a_gpu_that_fails_a_read_leaves_the_rest_of_the_page(
    nvml: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pynvml

    registry = CollectorRegistry()
    registry.register(GpuCollector([UUID]))

    def lost(h: object) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", lost)
    assert page(registry) == {}


def test_a_reading_the_gpu_does_not_support_leaves_its_other_series(
    nvml: dict[str, int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A GPU that has no power reading (a vGPU guest, some boards) still has its utilization and
    # memory, as on Triton's page; the missing reading is said once, not at every scrape.
    import pynvml

    def unsupported(h: object) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    for name in (
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetPowerManagementLimit",
        "nvmlDeviceGetTotalEnergyConsumption",  # no energy counter before Volta
    ):
        monkeypatch.setattr(pynvml, name, unsupported)
    registry = CollectorRegistry()
    registry.register(GpuCollector([UUID]))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert page(registry) == {
                "nv_gpu_utilization": ("gauge", {UUID: 0.37}),
                "nv_gpu_memory_total_bytes": ("gauge", {UUID: float(141 << 30)}),
                "nv_gpu_memory_used_bytes": ("gauge", {UUID: float(20 << 30)}),
            }
    for family in ("nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption"):
        assert len([r for r in caplog.records if family in r.getMessage()]) == 1, family


def test_the_gpus_are_those_the_models_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cuda:1` is the GPU whose UUID CUDA reports for index 1; NVML names it with a `GPU-`
    prefix, as Triton's label does. CPU models name none."""
    seen: list[int] = []

    def properties(index: int) -> object:
        seen.append(index)
        return types.SimpleNamespace(uuid=UUID.removeprefix("GPU-"))

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)

    def on(device: str) -> object:
        return types.SimpleNamespace(model=types.SimpleNamespace(device=torch.device(device)))

    assert gpu_uuids({"a": on("cpu")}) == []  # type: ignore[dict-item]
    assert seen == []
    assert gpu_uuids({"a": on("cuda:1"), "b": on("cuda:1")}) == [UUID]  # type: ignore[dict-item]
    assert seen == [1]


def test_the_engine_page_has_its_gpus(
    engine: Engine, nvml: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`appliance engine --metrics` on a GPU: its page carries the GPU families beside
    nv_inference_*; on the CPU (the test engine) none."""
    families = _served_families(engine)
    assert "nv_inference_count" in families
    assert not any(name in TRITON_GPU_FAMILIES for name in families)
    monkeypatch.setattr(engine_metrics, "gpu_uuids", lambda models: [UUID])
    assert {n: t for n, t in _served_families(engine).items() if n in TRITON_GPU_FAMILIES} == (
        TRITON_GPU_FAMILIES
    )


def _served_families(engine: Engine) -> dict[str, str]:
    server = serve_metrics(engine.service, engine.models, "127.0.0.1:0")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    return {f.name: f.type for f in text_string_to_metric_families(text)}
