"""Prometheus metrics of the gateway, served on their own port by prometheus-client's HTTP thread.

Two kinds of series. Per-request facts (TTFT, inter-token gaps, end-to-end and queue time, outcomes,
tokens) are recorded once per request by MetricsSink, a report sink: a few dictionary lookups and
histogram observations on the event loop, nothing else. Everything that is already counted somewhere
(cache counters, admission gates, breakers, requests in flight) is read only when Prometheus scrapes,
by a collector: the request path pays nothing for it.

Names follow Prometheus conventions (base units, `_total` counters, `_seconds` histograms) under the
`appliance_` prefix; labels: `model` (the model the client asked for), `tier` (`miss`, `l1`, `l2`,
`semantic`), `status` (gRPC status name), `finish_reason`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from appliance.gateway.report import RequestReport

if TYPE_CHECKING:
    from appliance.admission import Admission
    from appliance.cache.tiers import TierCascade
    from appliance.gateway.models import ServedModel

log = logging.getLogger(__name__)

# Sub-millisecond cache hits up to multi-second generations.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
# Gaps between tokens: a GPU decodes one in a few ms, a CPU engine in tens.
GAP_BUCKETS = (
    0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


class GatewayMetrics:
    """The gateway's registry: per-request series and the scrape-time collector."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "appliance_time_to_first_token_seconds",
            "From arrival at the gateway to the first token sent to the client.",
            ("model", "tier"),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "appliance_inter_token_seconds",
            "Gaps between consecutive messages with tokens, as sent to the client.",
            ("model",),
            buckets=GAP_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "appliance_request_duration_seconds",
            "From arrival at the gateway to the final message (or the error).",
            ("model", "tier"),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "appliance_queue_seconds",
            "From arrival at the gateway until its generation started at the engine.",
            ("model",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "appliance_requests",
            "Finished requests by outcome.",
            ("model", "tier", "status", "finish_reason"),
            registry=r,
        )
        self.prompt_tokens = Counter(
            "appliance_prompt_tokens", "Prompt tokens of answered requests.", ("model",), registry=r
        )
        self.completion_tokens = Counter(
            "appliance_completion_tokens",
            "Completion tokens sent to clients.",
            ("model", "tier"),
            registry=r,
        )
        self.degraded = Counter(
            "appliance_degraded_answers",
            "Answers produced by a fallback model.",
            ("model", "answered_by"),
            registry=r,
        )
        self._server: object | None = None

    def watch(
        self,
        models: dict[str, ServedModel],
        admission: Admission,
        cache: TierCascade | None,
        in_flight: dict[str, int],
    ) -> None:
        """Registers the scrape-time collectors over the gateway's own state and the GPUs."""
        self.registry.register(_StateCollector(models, admission, cache, in_flight))
        self.registry.register(GpuCollector())

    def serve(self, listen: str) -> int:
        """Starts the /metrics HTTP listener in its own thread; returns the port."""
        host, _, port = listen.rpartition(":")
        server, thread = start_http_server(int(port), addr=host, registry=self.registry)
        self._server = server
        assert isinstance(thread, threading.Thread)
        bound: int = server.server_address[1]
        return bound

    def close(self) -> None:
        shutdown = getattr(self._server, "shutdown", None)
        if shutdown is not None:
            shutdown()


class GpuCollector(Collector):
    """GPU utilization, memory and power through NVML (nvidia-ml-py), read at scrape time.

    On a host without an NVIDIA driver NVML does not initialize and the collector yields nothing:
    no GPU series, no error."""

    NAMES = (
        "appliance_gpu_utilization_ratio",
        "appliance_gpu_memory_used_bytes",
        "appliance_gpu_memory_total_bytes",
        "appliance_gpu_power_watts",
    )

    def __init__(self) -> None:
        self._nvml: object | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as exc:  # no driver, no library: no GPU series
            log.debug("no GPU metrics: %s", exc)

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterable[GaugeMetricFamily]:
        nvml = self._nvml
        if nvml is None:
            return
        util, used, total, power = (
            GaugeMetricFamily(name, doc, labels=("gpu",))
            for name, doc in zip(
                self.NAMES,
                (
                    "GPU busy fraction over the driver's last sample period.",
                    "GPU memory in use.",
                    "GPU memory in all.",
                    "GPU power draw.",
                ),
                strict=True,
            )
        )
        try:
            for i in range(nvml.nvmlDeviceGetCount()):  # type: ignore[attr-defined]
                h = nvml.nvmlDeviceGetHandleByIndex(i)  # type: ignore[attr-defined]
                rates = nvml.nvmlDeviceGetUtilizationRates(h)  # type: ignore[attr-defined]
                memory = nvml.nvmlDeviceGetMemoryInfo(h)  # type: ignore[attr-defined]
                util.add_metric((str(i),), rates.gpu / 100)
                used.add_metric((str(i),), memory.used)
                total.add_metric((str(i),), memory.total)
                power.add_metric((str(i),), nvml.nvmlDeviceGetPowerUsage(h) / 1000)  # type: ignore[attr-defined]
        except Exception as exc:  # a GPU that fell off the bus: say so, keep serving
            log.warning("GPU metrics unavailable: %s", exc)
            return
        yield from (util, used, total, power)


class MetricsSink:
    """A report sink: one request's facts into the histograms and counters."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.m = metrics

    def report(self, r: RequestReport) -> None:
        m = self.m
        model = r.model or "unknown"
        m.requests.labels(model, r.tier, r.status, r.finish_reason or "none").inc()
        m.e2e.labels(model, r.tier).observe(r.total_us / 1e6)
        if r.status != "OK":
            return
        if r.ttft_us:
            m.ttft.labels(model, r.tier).observe(r.ttft_us / 1e6)
        if r.tier == "miss":
            m.queue.labels(model).observe(r.queue_us / 1e6)
        if r.inter_token_us:
            gaps = m.inter_token.labels(model)
            for gap in r.inter_token_us:
                gaps.observe(gap / 1e6)
        m.prompt_tokens.labels(model).inc(r.prompt_tokens)
        m.completion_tokens.labels(model, r.tier).inc(r.completion_tokens)
        if r.answered_by and r.answered_by != model:
            m.degraded.labels(model, r.answered_by).inc()


class _StateCollector(Collector):
    """Gauges and counters read from the gateway's state at scrape time."""

    def __init__(
        self,
        models: dict[str, ServedModel],
        admission: Admission,
        cache: TierCascade | None,
        in_flight: dict[str, int],
    ) -> None:
        self._models = models
        self._admission = admission
        self._cache = cache
        self._in_flight = in_flight

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        ready = GaugeMetricFamily(
            "appliance_engine_ready",
            "1 while the model's engine passes readiness checks and its breaker is not open.",
            labels=("model",),
        )
        breaker = GaugeMetricFamily(
            "appliance_engine_breaker_open",
            "1 while the model's breaker is open.",
            labels=("model",),
        )
        in_flight = GaugeMetricFamily(
            "appliance_requests_in_flight", "Requests the gateway is answering.", labels=("model",)
        )
        for name, model in self._models.items():
            ready.add_metric((name,), float(model.health.usable()))
            breaker.add_metric((name,), float(model.health.breaker.state == "open"))
            in_flight.add_metric((name,), float(self._in_flight.get(name, 0)))
        yield from (ready, breaker, in_flight)
        yield from _admission_series(self._admission)
        if self._cache is not None:
            yield from _cache_series(self._cache.counters())


def _admission_series(admission: Admission) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
    gates = getattr(admission, "gates", None)
    if not gates:
        return
    generating = GaugeMetricFamily(
        "appliance_engine_generating",
        "Generations holding a slot at the engine.",
        labels=("model",),
    )
    waiting = GaugeMetricFamily(
        "appliance_requests_waiting",
        "Requests waiting for a slot at the engine.",
        labels=("model",),
    )
    slots = GaugeMetricFamily(
        "appliance_engine_slots", "Generations the engine runs at once.", labels=("model",)
    )
    wait = GaugeMetricFamily(
        "appliance_estimated_wait_seconds",
        "Estimated wait of a request arriving now (a scaling signal).",
        labels=("model",),
    )
    refused = CounterMetricFamily(
        "appliance_admission_refused",
        "Requests refused at admission (budget or full line) or whose budget passed in line.",
        labels=("model", "reason"),
    )
    now = time.monotonic()
    for name, gate in gates.items():
        generating.add_metric((name,), len(gate.running))
        waiting.add_metric((name,), len(gate.waiting))
        slots.add_metric((name,), gate.slots)
        wait.add_metric((name,), gate.estimated_wait(now))
        refused.add_metric((name, "estimate"), gate.refused)
        refused.add_metric((name, "expired"), gate.expired)
    yield from (generating, waiting, slots, wait, refused)


# Cache counter name → (metric, labels) in Prometheus' naming.
_CACHE_COUNTERS = {
    "misses": "appliance_cache_misses",
    "not_cacheable": "appliance_cache_not_cacheable",
    "single_flight_followers": "appliance_cache_single_flight_followers",
    "writes": "appliance_cache_writes",
    "write_failures": "appliance_cache_write_failures",
    "l2_timeouts": "appliance_redis_timeouts",
    "l2_errors": "appliance_redis_errors",
    "l2_skipped_breaker_open": "appliance_redis_skipped_breaker_open",
    "l2_corrupt_entries": "appliance_redis_corrupt_entries",
    "breaker_opened": "appliance_redis_breaker_opened",
}
_CACHE_GAUGES = {
    "l1_entries": "appliance_cache_l1_entries",
    "l1_bytes": "appliance_cache_l1_bytes",
    "breaker_open": "appliance_redis_breaker_open",
}


def _cache_series(counters: dict[str, int]) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
    hits = CounterMetricFamily("appliance_cache_hits", "Cache hits by tier.", labels=("tier",))
    for key, value in counters.items():
        if key.endswith("_hits"):
            hits.add_metric((key.removesuffix("_hits"),), value)
        elif key in _CACHE_COUNTERS:
            yield CounterMetricFamily(_CACHE_COUNTERS[key], f"Cache counter {key}.", value=value)
        elif key in _CACHE_GAUGES:
            yield GaugeMetricFamily(_CACHE_GAUGES[key], f"Cache gauge {key}.", value=value)
    yield hits
