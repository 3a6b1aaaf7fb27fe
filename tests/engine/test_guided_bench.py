"""bench/guided.py runs end to end on the tiny model with tiny counts, so a full run is one command."""

from __future__ import annotations

import re

import pytest

from bench import guided
from tests.conftest import Tiny


def test_guided_bench_runs_end_to_end_on_the_tiny_model(
    tiny: Tiny, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--checkpoint", str(tiny.model_dir), "--prompts", "2", "--max-tokens", "4"]
    assert guided.main([*argv, "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    # Every schema was compiled once, on its first request, and served from the cache after.
    for name, _ in guided.COMPILE_SCHEMAS:
        assert re.search(rf"^\| {re.escape(name)} \| \d+ \| [0-9.]+ \|", out, re.M), name
    schemas = len(guided.COMPILE_SCHEMAS)
    hits = schemas + 2  # each schema's repeat, and the two constrained answers
    assert f"{schemas} compiles, {hits} hits" in out
    assert re.search(r"^\| constrained \| \d/2 .*\| 2 \| 0/0 \|$", out, re.M)  # cut at 4 tokens
    assert "constrained / free, P50: per-request ITL" in out
