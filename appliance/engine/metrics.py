"""Prometheus metrics of the engine server, in the names Triton and its TensorRT-LLM backend use.

An operator's Triton dashboards and alerts read `nv_inference_*` (per model and version: request
success and failure counts, inference and execution counts, cumulative request, queue and compute
durations in microseconds, pending requests) and `nv_trt_llm_*` (KV-cache blocks by type, requests by
type). The engine server exports the same families from the statistics it already keeps for the
ModelStatistics RPC, read at scrape time: serving pays nothing for them. Triton serves them on its own
port (8002 by default); `appliance engine --metrics HOST:PORT` does the same.

As Triton counts them: `nv_inference_request_failure` by `reason` (REJECTED, CANCELED, BACKEND,
OTHER, every one from the start; a failure the engine reports for a request it ran is BACKEND, as
the TensorRT-LLM backend's is), `nv_inference_count` the successful requests (batch size 1 each),
`nv_inference_exec_count` every request that ended, failed ones too (the backend reports batch
statistics for them). The text is Prometheus' 0.0.4 format as Triton writes it: a counter's `# TYPE`
line names its samples, `nv_inference_count`, not `nv_inference_count_total`.

Guided decoding has no Triton family; its compiled-guide cache is exported as
`appliance_engine_guided_*` (Prometheus' naming: counters end in `_total` on the wire), per model
with a guided decoder: compiles (cache misses), cache hits, seconds spent compiling, and the
matchers of generations still running. Hit rate = hits / (hits + compiles).

Speculative decoding (`--speculative ngram|draft`) counts, per model, the draft tokens proposed to
verify steps and those accepted (`appliance_engine_spec_draft_tokens_total`,
`appliance_engine_spec_accepted_tokens_total`), the verify steps
(`appliance_engine_spec_verify_steps_total`) and the times a request's speculation switched itself
off for low acceptance (`appliance_engine_spec_switched_off_total`); acceptance rate = accepted /
proposed, accepted tokens per verify step = accepted / verify steps.

On a GPU (`--device cuda` or `cuda:N`) the page also has Triton's GPU families for the GPUs the
models run on, labelled `gpu_uuid` as Triton labels them: `nv_gpu_utilization` (0.0 to 1.0),
`nv_gpu_memory_total_bytes`, `nv_gpu_memory_used_bytes`, `nv_gpu_power_usage` and
`nv_gpu_power_limit` (watts), and the counter `nv_energy_consumption` (joules since the server
started), read through NVML at scrape time (a reading the GPU does not support, say power on a
vGPU, is left out). On the CPU, or where NVML does not start, there are none.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, ThreadingWSGIServer
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from appliance.engine.server import EngineModel, EngineService

log = logging.getLogger(__name__)
_LABELS = ("model", "version")
# Triton's `reason` label of nv_inference_request_failure; each is exported from the start.
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
# (family, help, ModelStatistics duration field)
_DURATIONS = (
    ("nv_inference_request_duration_us", "Cumulative inference request duration", "success"),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration", "queue"),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration",
        "compute_input",
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration",
        "compute_infer",
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration",
        "compute_output",
    ),
)


class _Counter:
    """A counter whose series carry Triton's exact names: prometheus-client's counter families
    add `_total` to every sample, and Triton's dashboards query `nv_inference_count`, not
    `nv_inference_count_total`."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...] = _LABELS) -> None:
        self.metric = Metric(name, doc, "counter")
        self._name = name
        self._labels = labels

    def add_metric(self, labels: tuple[str, ...], value: float) -> None:
        self.metric.add_sample(self._name, dict(zip(self._labels, labels, strict=True)), value)


class EngineCollector(Collector):
    def __init__(self, service: EngineService, models: dict[str, EngineModel]) -> None:
        self._service = service
        self._models = models

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterable[Metric]:
        success = _Counter(
            "nv_inference_request_success", "Number of successful inference requests"
        )
        failure = _Counter(
            "nv_inference_request_failure",
            "Number of failed inference requests",
            (*_LABELS, "reason"),
        )
        count = _Counter("nv_inference_count", "Number of inferences performed")
        execs = _Counter("nv_inference_exec_count", "Number of model executions performed")
        durations = [_Counter(name, doc) for name, doc, _ in _DURATIONS]
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            labels=_LABELS,
        )
        blocks = GaugeMetricFamily(
            "nv_trt_llm_kv_cache_block_metrics",
            "TRT LLM KV cache block metrics",
            labels=("model", "version", "kv_cache_block_type"),
        )
        requests = GaugeMetricFamily(
            "nv_trt_llm_request_metrics",
            "TRT LLM request metrics",
            labels=("model", "version", "request_type"),
        )
        pending_by_model = self._service.pending_by_model()
        for name, stats in self._service.statistics.items():
            labels = (name, "1")
            with stats.lock:
                success.add_metric(labels, stats.success.count)
                for reason in FAILURE_REASONS:
                    failed = stats.fail.count if reason == "BACKEND" else 0
                    failure.add_metric((*labels, reason), failed)
                count.add_metric(labels, stats.inference_count)
                execs.add_metric(labels, stats.execution_count)
                for family, (_, _, field) in zip(durations, _DURATIONS, strict=True):
                    family.add_metric(labels, getattr(stats, field).ns // 1000)
            waiting = pending_by_model.get(name, 0)
            pending.add_metric(labels, waiting)
            model = self._models.get(name)
            if model is None:
                continue
            runner = model.runner.stats
            active = 1 if runner.running is not None else 0
            requests.add_metric((*labels, "active"), active)
            requests.add_metric((*labels, "max"), 1)
            requests.add_metric((*labels, "waiting"), max(0, waiting - active))
            kv = runner.kv
            for kind, value in (
                ("tokens_per", kv.tokens_per_block),
                ("max", kv.max_blocks),
                ("used", kv.used_blocks),
                ("free", kv.free_blocks),
                ("reused", kv.reused_blocks),
                ("fraction", kv.used_blocks / kv.max_blocks if kv.max_blocks else 0.0),
            ):
                blocks.add_metric((*labels, kind), value)
        counters = (success, failure, count, execs, *durations)
        yield from (c.metric for c in counters)
        yield from (pending, blocks, requests)
        yield from self._guided()
        yield from self._speculative()

    def _speculative(self) -> Iterable[Metric]:
        drafts = CounterMetricFamily(
            "appliance_engine_spec_draft_tokens",
            "Draft tokens proposed to speculative verify steps.",
            labels=("model",),
        )
        accepted = CounterMetricFamily(
            "appliance_engine_spec_accepted_tokens",
            "Draft tokens accepted by speculative verify steps.",
            labels=("model",),
        )
        steps = CounterMetricFamily(
            "appliance_engine_spec_verify_steps",
            "Speculative verify steps (forward passes scoring drafts).",
            labels=("model",),
        )
        switched_off = CounterMetricFamily(
            "appliance_engine_spec_switched_off",
            "Times a request's speculation switched itself off for low acceptance.",
            labels=("model",),
        )
        for name, model in self._models.items():
            stats = model.runner.stats
            with stats.lock:
                drafts.add_metric((name,), stats.spec_draft_tokens)
                accepted.add_metric((name,), stats.spec_accepted_tokens)
                steps.add_metric((name,), stats.spec_verify_steps)
                switched_off.add_metric((name,), stats.spec_switched_off)
        yield from (drafts, accepted, steps, switched_off)

    def _guided(self) -> Iterable[Metric]:
        compiles = CounterMetricFamily(
            "appliance_engine_guided_compiles",
            "Guides compiled (compiled-guide cache misses).",
            labels=("model",),
        )
        hits = CounterMetricFamily(
            "appliance_engine_guided_cache_hits",
            "Guides served from the compiled-guide cache.",
            labels=("model",),
        )
        seconds = CounterMetricFamily(
            "appliance_engine_guided_compile_seconds",
            "Time spent compiling guides.",
            labels=("model",),
        )
        matchers = GaugeMetricFamily(
            "appliance_engine_guided_matchers",
            "Grammar matchers of guided generations still running.",
            labels=("model",),
        )
        for name, model in self._models.items():
            grammars = model.grammars
            if grammars is None:
                continue
            stats, active = grammars.snapshot()
            compiles.add_metric((name,), stats.compiles)
            hits.add_metric((name,), stats.hits)
            seconds.add_metric((name,), stats.compile_ns / 1e9)
            matchers.add_metric((name,), active)
        yield from (compiles, hits, seconds, matchers)


class GpuCollector(Collector):
    """Triton's GPU families for these GPUs (NVML UUIDs, `GPU-...`), read through NVML at scrape
    time. NVML is opened once, here; no GPUs, no driver or an unknown UUID: no GPU series (a
    warning says why), and the rest of the page is served."""

    # (family, help) as Triton's core registers them.
    FAMILIES = (
        ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)"),
        ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes"),
        ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes"),
        ("nv_gpu_power_usage", "GPU power usage in watts"),
        ("nv_gpu_power_limit", "GPU power management limit in watts"),
        # A counter; the rest are gauges.
        (
            "nv_energy_consumption",
            "GPU energy consumption in joules since the Triton Server started",
        ),
    )

    def __init__(self, uuids: Sequence[str]) -> None:
        self._nvml: Any = None
        self._handles: list[tuple[str, object]] = []
        self._unsupported: set[tuple[str, str]] = set()  # (GPU, family) said to have no reading
        # Per GPU, NVML's energy counter (millijoules since the driver loaded) when this server
        # started: nv_energy_consumption counts from there, as Triton's does.
        self._energy_start: dict[str, int] = {}
        if not uuids:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [(u, pynvml.nvmlDeviceGetHandleByUUID(u)) for u in uuids]
            self._nvml = pynvml
        except Exception as exc:  # no driver, no library, a GPU NVML does not know
            log.warning("no GPU metrics for %s: %s", ", ".join(uuids), exc)
            return
        for uuid, handle in self._handles:
            with contextlib.suppress(pynvml.NVMLError):  # none: counted from the first scrape
                self._energy_start[uuid] = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterable[Metric]:
        nvml = self._nvml
        if nvml is None:
            return
        util, total, used, power, limit = (
            GaugeMetricFamily(name, doc, labels=("gpu_uuid",)) for name, doc in self.FAMILIES[:5]
        )
        energy = _Counter(*self.FAMILIES[5], labels=("gpu_uuid",))
        try:
            for uuid, handle in self._handles:
                memory = self._read(uuid, total.name, nvml.nvmlDeviceGetMemoryInfo, handle)
                rates = self._read(uuid, util.name, nvml.nvmlDeviceGetUtilizationRates, handle)
                watts = self._read(uuid, power.name, nvml.nvmlDeviceGetPowerUsage, handle)
                cap = self._read(uuid, limit.name, nvml.nvmlDeviceGetPowerManagementLimit, handle)
                millijoules = self._read(
                    uuid, energy.metric.name, nvml.nvmlDeviceGetTotalEnergyConsumption, handle
                )
                if rates is not None:
                    util.add_metric((uuid,), rates.gpu / 100)
                if memory is not None:
                    total.add_metric((uuid,), memory.total)
                    used.add_metric((uuid,), memory.used)
                if watts is not None:
                    power.add_metric((uuid,), watts / 1000)
                if cap is not None:
                    limit.add_metric((uuid,), cap / 1000)
                if millijoules is not None:
                    energy.add_metric((uuid,), self._joules(uuid, millijoules))
        except Exception as exc:  # a GPU that fell off the bus: say so, serve the rest
            log.warning("GPU metrics unavailable: %s", exc)
            return
        yield from (f for f in (util, total, used, power, limit, energy.metric) if f.samples)

    def _joules(self, uuid: str, millijoules: int) -> float:
        """Energy used since the server started. NVML's counter restarts when the driver is
        reloaded: below the start, it counts from there again (a counter reset to Prometheus)."""
        start = self._energy_start.setdefault(uuid, millijoules)
        if millijoules < start:
            start = self._energy_start[uuid] = millijoules
        return (millijoules - start) / 1000

    def _read(self, uuid: str, family: str, query: Callable[[object], Any], handle: object) -> Any:
        """One NVML reading; None where this GPU does not support it (a vGPU guest has no power
        reading, for one), said once per GPU and family. Any other error is raised."""
        try:
            return query(handle)
        except self._nvml.NVMLError as exc:
            if exc.value != self._nvml.NVML_ERROR_NOT_SUPPORTED:
                raise
            if (uuid, family) not in self._unsupported:
                self._unsupported.add((uuid, family))
                log.warning("GPU %s: no %s (%s)", uuid, family, exc)
            return None


def gpu_uuids(models: Mapping[str, EngineModel]) -> list[str]:
    """The NVML UUIDs of the CUDA devices the models run on (none on the CPU)."""
    devices = {m.model.device for m in models.values()}
    indexes = sorted({d.index for d in devices if d.type == "cuda" and d.index is not None})
    if not indexes:
        return []
    import torch

    # CUDA writes the UUID bare (8-4-4-4-12 hex), NVML and Triton's label with a `GPU-` prefix.
    uuids = (str(torch.cuda.get_device_properties(i).uuid) for i in indexes)
    return [f"GPU-{u.removeprefix('GPU-')}" for u in uuids]


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format 0.0.4, as Triton writes it. prometheus-client's own
    writer names a counter `NAME_total` in `# HELP` and `# TYPE` whatever its samples are named:
    over Triton's `nv_inference_count` samples that leaves them untyped to a text-format parser.
    Here a counter's lines name its samples (the engine exports counters and gauges only)."""
    out: list[str] = []
    for metric in registry.collect():
        name = metric.name
        if metric.type == "counter" and all(s.name != name for s in metric.samples):
            name += "_total"
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n")
        for sample in metric.samples:
            labels = ",".join(
                f'{key}="{_label_value(value)}"' for key, value in sorted(sample.labels.items())
            )
            out.append(f"{sample.name}{{{labels}}} {float(sample.value)!r}\n")
    return "".join(out).encode()


def _label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged: one line each every few seconds would be most of the log."""


def serve_metrics(
    service: EngineService, models: dict[str, EngineModel], listen: str
) -> WSGIServer:
    """Starts the /metrics listener in its own thread; `server_address` has the bound port."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(service, models))
    registry.register(GpuCollector(gpu_uuids(models)))
    ProcessCollector(registry=registry)  # the process's memory, file descriptors, CPU seconds

    def app(environ: dict[str, Any], start: Callable[..., object]) -> list[bytes]:
        if environ.get("PATH_INFO") == "/favicon.ico":
            start("404 Not Found", [("Content-Type", "text/plain")])
            return [b""]
        body = exposition(registry)
        start("200 OK", [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)])
        return [body]

    host, _, port = listen.rpartition(":")
    family, _, _, _, address = socket.getaddrinfo(
        host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    server = make_server(str(address[0]), int(port), app, Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
