"""`appliance bench` against real processes (engine server on the tiny model + gateway): the files
it writes, the errors it counts, the cache hits it sees, the model it refuses, an interrupted run."""

from __future__ import annotations

import csv
import json
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from appliance import cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ("ttft_cdf.png", "itl_cdf.png", "latency_vs_load.png", "timeline.png")


def run_bench(address: str, out: Path, *args: str) -> int:
    return cli.main(["bench", "--address", address, "--model", "tiny", "--out", str(out), *args])


def load(out: Path) -> tuple[dict[str, Any], list[dict[str, str]]]:
    document = json.loads((out / "bench.json").read_text())
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    return document, rows


def assert_ordered(level: dict[str, Any]) -> None:
    for name, d in level["metrics"].items():
        if d is not None:
            assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (name, d)
            assert d["min"] <= d["avg"] <= d["max"], (name, d)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and data[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_a_sweep_writes_tables_json_csv_and_plots(
    gateway_address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    rc = run_bench(
        gateway_address,
        out,
        *("--concurrency", "1,2", "--rate", "40", "--requests", "6", "--warmup", "1"),
        *("--prompt-tokens", "normal:16,4", "--output-tokens", "uniform:4,8", "--seed", "7"),
    )
    stdout = capsys.readouterr().out
    assert rc == 0
    for label in ("concurrency 1", "concurrency 2", "rate 40/s"):
        assert f"\n{label}: 6 sent, " in stdout
        assert f"| {label} | " in stdout  # the sweep table
    assert "| Time to first token (ms)" in stdout and "| Inter-token latency (ms)" in stdout
    assert "genai-perf" in stdout and "vLLM" in stdout

    document, rows = load(out)
    assert document["run"]["levels"] == ["concurrency 1", "concurrency 2", "rate 40/s"]
    assert document["run"]["interrupted"] is False
    assert document["run"]["warmup_statuses"] == {"OK": 1}
    requests = document["requests"]
    assert len(requests) == len(rows) == 18
    assert [r["request_id"] for r in requests] == [r["request_id"] for r in rows]
    for level in document["levels"]:
        assert level["sent"] == 6
        assert level["ok"] + sum(level["errors"].values()) == 6
        assert_ordered(level)
    for r in requests:
        if r["status"] == "OK":
            assert 4 <= r["max_tokens"] <= 8
            assert 1 <= r["output_tokens"] <= r["max_tokens"]
            assert 0 < r["ttft_s"] <= r["latency_s"]
            assert r["cache_tier"] == "MISS"  # the default policy is BYPASS
            assert r["input_tokens"] > 0
        else:
            # The tiny engine is batch 1 and the queue small: a refusal is a result, counted.
            assert r["status"] in {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, r
    for name in PLOTS:
        assert png_size(out / name) == (900, 500)
    assert (out / "summary.md").read_text().count("| Time to first token (ms)") == 3


def test_failed_requests_are_counted_by_status(
    gateway_address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "The gateway streams tokens"}\n'
        '{"prompt": "The engine answers", "max_tokens": 100000}\n'
        '{"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5}\n'
    )
    out = tmp_path / "run"
    rc = run_bench(
        gateway_address, out, "--prompts", str(prompts), "--requests", "6", "--warmup", "0"
    )
    stdout = capsys.readouterr().out
    assert rc == 0
    assert "errors: INVALID_ARGUMENT 2" in stdout
    # Why, in the server's words, once per status: what to change before the next run.
    (why,) = [line for line in stdout.splitlines() if line.startswith("  INVALID_ARGUMENT, ")]
    assert why.startswith("  INVALID_ARGUMENT, the first: ") and "max_tokens" in why, why
    document, rows = load(out)
    (level,) = document["levels"]
    assert (level["sent"], level["ok"], level["errors"]) == (6, 4, {"INVALID_ARGUMENT": 2})
    assert "max_tokens" in level["first_errors"]["INVALID_ARGUMENT"]
    refused = [r for r in rows if r["status"] != "OK"]
    assert [int(r["index"]) for r in refused] == [1, 4]
    assert all("max_tokens" in r["error"] for r in refused), refused


def test_the_default_cache_policy_measures_hits(
    gateway_address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("A question asked twice by the bench\nAnother question asked twice\n")
    out = tmp_path / "run"
    rc = run_bench(
        gateway_address,
        out,
        *("--prompts", str(prompts), "--requests", "4", "--warmup", "0"),
        *("--cache-policy", "default", "--output-tokens", "6"),
    )
    assert rc == 0
    assert "answered by: EXACT_L1 2, MISS 2" in capsys.readouterr().out
    document, _ = load(out)
    (level,) = document["levels"]
    assert level["cache_tiers"] == {"EXACT_L1": 2, "MISS": 2}
    assert level["metrics"]["ttft_ms"]["n"] == 4
    itl = level["metrics"]["itl_ms"]
    assert itl is None or itl["n"] <= 2  # hits come in one message: no inter-token latency


def test_an_unknown_model_gets_the_gateways_not_found(
    gateway_address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["bench", "--address", gateway_address, "--model", "no-such-model"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1, err
    assert err.startswith(f"appliance bench: {gateway_address}: NOT_FOUND: "), err
    assert "tiny" in err  # the gateway lists the models it serves


def test_output_tokens_over_the_models_limit_stop_the_run_before_any_load(
    gateway_address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first request asks for what the workload asks for: a length the gateway refuses is
    one line before the run, not a run of nothing but INVALID_ARGUMENT."""
    out = tmp_path / "out"
    rc = run_bench(gateway_address, out, "--output-tokens", "5000", "--duration", "30")
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1, err
    assert err.startswith(f"appliance bench: {gateway_address}: INVALID_ARGUMENT: "), err
    assert "max_tokens" in err and not (out / "bench.json").exists()


def interrupted_run(
    address: str, model: str, out: Path, stop: signal.Signals
) -> tuple[int, str, str]:
    """`appliance bench` with a level of 120 s, sent `stop` once it has answers: (exit status,
    stdout, stderr)."""
    args = ["--model", model, "--duration", "120", "--warmup", "0", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "appliance", "bench", "--address", address, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        # Off a terminal the progress is a line every few seconds; wait for one with answers.
        for line in proc.stderr:
            done = re.match(r"concurrency 1: (\d+) done,", line)
            if done and int(done.group(1)) >= 1:
                break
        proc.send_signal(stop)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, stdout, stderr


def test_ctrl_c_prints_and_writes_what_was_measured(gateway_address: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    returncode, stdout, stderr = interrupted_run(gateway_address, "tiny", out, signal.SIGINT)
    assert returncode == 130, stderr
    assert "interrupted: ending the requests in flight" in stderr
    assert "concurrency 1: " in stdout and "| Time to first token (ms)" in stdout
    document, rows = load(out)
    assert document["run"]["interrupted"] is True
    (level,) = document["levels"]
    assert level["ok"] >= 1 and level["interrupted"] <= 1
    assert len(rows) == level["sent"]
    assert_ordered(level)
    for name in PLOTS:
        assert png_size(out / name) == (900, 500)
