"""The alerting rules are valid Prometheus rules and fire as their unit tests say (promtool)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["check", "rules", "alerts.yml"], "7 rules found"),
        (["test", "rules", "alerts_test.yml"], "SUCCESS"),
    ],
)
def test_promtool(command: list[str], expected: str) -> None:
    out = subprocess.run(
        ["promtool", *command], cwd=MONITORING, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert expected in out.stdout
