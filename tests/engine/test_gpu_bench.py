"""bench/gpu_decode.py runs end to end on the CPU with the tiny shape, so the GPU run is one call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_decode


def test_gpu_decode_bench_runs_on_cpu_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--device", "cpu", "--shape", "tiny", "--tokens", "8", "--warmup-tokens", "2"]
    argv += [
        "--ttft-runs",
        "1",
        "--copy-bytes",
        str(8 << 20),
        "--skip-path",
        "--out",
        str(tmp_path),
    ]
    assert gpu_decode.main(argv) == 0
    report = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert report["copy_bandwidth_gbps"] > 0 and report["shape"] == "tiny"
    measured = {v["variant"]: v for v in report["variants"] if "skipped" not in v}
    assert set(measured) == {"bf16 eager", "fp8 eager"}  # graph variants need CUDA
    bf16, fp8 = measured["bf16 eager"], measured["fp8 eager"]
    assert fp8["weight_bytes_per_step"] < bf16["weight_bytes_per_step"]
    for v in (bf16, fp8):
        assert v["decode_tokens"] == 8 and 0 < v["decode_ms_p50"] <= v["decode_ms_p99"]
        assert v["ttft_64_ms_p50"] > 0 and v["ttft_128_ms_p50"] > 0 and v["ttft_2048_ms_p50"] > 0
        assert v["matmul_2048_ms"] > 0
        assert v["ttft_2048_over_matmul"] == v["ttft_2048_ms_p50"] / v["matmul_2048_ms"]
        assert v["ttft_reuse_minus_ttft_64_ms"] == v["ttft_reuse_ms_p50"] - v["ttft_64_ms_p50"]
        # 62 full blocks of the 2,000-token prefix came from the pool.
        assert v["reused_tokens"] == [1984]
        assert v["cpu_ops_per_step"] > 0  # the profiler's count of the captured step's body
        # The verify step of k drafts against the single-token step, both static bodies here.
        assert v["verify_timing"] == "static bodies, eager" and v["verify_single_step_ms"] > 0
        for k in gpu_decode.VERIFY_DRAFTS:
            assert v[f"verify_{k}_over_step"] == v[f"verify_{k}_ms"] / v["verify_single_step_ms"]
        # Its first row scores the single-token step's token at the same position (bf16).
        assert v["verify_vs_step_logits_rel_err"] < 0.05
    skipped = {v["variant"] for v in report["variants"] if "skipped" in v}
    assert {"bf16 graph triton", "fp8 graph triton", "bf16 graph compile"} <= skipped
    table = capsys.readouterr().out
    assert "| bf16 eager |" in table and "skipped: CUDA graphs need cuda" in table
    assert "| verify 1 / step | verify 2 / step | verify 4 / step | verify 8 / step |" in table
    assert "| fp8 eager | static bodies, eager |" in table
