"""The alerting rules are valid Prometheus rules and fire as their unit tests say (promtool), and
as the gateway's histograms make them fire (a real Prometheus scraping them)."""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.gateway.metrics import GatewayMetrics, MetricsSink
from appliance.gateway.report import RequestReport
from host_tuning import actions
from tests.observability.prometheus_server import Prometheus

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["check", "rules", "alerts.yml"], "12 rules found"),
        (["test", "rules", "alerts_test.yml"], "SUCCESS"),
    ],
)
def test_promtool(command: list[str], expected: str) -> None:
    out = subprocess.run(
        ["promtool", *command], cwd=MONITORING, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert expected in out.stdout


def _alert_expr(name: str) -> str:
    """The expression of the alert called `name` in alerts.yml: an `expr: |` block or one line."""
    text = (MONITORING / "alerts.yml").read_text()
    rule = re.search(rf"- alert: {name}\n((?:(?!\s+- alert:).*\n)+)", text)
    assert rule is not None, name
    block = re.search(r"^\s+expr: \|\n((?:\s{10}.*\n)+)", rule.group(1), re.M)
    if block is not None:
        return block.group(1)
    line = re.search(r"^\s+expr: (.+)$", rule.group(1), re.M)
    assert line is not None, name
    return line.group(1)


def test_the_host_tuning_alert_fires_on_the_statuses_that_fail_verify() -> None:
    """The drift alert names in its own words the statuses that make `host-tune verify` exit 1:
    a status added there must be added here."""
    found = re.search(r'status=~"([^"]+)"', _alert_expr("ApplianceHostTuningDrift"))
    assert found is not None
    assert set(found.group(1).split("|")) == set(actions.FAILING)


@contextlib.contextmanager
def _scraped(tmp_path: Path) -> Iterator[tuple[MetricsSink, Prometheus]]:
    """A gateway's metrics with a sink to report requests to, and a ready Prometheus scraping
    them."""
    metrics = GatewayMetrics()
    prom = Prometheus(tmp_path, {"gateway": f"127.0.0.1:{metrics.serve('127.0.0.1:0')}"})
    try:
        prom.wait_ready()
        yield MetricsSink(metrics), prom
    finally:
        prom.stop()
        metrics.close()


def test_the_ttft_alert_fires_on_the_histogram_only_past_its_budget(tmp_path: Path) -> None:
    """The alert's own expression over a real scrape: generations that all start within the 2 s
    budget raise nothing, a P99 past it does. histogram_quantile interpolates inside a bucket,
    so the budget must be a bucket's bound for the first half to hold."""
    expr = _alert_expr("ApplianceTTFTP99OverBudget")
    count = 'sum(appliance_time_to_first_token_seconds_count{tier="miss"})'
    with _scraped(tmp_path) as (sink, prom):

        def answered(n: int, ttft_s: float) -> None:
            for _ in range(n):
                sink.report(
                    RequestReport(model="tiny", finish_reason="stop", ttft_us=int(ttft_s * 1e6))
                )

        answered(1, 0.05)  # the series exist before the answers the rate is taken over
        prom.wait_value(count, 1)
        answered(200, 1.9)
        prom.wait_value(count, 201)
        assert prom.query(expr) == []
        answered(400, 2.2)
        prom.wait_value(count, 601)
        (firing,) = prom.query(expr)
        assert firing["metric"]["model"] == "tiny"


def test_the_error_alert_counts_the_servers_failures_not_the_clients_deadlines(
    tmp_path: Path,
) -> None:
    """The alert's own expression over a real scrape: requests that end at the deadline their
    clients set (a client with a 10 ms deadline) raise nothing, the engine failing does."""
    expr = _alert_expr("ApplianceErrorRatio")
    count = 'sum(appliance_requests_total{model="tiny"})'
    with _scraped(tmp_path) as (sink, prom):

        def ended(n: int, status: str) -> None:
            for _ in range(n):
                sink.report(RequestReport(model="tiny", status=status, deadline="client"))

        for status in ("OK", "DEADLINE_EXCEEDED", "CANCELLED", "UNAVAILABLE"):
            ended(1, status)  # the series exist before the requests the rate is taken over
        prom.wait_value(count, 4)
        ended(60, "OK")
        ended(30, "DEADLINE_EXCEEDED")
        ended(10, "CANCELLED")
        prom.wait_value(count, 104)
        assert prom.query(expr) == []
        ended(20, "UNAVAILABLE")
        prom.wait_value(count, 124)
        (firing,) = prom.query(expr)
        assert firing["metric"]["model"] == "tiny"


def test_the_error_alert_counts_the_models_own_deadline_as_the_servers_failure(
    tmp_path: Path,
) -> None:
    """Requests whose clients set no deadline and that ran out of the model's default one: the
    engine was too slow for the model's own budget, a server-side failure."""
    expr = _alert_expr("ApplianceErrorRatio")
    count = 'sum(appliance_requests_total{model="tiny"})'
    with _scraped(tmp_path) as (sink, prom):

        def ended(n: int, status: str, deadline: str) -> None:
            for _ in range(n):
                sink.report(RequestReport(model="tiny", status=status, deadline=deadline))

        ended(1, "OK", "model")
        ended(1, "DEADLINE_EXCEEDED", "model")
        prom.wait_value(count, 2)
        ended(60, "OK", "model")
        prom.wait_value(count, 62)
        assert prom.query(expr) == []
        ended(20, "DEADLINE_EXCEEDED", "model")
        prom.wait_value(count, 82)
        (firing,) = prom.query(expr)
        assert firing["metric"]["model"] == "tiny"


def test_the_stall_alert_fires_on_streams_that_stop_after_their_first_token(
    tmp_path: Path,
) -> None:
    """A generation that sends its first token and then nothing until the deadline: its gaps
    between tokens are none, its wait after the last token is the stall. Streams whose tokens
    keep coming raise nothing, whatever their status."""
    expr = _alert_expr("ApplianceGenerationStalls")
    count = 'sum(appliance_longest_token_wait_seconds_count{model="tiny"})'
    with _scraped(tmp_path) as (sink, prom):

        def streamed(n: int, status: str, gaps_s: list[float], tail_s: float) -> None:
            gaps = [int(g * 1e6) for g in gaps_s]
            for _ in range(n):
                ttft = 200_000
                sink.report(
                    RequestReport(
                        model="tiny",
                        status=status,
                        finish_reason="stop" if status == "OK" else "",
                        deadline="model",
                        ttft_us=ttft,
                        inter_token_us=gaps,
                        total_us=ttft + sum(gaps) + int(tail_s * 1e6),
                    )
                )

        streamed(1, "OK", [0.02] * 10, 0.001)
        prom.wait_value(count, 1)
        streamed(100, "OK", [0.02] * 50 + [1.5], 0.001)
        streamed(10, "CANCELLED", [0.02] * 5, 0.3)
        prom.wait_value(count, 111)
        assert prom.query(expr) == []
        streamed(5, "DEADLINE_EXCEEDED", [], 119.8)  # one token, then nothing until the deadline
        prom.wait_value(count, 116)
        (firing,) = prom.query(expr)
        assert firing["metric"]["model"] == "tiny"
