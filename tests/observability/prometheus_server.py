"""A real Prometheus server for tests: scrapes given targets every 200 ms, answers PromQL."""

from __future__ import annotations

import json
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from appliance.tools.processes import free_port
from tests.support import until


class Prometheus:
    def __init__(self, workdir: Path, targets: dict[str, str], jobs_yaml: str = "") -> None:
        """Scrapes `targets` (job -> HOST:PORT), and the jobs of `jobs_yaml` (a list of scrape
        configs, as monitoring/prometheus-scrape.yml writes them)."""
        self.port = free_port()
        config = workdir / "prometheus.yml"
        jobs = "\n".join(
            [
                f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']"
                for job, target in targets.items()
            ]
            + ["  " + line for line in jobs_yaml.splitlines()]
        )
        config.write_text(
            f"global:\n  scrape_interval: 200ms\n  scrape_timeout: 150ms\nscrape_configs:\n{jobs}\n"
        )
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql}
        )
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, "prometheus exited; see prometheus.log"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1):
                    return True
            except OSError:
                return False

        until(ready, "prometheus not ready", timeout_s, 0.1)

    def wait_value(self, promql: str, expected: float, timeout_s: float = 30.0) -> float:
        """Polls the query until it returns `expected` (scrapes are periodic); the last value."""
        value = [float("nan")]

        def reached() -> bool:
            result = self.query(promql)
            if result:
                value[0] = float(result[0]["value"][1])
            return value[0] == expected

        until(reached, lambda: f"{promql} = {value[0]}, expected {expected}", timeout_s, 0.2)
        return value[0]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.close()
