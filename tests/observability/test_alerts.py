"""The alerting rules are valid Prometheus rules and fire as their unit tests say (promtool)."""

from __future__ import annotations

import subprocess
from pathlib import Path

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"


def test_rules_are_valid() -> None:
    out = subprocess.run(
        ["promtool", "check", "rules", "alerts.yml"],
        cwd=MONITORING,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 rules found" in out.stdout


def test_rules_fire_as_tested() -> None:
    out = subprocess.run(
        ["promtool", "test", "rules", "alerts_test.yml"],
        cwd=MONITORING,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
