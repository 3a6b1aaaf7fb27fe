"""Prometheus metrics of the gateway, served on their own port by prometheus-client's HTTP thread.

Two kinds of series. Per-request facts (TTFT, inter-token gaps, end-to-end and queue time, outcomes,
tokens) are recorded once per request by MetricsSink, a report sink: a few dictionary lookups and
histogram observations on the event loop, nothing else. Everything that is already counted somewhere
(cache counters, admission gates, breakers, requests in flight) is read only when Prometheus scrapes,
by a collector: the request path pays nothing for it.

Names follow Prometheus conventions (base units, `_total` counters, `_seconds` histograms) under the
`appliance_` prefix, beside prometheus-client's `process_*` series of the gateway's process; labels:
`model` (the served model the client asked for, `unknown` before one is known), `tier` (`miss`, or
the name of the configured cache tier that answered: `l1`, `l2`, `semantic`, ...), `status` (gRPC
status name), `finish_reason`. Each takes its values from a fixed set whatever clients send
(tests/observability/test_label_bounds.py); `deadline` (`client` or `model`: whose deadline passed)
only on DEADLINE_EXCEEDED outcomes, empty (no label, to Prometheus) on the others.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from appliance.cache.tiers import HITS_METRIC
from appliance.gateway.report import RequestReport

if TYPE_CHECKING:
    from appliance.cache.tiers import TierCascade
    from appliance.gateway.admission import Admission, ModelGate
    from appliance.gateway.models import ServedModel

# Why the HTTP front end answered 403 before a request existed (the `reason` label of
# appliance_http_requests_refused_total): a Host that is no loopback name on a gateway without API
# keys on loopback (DNS rebinding), a browser's POST for a page of another origin.
REFUSED_HOST = "host"
REFUSED_CROSS_ORIGIN = "cross_origin"
HTTP_REFUSALS = (REFUSED_HOST, REFUSED_CROSS_ORIGIN)

# Sub-millisecond cache hits up to multi-second generations. 2 s is the TTFT budget of
# monitoring/alerts.yml: histogram_quantile interpolates inside a bucket, and without that bound
# TTFTs all under 2 s (in (1, 2.5]) read as a P99 near 2.5 s and raise the alert.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
# Gaps between tokens: a GPU decodes one in a few ms, a CPU engine in tens.
GAP_BUCKETS = (
    0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
# The longest wait of a stream for its next token: decode steps up to a stall that lasts until the
# deadline (the models' default is 120 s). 5 s is the stall bound of monitoring/alerts.yml.
WAIT_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


class Histograms:
    """One histogram family, by label values, recorded on the event loop thread.

    prometheus-client's Histogram takes a lock and a label lookup per observation, which was most
    of a cache hit's gateway time (bench/cache.py (g), docs/PERFORMANCE.md#cache-hits). Here an observation is a bisect and two
    additions; the one writer is the event loop, and a scrape copies the counts from its own thread
    (a scrape may see an observation's bucket before its sum: off by one sample, never corrupt).
    """

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], bounds: tuple[float, ...]):
        self.name, self.doc, self.labels, self.bounds = name, doc, labels, bounds
        # label values -> [count per bucket (+Inf last)..., sum]
        self.series: dict[tuple[str, ...], list[float]] = {}

    def child(self, *values: str) -> list[float]:
        found = self.series.get(values)
        if found is None:
            found = self.series[values] = [0.0] * (len(self.bounds) + 2)
        return found

    def observe(self, child: list[float], value: float) -> None:
        child[bisect.bisect_left(self.bounds, value)] += 1
        child[-1] += value

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for values, child in list(self.series.items()):
            counts = list(child)
            cumulative, buckets = 0.0, []
            for bound, n in zip((*self.bounds, math.inf), counts[:-1], strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == math.inf else repr(bound), cumulative))
            fam.add_metric(list(values), buckets, counts[-1])
        return fam


class Counters:
    """One counter family, by label values (the same one-writer rule as Histograms). A series is
    a one-element list, so a writer may hold on to it (MetricsSink binds them once)."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.series: dict[tuple[str, ...], list[float]] = {}

    def child(self, *values: str) -> list[float]:
        found = self.series.get(values)
        if found is None:
            found = self.series[values] = [0.0]
        return found

    def inc(self, values: tuple[str, ...], amount: float = 1.0) -> None:
        self.child(*values)[0] += amount

    def family(self) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for values, total in list(self.series.items()):
            fam.add_metric(list(values), total[0])
        return fam


class GatewayMetrics:
    """The gateway's registry: per-request series and the scrape-time collectors."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # process_resident_memory_bytes, process_open_fds, CPU seconds: read from /proc at scrape.
        ProcessSeries(registry=self.registry)
        self.ttft = Histograms(
            "appliance_time_to_first_token_seconds",
            "From arrival at the gateway to the first token sent to the client.",
            ("model", "tier"),
            LATENCY_BUCKETS,
        )
        self.inter_token = Histograms(
            "appliance_inter_token_seconds",
            "Gaps between consecutive messages with tokens, as sent to the client.",
            ("model",),
            GAP_BUCKETS,
        )
        self.longest_wait = Histograms(
            "appliance_longest_token_wait_seconds",
            "Per generated stream that sent a first token, whatever its outcome: its longest wait "
            "for the next message with tokens, or for its end after the last (a stream that "
            "stalls waits until its deadline).",
            ("model",),
            WAIT_BUCKETS,
        )
        self.e2e = Histograms(
            "appliance_request_duration_seconds",
            "From arrival at the gateway to the final message (or the error).",
            ("model", "tier"),
            LATENCY_BUCKETS,
        )
        self.queue = Histograms(
            "appliance_queue_seconds",
            "From arrival at the gateway until its generation started at the engine.",
            ("model",),
            LATENCY_BUCKETS,
        )
        self.requests = Counters(
            "appliance_requests",
            "Finished requests by outcome.",
            ("model", "tier", "status", "finish_reason", "front_end", "deadline"),
        )
        self.prompt_tokens = Counters(
            "appliance_prompt_tokens", "Prompt tokens of answered requests.", ("model",)
        )
        self.completion_tokens = Counters(
            "appliance_completion_tokens", "Completion tokens sent to clients.", ("model", "tier")
        )
        self.degraded = Counters(
            "appliance_degraded_answers",
            "Answers produced by a fallback model.",
            ("model", "answered_by"),
        )
        # Labelled by the model that generated the answer (a fallback's prefix cache and drafts
        # are its own).
        self.cached_prompt_tokens = Counters(
            "appliance_cached_prompt_tokens",
            "Prompt tokens of generated answers the engine took from its prefix cache instead of "
            "computing them (reused KV blocks).",
            ("model",),
        )
        self.draft_tokens = Counters(
            "appliance_spec_draft_tokens",
            "Speculative draft tokens proposed to the verify steps of generated answers.",
            ("model",),
        )
        self.accepted_draft_tokens = Counters(
            "appliance_spec_accepted_draft_tokens",
            "Speculative draft tokens the model accepted (completion tokens without a step of "
            "their own).",
            ("model",),
        )
        self.http_connections_refused = Counters(
            "appliance_http_connections_refused",
            "HTTP connections answered 503 and closed as accepted: the HTTP API held its "
            "[http] max_connections.",
            (),
        )
        self.http_connections_refused.child()  # 0 from the start, not absent until the first
        self.http_requests_refused = Counters(
            "appliance_http_requests_refused",
            "HTTP requests answered 403 by the HTTP API before they became requests, by reason: "
            "host (a Host that is no loopback name, without API keys on loopback), cross_origin "
            "(a browser's POST for a page of another origin).",
            ("reason",),
        )
        for reason in HTTP_REFUSALS:
            self.http_requests_refused.child(reason)
        self.registry.register(
            _FamiliesCollector(
                (self.ttft, self.inter_token, self.longest_wait, self.e2e, self.queue),
                (
                    self.http_connections_refused,
                    self.http_requests_refused,
                    self.requests,
                    self.prompt_tokens,
                    self.completion_tokens,
                    self.degraded,
                    self.cached_prompt_tokens,
                    self.draft_tokens,
                    self.accepted_draft_tokens,
                ),
            )
        )
        self._server: object | None = None

    def watch(
        self,
        models: dict[str, ServedModel],
        admission: Admission,
        cache: TierCascade | None,
        in_flight: dict[str, int],
    ) -> None:
        """Registers the scrape-time collector over the gateway's own state. GPU series come
        from the inference server's page (Triton's, or the engine server's): the gateway's unit
        hides every device from it."""
        self.registry.register(_StateCollector(models, admission, cache, in_flight))

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


class ProcessSeries(ProcessCollector):
    """prometheus-client's process_* series, also where /proc shows processes only: the gateway's
    unit mounts it with ProcSubset=pid, which hides /proc/stat, whose boot time prometheus-client
    adds to a process's start and without which it exports none of the series. The boot time
    comes from the clocks instead (what the kernel writes as btime)."""

    def _boot_time(self) -> float:
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


class _Bound:
    """The series one kind of finished request writes to (model, tier, status, finish reason,
    front end, deadline), looked up once: each is made when first written, as an unbound write
    would."""

    __slots__ = (
        "completion",
        "e2e",
        "inter_token",
        "longest_wait",
        "prompt",
        "queue",
        "requests",
        "ttft",
    )

    def __init__(
        self,
        m: GatewayMetrics,
        model: str,
        tier: str,
        status: str,
        finish: str,
        front: str,
        deadline: str,
    ):
        self.requests = m.requests.child(model, tier, status, finish, front, deadline)
        self.e2e = m.e2e.child(model, tier)
        self.longest_wait: list[float] | None = None
        self.ttft: list[float] | None = None
        self.queue: list[float] | None = None
        self.inter_token: list[float] | None = None
        self.prompt: list[float] | None = None
        self.completion: list[float] | None = None


class MetricsSink:
    """A report sink: one request's facts into the histograms and counters."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.m = metrics
        # Bounded: models x tiers x status names x finish reasons x front ends x deadlines.
        self._bound: dict[tuple[str, str, str, str, str, str], _Bound] = {}

    def report(self, r: RequestReport) -> None:
        m = self.m
        model = r.model
        deadline = r.deadline if r.status == "DEADLINE_EXCEEDED" else ""
        key = (model, r.tier, r.status, r.finish_reason or "none", r.front_end, deadline)
        s = self._bound.get(key)
        if s is None:
            s = self._bound[key] = _Bound(m, *key)
        s.requests[0] += 1
        m.e2e.observe(s.e2e, r.total_us / 1e6)
        if r.ttft_us and r.tier == "miss":
            if s.longest_wait is None:
                s.longest_wait = m.longest_wait.child(model)
            m.longest_wait.observe(s.longest_wait, longest_wait_us(r) / 1e6)
        if r.status != "OK":
            return
        if r.ttft_us:
            if s.ttft is None:
                s.ttft = m.ttft.child(model, r.tier)
            m.ttft.observe(s.ttft, r.ttft_us / 1e6)
        if r.tier == "miss":
            if s.queue is None:
                s.queue = m.queue.child(model)
            m.queue.observe(s.queue, r.queue_us / 1e6)
        if r.inter_token_us:
            if s.inter_token is None:
                s.inter_token = m.inter_token.child(model)
            gaps = s.inter_token
            bounds = m.inter_token.bounds
            for gap in r.inter_token_us:
                seconds = gap / 1e6
                gaps[bisect.bisect_left(bounds, seconds)] += 1
                gaps[-1] += seconds
        if s.prompt is None:
            s.prompt = m.prompt_tokens.child(model)
            s.completion = m.completion_tokens.child(model, r.tier)
        s.prompt[0] += r.prompt_tokens
        assert s.completion is not None
        s.completion[0] += r.completion_tokens
        if r.answered_by and r.answered_by != model:
            m.degraded.inc((model, r.answered_by))
        if r.cached_tokens:
            m.cached_prompt_tokens.inc((r.answered_by or model,), r.cached_tokens)
        if r.draft_tokens:
            drafter = (r.answered_by or model,)
            m.draft_tokens.inc(drafter, r.draft_tokens)
            m.accepted_draft_tokens.inc(drafter, r.accepted_draft_tokens)


def longest_wait_us(r: RequestReport) -> int:
    """The longest wait of a stream that sent a first token: between two messages with tokens, or
    from the last one to the request's end (the final message, the error, the deadline)."""
    gaps = r.inter_token_us
    after_last = r.total_us - r.ttft_us - sum(gaps)
    return max(after_last, max(gaps, default=0), 0)


class _FamiliesCollector(Collector):
    def __init__(self, histograms: tuple[Histograms, ...], counters: tuple[Counters, ...]) -> None:
        self._histograms = histograms
        self._counters = counters

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterable[HistogramMetricFamily | CounterMetricFamily]:
        for h in self._histograms:
            yield h.family()
        for c in self._counters:
            yield c.family()


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
        yield from _gauges_by_model(
            _MODEL_GAUGES,
            {name: (model, self._in_flight.get(name, 0)) for name, model in self._models.items()},
        )
        yield from _admission_series(self._admission)
        if self._cache is not None:
            yield from _cache_series(self._cache)


_T = TypeVar("_T")

# One gauge family per row, one series per model: (name, help, value of the model's state).
_GaugeTable = tuple[tuple[str, str, Callable[[_T], float]], ...]

_MODEL_GAUGES: _GaugeTable[tuple[ServedModel, int]] = (
    (
        "appliance_engine_ready",
        "1 while the model's engine passes readiness checks and its breaker is not open.",
        lambda s: float(s[0].health.usable()),
    ),
    (
        "appliance_engine_breaker_open",
        "1 while the model's breaker is open.",
        lambda s: float(s[0].health.breaker.state == "open"),
    ),
    ("appliance_requests_in_flight", "Requests the gateway is answering.", lambda s: float(s[1])),
)

_GATE_GAUGES: _GaugeTable[tuple[ModelGate, float]] = (
    (
        "appliance_engine_generating",
        "Generations holding a slot at the engine.",
        lambda g: len(g[0].running),
    ),
    (
        "appliance_requests_waiting",
        "Requests waiting for a slot at the engine.",
        lambda g: len(g[0].waiting),
    ),
    ("appliance_engine_slots", "Generations the engine runs at once.", lambda g: g[0].slots),
    (
        "appliance_estimated_wait_seconds",
        "Estimated wait of a request arriving now (a scaling signal).",
        lambda g: g[0].estimated_wait(g[1]),
    ),
)


def _gauges_by_model(table: _GaugeTable[_T], states: dict[str, _T]) -> Iterable[GaugeMetricFamily]:
    for name, doc, value in table:
        family = GaugeMetricFamily(name, doc, labels=("model",))
        for model, state in states.items():
            family.add_metric((model,), value(state))
        yield family


def _admission_series(admission: Admission) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
    gates = getattr(admission, "gates", None)
    if not gates:
        return
    now = time.monotonic()
    yield from _gauges_by_model(_GATE_GAUGES, {name: (gate, now) for name, gate in gates.items()})
    refused = CounterMetricFamily(
        "appliance_admission_refused",
        "Requests refused at admission (budget or full line) or whose budget passed in line.",
        labels=("model", "reason"),
    )
    for name, gate in gates.items():
        refused.add_metric((name, "estimate"), gate.refused)
        refused.add_metric((name, "expired"), gate.expired)
    yield refused


def _cache_series(cache: TierCascade) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
    """The cache's numbers as the configured tiers declare them (TierCascade.describe), and one
    hits family labelled by tier."""
    counters = cache.counters()
    for key, series in cache.describe().items():
        family = GaugeMetricFamily if series.gauge else CounterMetricFamily
        yield family(series.metric, series.help, value=counters.get(key, 0))
    hits = CounterMetricFamily(HITS_METRIC, "Cache hits by tier.", labels=("tier",))
    for tier, value in list(cache.metrics.hits.items()):
        hits.add_metric((tier,), value)
    yield hits
