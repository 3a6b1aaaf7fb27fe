"""bench.heap in a process of its own (it freezes the heap of the process it runs in)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import Tiny

ROOT = Path(__file__).resolve().parents[2]


def _heap(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.heap", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found is not None, text
    return float(found.group(1).replace(",", ""))


def test_a_full_collection_after_freeze_heap_walks_nothing(tiny: Tiny) -> None:
    done = _heap("--repository", str(tiny.repo), "--runs", "2")
    assert done.returncode == 0, done.stderr
    tracked = _number(r"([\d,]+) tracked objects", done.stdout)
    assert _number(r"([\d,]+) frozen", done.stdout) > 0.9 * tracked
    before = _number(r"\| as loaded \| ([\d,.]+) \|", done.stdout)
    assert _number(r"\| after freeze_heap \| ([\d,.]+) \|", done.stdout) < before


def test_a_missing_repository_is_one_line(tmp_path: Path) -> None:
    done = _heap("--repository", str(tmp_path / "none"))
    assert done.returncode == 2
    assert done.stderr.startswith("bench.heap: ") and done.stderr.count("\n") == 1
