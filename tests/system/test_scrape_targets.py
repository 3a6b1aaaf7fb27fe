"""What the appliance role tells Prometheus to scrape: the gateway's page and the inference
server's own (Triton's metrics port on GPU hosts, the engine server's --metrics on CPU hosts),
both in the file_sd file the scrape job in monitoring/prometheus-scrape.yml reads."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from appliance.cliargs import listen_address
from appliance.engine import metrics as engine_metrics
from appliance.engine.metrics import serve_metrics
from appliance.gateway.metrics import GatewayMetrics
from tests.conftest import Engine
from tests.observability.conftest import UUID, nvml  # noqa: F401 (the fixture)
from tests.observability.prometheus_server import Prometheus
from tests.observability.test_alerts import _alert_expr
from tests.support import until
from tests.system.test_gateway_template import _render

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "ansible/roles/appliance"
MONITORING = REPO / "monitoring"


def _targets(tmp_path: Path, variables: dict[str, object]) -> list[dict[str, object]]:
    text = _render(tmp_path, variables, "prometheus-targets.yml.j2").read_text()
    # JSON after the header's comments (JSON is YAML, which file_sd reads from a .yml file).
    groups = json.loads("".join(line for line in text.splitlines(True) if line[:1] != "#"))
    assert isinstance(groups, list)
    return groups


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_the_inference_server_is_a_target_beside_the_gateway(tmp_path: Path, profile: str) -> None:
    groups = _targets(tmp_path, {"appliance_profile": profile})
    assert groups == [
        {
            "targets": ["127.0.0.1:9464"],
            "labels": {"job": "appliance-gateway", "host": "localhost"},
        },
        {
            "targets": ["127.0.0.1:8002"],
            "labels": {"job": "appliance-inference-server", "host": "localhost"},
        },
    ]


def test_a_gateway_without_metrics_leaves_the_inference_server_target(tmp_path: Path) -> None:
    groups = _targets(
        tmp_path, {"appliance_metrics_listen": "", "appliance_backend_metrics": "10.0.0.5:8002"}
    )
    assert groups == [
        {
            "targets": ["10.0.0.5:8002"],
            "labels": {"job": "appliance-inference-server", "host": "localhost"},
        }
    ]


def test_the_engine_server_listens_where_the_target_points(tmp_path: Path) -> None:
    """On CPU hosts the engine server serves its page at appliance_backend_metrics, the address
    the target names; `appliance engine --metrics` takes it."""
    text = _render(tmp_path, {}, "engine.env.j2").read_text()
    (metrics,) = re.findall(r"^ENGINE_METRICS=(.*)$", text, re.M)
    assert metrics == "127.0.0.1:8002"
    assert listen_address(metrics) == metrics


def test_the_role_writes_the_file_the_scrape_job_reads() -> None:
    tasks = (ROLE / "tasks/main.yml").read_text()
    task = tasks[tasks.index("- name: Install this host's Prometheus file_sd targets") :]
    task = task[: task.index("\n- name:")]
    assert "src: prometheus-targets.yml.j2" in task
    (dest,) = re.findall(
        r"^\s+dest: \"\{\{ appliance_prometheus_file_sd_dir \}\}/(.+)\"$", task, re.M
    )
    job = (MONITORING / "prometheus-scrape.yml").read_text()
    (pattern,) = re.findall(r'^    - files: \["(.+)"\]$', job, re.M)
    assert Path(dest.replace("{{ inventory_hostname }}", "h1")).match(Path(pattern).name)


@pytest.mark.usefixtures("nvml")
def test_prometheus_fills_the_dashboards_gpu_panels_from_the_roles_targets(
    tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scrape job of monitoring/prometheus-scrape.yml over the file the role writes, with a
    gateway and an engine server on a GPU (NVML faked) behind its two targets: every GPU panel
    of the dashboard has a series, by host and GPU, from the inference server's target."""
    gateway = GatewayMetrics()
    gateway_port = gateway.serve("127.0.0.1:0")
    monkeypatch.setattr(engine_metrics, "gpu_uuids", lambda models: [UUID])
    inference = serve_metrics(engine.service, engine.models, "127.0.0.1:0")
    targets: dict[str, object] = {
        "appliance_metrics_listen": f"127.0.0.1:{gateway_port}",
        "appliance_backend_metrics": f"127.0.0.1:{inference.server_address[1]}",
    }
    file_sd = tmp_path / "file_sd"
    file_sd.mkdir()
    rendered = _render(tmp_path, targets, "prometheus-targets.yml.j2")
    shutil.copy(rendered, file_sd / "appliance-localhost.yml")
    job = (MONITORING / "prometheus-scrape.yml").read_text()
    prom = Prometheus(tmp_path, {}, job.replace("/etc/prometheus/file_sd/", f"{file_sd}/"))
    try:
        prom.wait_ready()
        dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
        gpu = [p for p in dashboard["panels"] if p["title"].startswith("GPU")]
        exprs = [t["expr"] for p in gpu for t in p["targets"]]
        assert len(exprs) == 5, exprs
        for expr in exprs:

            def answered(e: str = expr) -> list[dict[str, Any]]:
                return prom.query(e)

            (series,) = until(answered, f"no series for {expr}", 60, 0.2)
            assert series["metric"] == {"host": "localhost", "gpu_uuid": UUID}, expr
        prom.wait_value('up{job="appliance-gateway",host="localhost"}', 1, 60)
        # The gateway stops answering scrapes: the target-down alert's expression names it alone.
        gateway.close()
        down = _alert_expr("ApplianceTargetDown")

        def gateway_down() -> list[dict[str, Any]]:
            return prom.query(down)

        (series,) = until(gateway_down, "the stopped gateway is not reported down", 60, 0.2)
        assert (series["metric"]["job"], series["metric"]["host"]) == (
            "appliance-gateway",
            "localhost",
        )
    finally:
        prom.stop()
        inference.shutdown()
        inference.server_close()
        gateway.close()
