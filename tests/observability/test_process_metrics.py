"""The gateway's process_* series (memory, CPU seconds, open files) under its systemd unit, whose
ProcSubset=pid mounts /proc with `subset=pid`: /proc/self is there, /proc/stat is not. Run in a
user and PID namespace with /proc mounted so, as the unit has it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd/appliance-gateway.service"
SERIES = {
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_cpu_seconds",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
}
SCRAPE = """
import json, os, time
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from appliance.gateway.metrics import GatewayMetrics
text = generate_latest(GatewayMetrics().registry).decode()
print(json.dumps({
    "proc_stat": os.path.exists("/proc/stat"),
    "now": time.time(),
    "series": {
        f.name: f.samples[0].value
        for f in text_string_to_metric_families(text) if f.name.startswith("process_")
    },
}))
"""


def _in_pid_only_proc(code: str) -> subprocess.CompletedProcess[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    argv = [
        unshare, "--user", "--map-root-user", "--mount", "--pid", "--fork", "--mount-proc",
        "sh", "-c", 'mount -t proc -o subset=pid proc /proc && exec "$0" -c "$1"',
        sys.executable, code,
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    if done.returncode != 0 and "appliance" not in done.stderr:
        pytest.skip(f"no user namespace or subset=pid mount here: {done.stderr.strip()}")
    return done


def test_the_gateway_unit_hides_proc_stat() -> None:
    assert "\nProcSubset=pid\n" in UNIT.read_text()


def test_the_gateway_exports_its_process_series_without_proc_stat() -> None:
    done = _in_pid_only_proc(SCRAPE)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["proc_stat"] is False
    series = found["series"]
    assert set(series) == SERIES
    assert series["process_resident_memory_bytes"] > 0
    assert series["process_open_fds"] > 0
    # This process's start (Unix time), not the boot's: it started just before it scraped.
    assert found["now"] - 60 < series["process_start_time_seconds"] <= found["now"]
