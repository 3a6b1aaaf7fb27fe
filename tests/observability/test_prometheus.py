"""A real Prometheus scrapes the gateway while it answers; PromQL over its HTTP API sees the
request counters and the TTFT histogram the clients saw, and the semantic tier's state."""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import json
import re
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.cache.l2 import RedisSettings
from appliance.config import CacheConfig, MetricsConfig, SemanticConfig
from appliance.engine import metrics as engine_metrics
from appliance.engine.metrics import serve_metrics
from appliance.gateway.metrics import LATENCY_BUCKETS
from appliance.gateway.models import load_models
from appliance.gateway.report import RequestReport
from appliance.gateway.server import RunningGateway, start_server
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from host_tuning import textfile
from tests.cache.redis_server import RedisServer
from tests.cache.test_semantic_e2e import PARAPHRASE, QUESTION
from tests.conftest import Engine, Tiny
from tests.observability.conftest import UUID
from tests.observability.prometheus_server import Prometheus
from tests.support import gateway_config, until_async

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
ROLES = MONITORING.parent / "ansible/roles"


class Reports:
    def __init__(self) -> None:
        self.items: list[RequestReport] = []

    def report(self, r: RequestReport) -> None:
        self.items.append(dataclasses.replace(r))


@pytest.fixture
async def gateway(
    tiny: Tiny, engine: Engine, tmp_path: Path, embedder_dir: Path
) -> AsyncIterator[tuple[RunningGateway, Reports]]:
    """Every tier on: L1, L2 on a real redis-server, the semantic tier for namespace "sem"."""
    redis = RedisServer(tmp_path)
    redis.start()
    semantic = SemanticConfig(
        enabled=True, namespaces=("sem",), embedder_dir=embedder_dir, follow_block_ms=100
    )
    config = gateway_config(
        tiny.tokenizer_dir,
        engine.address,
        cache=CacheConfig(
            redis=RedisSettings(url=redis.url, timeout_ms=100, mac_key=b"k" * 32),
            semantic=semantic,
        ),
        metrics=MetricsConfig(listen="127.0.0.1:0"),
    )
    reports = Reports()
    running = await start_server(config, await load_models(config), reports)
    yield running, reports
    await running.drain(0.5)
    redis.kill()


def exported_names(port: int) -> set[str]:
    """Every series name a /metrics page on this port exposes (with _bucket, _total, ...
    suffixes)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        for suffix in ("_total", "_bucket", "_sum", "_count", "_created"):
            names.add(family.name + suffix)
        names.update(sample.name for sample in family.samples)
    return names


def role_mark() -> str:
    """The textfile the host_tuning role writes to mark a host whose drift check reports."""
    tasks = (ROLES / "host_tuning/tasks/main.yml").read_text()
    (block,) = re.findall(
        r"^    content: \|\n((?:      .*\n)+)    dest: .+/appliance-host-tune-expected\.prom\"$",
        tasks,
        re.M,
    )
    return "".join(line[6:] + "\n" for line in block.splitlines())


def referenced_names(text: str) -> set[str]:
    return set(re.findall(r"\b((?:appliance|nv)_[a-z0-9_]+)", text))


async def test_dashboard_and_alerts_use_only_exported_metrics(
    gateway: tuple[RunningGateway, Reports],
    engine: Engine,
    nvml: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every name a panel or an alert reads is on a page the role's scrape targets serve: the
    gateway's, and the inference server's (here the engine server's, on a GPU that NVML is
    faked for; Triton's GPU families have the same names). The gateway's unit hides every
    device, so a GPU series can only come from the inference server."""
    running, _ = gateway
    exported = exported_names(running.metrics_port)
    monkeypatch.setattr(engine_metrics, "gpu_uuids", lambda models: [UUID])
    inference = serve_metrics(engine.service, engine.models, "127.0.0.1:0")
    try:
        exported |= exported_names(inference.server_address[1])
    finally:
        inference.shutdown()
        inference.server_close()
    # What host-tune verify writes for node_exporter's textfile collector, and the host_tuning
    # role's mark beside it.
    exported |= referenced_names(textfile.exposition([], 0, 0.0).decode())
    exported |= {family.name for family in text_string_to_metric_families(role_mark())}
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    exprs += " " + " ".join(v.get("query", "") for v in dashboard["templating"]["list"])
    used = referenced_names(exprs) | referenced_names((MONITORING / "alerts.yml").read_text())
    assert len(used) > 15
    assert used <= exported, sorted(used - exported)


async def test_prometheus_sees_requests_and_ttft(
    gateway: tuple[RunningGateway, Reports], engine: Engine, tmp_path: Path
) -> None:
    running, reports = gateway
    assert running.metrics_port
    engine_metrics = serve_metrics(engine.service, engine.models, "127.0.0.1:0")
    prom = Prometheus(
        tmp_path,
        {
            "gateway": f"127.0.0.1:{running.metrics_port}",
            "engine": f"127.0.0.1:{engine_metrics.server_address[1]}",
        },
    )
    try:
        # Prometheus is waited on from threads: the gateway and the engine server share this
        # event loop, and a loop blocked for seconds would fail the engine's health probe.
        await asyncio.to_thread(prom.wait_ready)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            for i in range(12):  # 12 misses, then each asked again: 12 L1 hits
                r = pb.GenerateRequest(
                    model="tiny", prompt=f"question {i}", max_tokens=6, temperature=0
                )
                await stub.Complete(r)
                await stub.Complete(r)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Complete(pb.GenerateRequest(model="tiny", prompt="x", top_p=5))
        await asyncio.to_thread(_check_scraped, prom, reports, engine)
    finally:
        prom.stop()
        engine_metrics.shutdown()


def _check_scraped(prom: Prometheus, reports: Reports, engine: Engine) -> None:
    """What Prometheus scraped matches what the requests reported and the engine counted."""
    prom.wait_value("sum(appliance_requests_total)", 25)
    by_tier = {
        (s["metric"]["tier"], s["metric"]["status"]): float(s["value"][1])
        for s in prom.query("sum by (tier, status) (appliance_requests_total)")
    }
    assert by_tier == {("miss", "OK"): 12, ("l1", "OK"): 12, ("miss", "INVALID_ARGUMENT"): 1}
    hits = prom.query('appliance_cache_hits_total{tier="l1"}')
    assert float(hits[0]["value"][1]) == 12
    tokens = sum(r.completion_tokens for r in reports.items if r.tier == "miss")
    prom.wait_value('sum(appliance_completion_tokens_total{tier="miss"})', tokens)

    # histogram_quantile interpolates inside the bucket that holds the quantile: it must land
    # in the same bucket as the P99 of the TTFTs the requests themselves reported.
    ttfts = [r.ttft_us / 1e6 for r in reports.items if r.tier == "miss" and r.status == "OK"]
    true_p99 = float(np.percentile(ttfts, 99, method="inverted_cdf"))
    i = bisect.bisect_left(LATENCY_BUCKETS, true_p99)
    low = LATENCY_BUCKETS[i - 1] if i else 0.0
    high = LATENCY_BUCKETS[i]
    result = prom.query(
        "histogram_quantile(0.99, sum by (le) "
        '(appliance_time_to_first_token_seconds_bucket{tier="miss"}))'
    )
    estimate = float(result[0]["value"][1])
    assert low <= estimate <= high, (estimate, true_p99, low, high)
    scraped_state = {
        name: prom.query(f'{name}{{model="tiny"}}')[0]["value"][1]
        for name in (
            "appliance_engine_ready",
            "appliance_engine_breaker_open",
            "appliance_requests_in_flight",
            "appliance_engine_slots",
            "appliance_engine_generating",
            "appliance_requests_waiting",
        )
    }
    assert scraped_state == {
        "appliance_engine_ready": "1",
        "appliance_engine_breaker_open": "0",
        "appliance_requests_in_flight": "0",
        "appliance_engine_slots": "1",
        "appliance_engine_generating": "0",
        "appliance_requests_waiting": "0",
    }

    # The engine server, in Triton's names: every generation the gateway sent it succeeded.
    served = engine.service.statistics["tensorrt_llm"].success.count
    assert served >= 12
    prom.wait_value('nv_inference_request_success{job="engine",model="tensorrt_llm"}', served)
    prom.wait_value('nv_inference_pending_request_count{model="tensorrt_llm"}', 0)
    queue = prom.query('nv_inference_queue_duration_us{model="tensorrt_llm"}')
    assert float(queue[0]["value"][1]) > 0
    kinds = {
        s["metric"]["kv_cache_block_type"]
        for s in prom.query('nv_trt_llm_kv_cache_block_metrics{model="tensorrt_llm"}')
    }
    assert {"max", "used", "free", "reused", "tokens_per", "fraction"} <= kinds


async def test_prometheus_sees_the_semantic_tier(
    gateway: tuple[RunningGateway, Reports], tmp_path: Path
) -> None:
    running, _ = gateway
    cache = running.pipeline.cache
    assert cache is not None

    async def counters_reach(name: str, value: int) -> None:
        await until_async(
            lambda: cache.counters()[name] == value, f"{name} never reached {value}", 20.0, 0.02
        )

    await counters_reach("semantic_in_sync", 1)
    prom = Prometheus(tmp_path, {"gateway": f"127.0.0.1:{running.metrics_port}"})
    try:
        await asyncio.to_thread(prom.wait_ready)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            for text in (QUESTION, PARAPHRASE):
                answer = await stub.Complete(
                    pb.GenerateRequest(
                        model="tiny",
                        namespace="sem",
                        prompt=text,
                        max_tokens=6,
                        temperature=0,
                        semantic_cache=True,
                    )
                )
                await counters_reach("semantic_stored", 1)
            assert answer.final.cache_tier == pb.CACHE_TIER_SEMANTIC
        for promql, value in (
            ("appliance_semantic_in_sync", 1),
            ("appliance_semantic_entries", 1),
            ("appliance_semantic_stored_total", 1),
            ("appliance_semantic_lookups_total", 2),
            ('appliance_cache_hits_total{tier="semantic"}', 1),
            ("appliance_semantic_embeddings_cancelled_total", 0),
        ):
            # From a thread: the gateway's loop keeps following Redis meanwhile (in step).
            await asyncio.to_thread(prom.wait_value, promql, value)
        assert float(prom.query("appliance_semantic_bytes")[0]["value"][1]) > 0
    finally:
        prom.stop()
