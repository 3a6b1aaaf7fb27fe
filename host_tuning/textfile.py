"""verify's result as a node_exporter textfile-collector file (``host-tune verify --textfile``).

Labels are the plugin and the status of each result, never the setting's key: both come from
host-tune's own names (``host_tuning.registry``, ``host_tuning.actions``), so the series are few
and stable however many CPUs and IRQs the plan has and however IRQ numbers change at a boot. The
keys that drifted are in verify's own output (the unit's journal).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from appliance.wholefile import write_whole
from host_tuning.actions import Result

SUFFIX = ".prom"  # node_exporter's textfile collector reads only these
MODE = 0o644  # node_exporter runs as its own user


class _Verify(Collector):
    def __init__(self, results: list[Result], code: int, now: float) -> None:
        self.results, self.code, self.now = results, code, now

    def collect(self) -> list[GaugeMetricFamily]:
        settings = GaugeMetricFamily(
            "appliance_host_tune_settings",
            "Settings host-tune verify found, by plugin and verify's status (ok, drift, ...).",
            labels=["plugin", "status"],
        )
        for (plugin, status), n in sorted(
            Counter((r.plugin, r.status) for r in self.results).items()
        ):
            settings.add_metric([plugin, status], n)
        code = GaugeMetricFamily(
            "appliance_host_tune_verify_exit_code",
            "Exit code of the last host-tune verify (host-tune --help lists them).",
            value=self.code,
        )
        stamp = GaugeMetricFamily(
            "appliance_host_tune_verify_timestamp_seconds",
            "When the last host-tune verify finished (Unix time).",
            value=self.now,
        )
        return [settings, code, stamp]


def exposition(results: list[Result], code: int, now: float) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Verify(results, code, now))
    return generate_latest(registry)


def refusal(path: Path) -> str | None:
    """Why a file at ``path`` could never be collected, or None. Checked before verify runs."""
    if not path.name.endswith(SUFFIX):
        return f"node_exporter's textfile collector reads only files ending in {SUFFIX}"
    if not path.parent.is_dir():
        return f"no directory {path.parent} (install node_exporter or create it)"
    return None


def replace(path: Path, data: bytes) -> None:
    """Write ``path`` whole, readable by node_exporter's user: a scrape reads the old file or the
    new one. An OSError names ``path``."""
    write_whole(path, data, MODE)
