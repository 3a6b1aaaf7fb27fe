"""bench/gpu_decode.py runs end to end on the CPU with the tiny shape, so the GPU run is one call."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.engine.random_weights import random_config, random_model
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
        assert v["host_loop_stepwise_ms"] > 0 and v["host_loop_chained_ms"] > 0
    skipped = {v["variant"] for v in report["variants"] if "skipped" in v}
    assert {"bf16 graph triton", "fp8 graph triton", "bf16 graph compile"} <= skipped
    assert {"int8 graph triton", "int4 graph triton"} <= skipped
    table = capsys.readouterr().out
    assert "| bf16 eager |" in table and "skipped: CUDA graphs need cuda" in table
    assert "| verify 1 / step | verify 2 / step | verify 4 / step | verify 8 / step |" in table
    assert "| fp8 eager | static bodies, eager |" in table
    assert "| bf16 eager | n/a |" in table  # the host loops' table: no graph to replay


def _fast_argv(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--device",
        "cpu",
        "--shape",
        "tiny",
        "--copy-bytes",
        str(1 << 20),
        "--skip-path",
        "--out",
        str(tmp_path),
        *extra,
    ]


def test_a_failing_variant_is_recorded_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A variant that raises leaves one line (type + message) and what it measured before it;
    the next variant still runs and the table names the failure."""
    ran: list[str] = []

    def measure(args: Any, variant: Any, device: Any, rng: Any, result: dict[str, Any]) -> None:
        ran.append(variant.name)
        result["weight_bytes_per_step"] = 1
        if variant.name == "bf16 eager":
            raise RuntimeError("CUDA error: an illegal memory access\nsecond line")
        result.update(FAKE_FIGURES)

    monkeypatch.setattr(gpu_decode, "measure_variant", measure)
    argv = _fast_argv(tmp_path, "--variants", "bf16 eager,fp8 eager")
    assert gpu_decode.main(argv) == 0
    assert ran == ["bf16 eager", "fp8 eager"]
    report = json.loads((tmp_path / "gpu_decode.json").read_text())
    failed, ok = report["variants"]
    assert failed["error"] == "RuntimeError: CUDA error: an illegal memory access"
    assert failed["weight_bytes_per_step"] == 1  # measured before the failure, kept
    assert "error" not in ok and ok["decode_ms_p50"] == FAKE_FIGURES["decode_ms_p50"]
    out = capsys.readouterr().out
    assert out.startswith("gpu_decode: cpu (capability None), torch ")
    assert "| bf16 eager | error: RuntimeError: CUDA error: an illegal memory access |" in out
    assert "| fp8 eager | 1e-09 |" in out


def test_after_a_failure_that_kills_the_cuda_context_the_rest_runs_in_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A device-side assert leaves this process's CUDA context unusable: the variants after it
    are measured by a new process (here really, on the CPU) and land in this run's report."""

    def measure(args: Any, variant: Any, device: Any, rng: Any, result: dict[str, Any]) -> None:
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(gpu_decode, "measure_variant", measure)
    monkeypatch.setattr(gpu_decode, "cuda_context_problem", lambda device: "AcceleratorError")
    argv = _fast_argv(tmp_path, "--variants", "bf16 eager,fp8 eager", "--tokens", "4")
    argv += ["--warmup-tokens", "1", "--ttft-runs", "1"]
    assert gpu_decode.main(argv) == 0
    failed, fresh = json.loads((tmp_path / "gpu_decode.json").read_text())["variants"]
    assert failed == {
        **failed,
        "variant": "bf16 eager",
        "error": "RuntimeError: CUDA error: device-side assert triggered",
    }
    assert fresh["variant"] == "fp8 eager" and "error" not in fresh
    assert fresh["decode_tokens"] == 4 and fresh["decode_ms_p50"] > 0
    assert "the rest runs in a fresh process" in capsys.readouterr().out


# A stand-in for `python -m bench.gpu_decode ARGV` in a process of its own: it reports the variants
# before the one named in argv[1] as measured, says it is running that one and aborts (as a
# segfault or a failed CUDA assert does); without it in its list, it reports them all.
DYING_CHILD = """
import json, os, sys
out, dies_at, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
report = {"variants": [], "running": None}
for name in names:
    if name == dies_at:
        report["running"] = name
        break
    report["variants"].append({"variant": name, "decode_ms_p50": 1.0})
with open(os.path.join(out, "gpu_decode.json"), "w") as f:
    json.dump(report, f)
if report["running"]:
    os.abort()
"""


def _dying_spawn(dies_at: str, asked: list[str]) -> gpu_decode.Spawn:
    def spawn(argv: list[str]) -> int:
        names = argv[argv.index("--variants") + 1]
        asked.append(names)
        out = argv[argv.index("--out") + 1]
        return subprocess.run([sys.executable, "-c", DYING_CHILD, out, dies_at, names]).returncode

    return spawn


@pytest.mark.parametrize(("dies_at", "expected"), [("b", ["a,b,c,d", "c,d"]), ("", ["a,b,c,d"])])
def test_a_fresh_process_that_dies_loses_only_the_variant_it_was_running(
    tmp_path: Path, dies_at: str, expected: list[str]
) -> None:
    """A segfault or an abort in a fresh process costs the variant it was running; the ones
    after it run in another fresh process. One that dies before any variant is not retried."""
    variants = [gpu_decode.select_variants("bf16 eager")[0]] * 4
    variants = [dataclasses.replace(v, name=n) for v, n in zip(variants, "abcd", strict=True)]
    args = gpu_decode.main_parser().parse_args(_fast_argv(tmp_path))
    progress = gpu_decode.Progress(tmp_path / "report.json", {"variants": []})
    asked: list[str] = []

    def fails_to_start(argv: list[str]) -> int:  # says nothing, as a failed import does
        asked.append(argv[argv.index("--variants") + 1])
        return 1

    spawn = _dying_spawn(dies_at, asked) if dies_at else fails_to_start
    gpu_decode.run_in_fresh_process(args, variants, progress, time.monotonic(), "test", spawn)
    assert asked == expected
    reported = {v["variant"]: v.get("error") for v in progress.report["variants"]}
    if dies_at:
        aborted = -signal.SIGABRT
        assert reported == {
            "a": None,
            "b": f"fresh process exited {aborted} while running it",
            "c": None,
            "d": None,
        }
    else:
        assert reported == dict.fromkeys("abcd", "fresh process exited 1")


def test_the_json_is_written_after_each_variant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed during its second variant still leaves the first one's figures on disk."""
    seen: list[list[str]] = []

    def measure(args: Any, variant: Any, device: Any, rng: Any, result: dict[str, Any]) -> None:
        on_disk = json.loads((tmp_path / "gpu_decode.json").read_text())
        seen.append([v["variant"] for v in on_disk["variants"]])
        assert on_disk["running"] == variant.name
        result.update(FAKE_FIGURES)

    monkeypatch.setattr(gpu_decode, "measure_variant", measure)
    assert gpu_decode.main(_fast_argv(tmp_path, "--variants", "bf16 eager,fp8 eager")) == 0
    assert seen == [[], ["bf16 eager"]]
    report = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert report["copy_bandwidth_gbps"] > 0 and report["running"] is None


def test_the_time_budget_skips_what_would_pass_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --budget-s, a variant that would run past it is skipped and the reason recorded."""
    ran: list[str] = []

    def measure(args: Any, variant: Any, device: Any, rng: Any, result: dict[str, Any]) -> None:
        ran.append(variant.name)
        result.update(FAKE_FIGURES)

    clock = iter(float(t) for t in (0, 0, 0, 50, 60, 60))  # the first variant takes 50 s
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))  # gpu_decode calls time.monotonic()
    monkeypatch.setattr(gpu_decode, "start_watchdog", lambda progress, seconds: None)
    monkeypatch.setattr(gpu_decode, "measure_variant", measure)
    argv = _fast_argv(tmp_path, "--variants", "bf16 eager,fp8 eager", "--budget-s", "100")
    assert gpu_decode.main(argv) == 0
    assert ran == ["bf16 eager"]
    skipped = json.loads((tmp_path / "gpu_decode.json").read_text())["variants"][1]
    assert skipped["variant"] == "fp8 eager"
    assert skipped["skipped"].startswith("time budget: 60 s spent + 50 s (the longest variant)")


def test_an_unknown_variant_is_one_line_and_a_non_zero_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        gpu_decode.main(_fast_argv(tmp_path, "--variants", "bf16 eagre"))
    assert exited.value.code != 0
    assert (
        "unknown variant(s) ['bf16 eagre']; known: bf16 graph triton, " in capsys.readouterr().err
    )


FAKE_FIGURES: dict[str, Any] = {
    "weight_bytes_per_step": 1,
    "decode_ms_p50": 1.0,
    "decode_ms_p99": 2.0,
    "ttft_64_ms_p50": 1.0,
    "ttft_128_ms_p50": 1.0,
    "ttft_2048_ms_p50": 1.0,
    "matmul_2048_ms": 1.0,
    "ttft_2048_over_matmul": 1.0,
    "ttft_reuse_ms_p50": 1.0,
    "ttft_reuse_minus_ttft_64_ms": 0.0,
    "graph_capture_s": None,
    "startup_s": 1.0,
}


# Packages the appliance depends on that a lent GPU host's image lacks.
NOT_ON_GPU_HOST = ("tritonclient", "rapidjson", "redis", "usearch", "pyroute2")
_BLOCKED_RUN = """
import sys
blocked = set(sys.argv[1].split(","))
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Block())
from bench import gpu_decode
sys.exit(gpu_decode.main(sys.argv[2:]))
"""


def test_the_bench_runs_without_the_packages_a_gpu_host_lacks(tmp_path: Path) -> None:
    """The GPU host's image has torch and Triton but not the serving stack's client packages:
    the benchmark (the whole path aside) must import and run without them."""
    argv = _fast_argv(tmp_path, "--variants", "bf16 eager", "--tokens", "4")
    argv += ["--warmup-tokens", "1", "--ttft-runs", "1"]
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED_RUN, ",".join(NOT_ON_GPU_HOST), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_decode.json").read_text())
    (bf16,) = report["variants"]
    assert "error" not in bf16 and bf16["decode_tokens"] == 4


def test_the_int_variants_floor_counts_packed_weights_with_scales_and_zeros() -> None:
    """Their floor is the bytes a step reads: the packed weights plus the model-dtype scales (and
    INT4's zero points), below bf16's. (The variants themselves capture graphs: CUDA only.)"""
    by_name = {v.name: v for v in gpu_decode.VARIANTS}
    names = [v.name for v in gpu_decode.VARIANTS]
    # A short budget runs the fused step first: bf16 and FP8, nine and six launches a block (the
    # folded step), with and without programmatic dependent launch; these fit the documented
    # budget, INT4 next.
    assert names[:8] == [
        "bf16 graph triton",
        "fp8 graph triton",
        "fp8 graph triton folded",
        "fp8 graph triton folded pdl",
        "bf16 graph triton folded pdl",
        "bf16 graph triton folded pdl-wait",
        "bf16 graph triton folded",
        "int4 graph triton",
    ]
    assert [v.folded for v in gpu_decode.VARIANTS].count(True) == 5
    assert all(v.folded and not v.compiled for v in gpu_decode.VARIANTS if v.pdl != "off")
    bf16 = random_model("tiny", "cpu", torch.bfloat16).weight_bytes
    int8, int4 = (
        random_model("tiny", "cpu", torch.bfloat16, by_name[n].fp8).weight_bytes
        for n in ("int8 graph triton", "int4 graph triton")
    )
    c = random_config("tiny")
    linear = (
        c.num_hidden_layers
        * c.hidden_size
        * (
            (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim  # wqkv
            + c.num_attention_heads * c.head_dim  # wo (in x out, same count)
            + 3 * c.intermediate_size  # w13 and w2
        )
    )
    rest = bf16 - 2 * linear  # embedding head, norms: in bf16 for every format
    assert int8 == rest + linear + 2 * linear // 128  # 1 byte + one bf16 scale per 128
    assert int4 == rest + linear // 2 + 4 * linear // 128  # half a byte + bf16 scale and zero


def test_the_prefill_comparison_times_both_bodies_and_compares_their_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fused prefill against the torch step, as a Triton variant measures it on the GPU:
    here under Triton's interpreter with a capture that records each body and replays it."""
    from appliance.engine import fused

    monkeypatch.setattr(gpu_decode, "PREFILL_ROWS", (16,))
    monkeypatch.setattr(gpu_decode, "CPU_BACK_TO_BACK_STEPS", 1)
    model = random_model("tiny", "cpu", torch.float32, seed=5)
    model.kernels = "triton"
    captured: list[int] = []

    def capture(body: Any) -> Any:
        captured.append(fused.FUSED_ROWS)  # the body is fixed when captured
        return body

    result = gpu_decode.prefill_comparison(
        model, model.new_cache(256), capture, torch.device("cpu")
    )
    assert captured == [fused.FUSED_ROWS, 0]  # fused, then the torch step
    assert result["prefill_16_fused_vs_torch_rel_err"] < 1e-5
    assert result["prefill_16_fused_ms"] > 0 and result["prefill_16_torch_ms"] > 0
    assert {"prefill_16_fused_cpu_ops", "prefill_16_torch_cpu_ops"} <= set(result)
    text = gpu_decode.prefill_table([{"variant": "f32 triton", **result}])
    assert "| f32 triton | 16 |" in text and "| n/a | n/a |" in text


def test_the_whole_path_runs_on_cpu_and_lands_in_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole-path part (bench/streaming.py: gateways over gRPC and over the engine's stream
    socket, the engine alone, the echoes) for real with a few requests, so its table is proven
    before a GPU run prints it."""

    def measure(args: Any, variant: Any, device: Any, rng: Any, result: dict[str, Any]) -> None:
        result.update(FAKE_FIGURES)

    monkeypatch.setattr(gpu_decode, "measure_variant", measure)
    argv = [a for a in _fast_argv(tmp_path, "--variants", "bf16 eager") if a != "--skip-path"]
    assert gpu_decode.main([*argv, "--path-requests", "3"]) == 0
    path = json.loads((tmp_path / "gpu_decode.json").read_text())["path"]
    for row in ("(a) TTFT via gateway", "(e) TTFT via gateway, stream socket"):
        assert 0 < path[f"{row} P50"] <= path[f"{row} P99"], path
    out = capsys.readouterr().out
    assert "| (e) inter-token via gateway, stream socket |" in out, out[-3000:]


@pytest.mark.parametrize("folded", [False, True], ids=["nine", "folded"])
def test_the_graph_agreement_replays_the_captured_step_against_eager_torch(
    folded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench's correctness figure of a graph variant: the captured step's logits, replayed
    as when timed, against the eager torch step's at four positions (here float32 on the
    interpreter, with a capture that replays the body)."""
    from appliance.engine import fused
    from appliance.engine.decode import GraphDecode

    monkeypatch.setattr(fused, "FOLDED", folded)
    model = random_model("tiny", "cpu", torch.float32, seed=5)
    model.kernels = "triton"
    cache = model.new_cache(256)
    model.forward(list(range(1, 121)), cache, 0)
    step = GraphDecode(model, cache, lambda body: body, smallest_span=32)
    assert gpu_decode.graph_agreement(step, model, cache) < 1e-5

    class Off:  # a captured step whose logits are 1 % off
        spans = step.spans

        def __call__(self, token: int, pos: int) -> torch.Tensor:
            return step(token, pos) * 1.01

    assert gpu_decode.graph_agreement(Off(), model, cache) > 5e-3  # type: ignore[arg-type]


def test_a_graph_variants_step_and_verify_timings_take_the_steps_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A graph variant's back-to-back replays of the captured step, and its verify graphs timed
    against them, run on the device the step is on (CUDA events on a GPU, the host clock here),
    with a capture that replays the body."""
    from appliance.engine.decode import GraphDecode
    from appliance.engine.runner import Runner

    monkeypatch.setattr(gpu_decode, "BACK_TO_BACK_STEPS", 4)
    monkeypatch.setattr(gpu_decode, "CPU_BACK_TO_BACK_STEPS", 1)
    model = random_model("tiny", "cpu", torch.bfloat16, seed=5)

    def capture(body: Any) -> Any:
        return body

    runner = Runner(model, 256, capture=capture, prefill_buckets=())
    try:
        model.forward(list(range(1, 140)), runner.cache, 0)  # what the steps attend to
        assert isinstance(runner.decode, GraphDecode)
        assert gpu_decode.graph_step_ms(runner.decode, 128) > 0
        result = gpu_decode.verify_step_ratios(model, runner, capture, torch.device("cpu"))
    finally:
        runner.close()
    assert result["verify_timing"] == "graph replays" and result["verify_single_step_ms"] > 0
    for k in gpu_decode.VERIFY_DRAFTS:
        assert (
            result[f"verify_{k}_over_step"]
            == result[f"verify_{k}_ms"] / result["verify_single_step_ms"]
        )
    assert result["verify_vs_step_logits_rel_err"] < 0.05


def test_a_variant_the_device_cannot_run_is_skipped_saying_why() -> None:
    """Decided before a variant's isolation begins, so it must not raise: a CPU reads no CUDA
    capability (programmatic dependent launch without a graph is not in VARIANTS, but a variant
    list of the command line may hold it one day)."""
    cpu = torch.device("cpu")
    eager_pdl = gpu_decode.Variant("x", None, False, "triton", folded=True, pdl="wait")
    assert gpu_decode.skip_reason(eager_pdl, cpu) == (
        "programmatic dependent launch needs a CUDA device of compute capability 9.0 on"
    )
    graph_pdl = gpu_decode.Variant("y", None, True, "triton", folded=True, pdl="wait")
    assert gpu_decode.skip_reason(graph_pdl, cpu) == "CUDA graphs need cuda"


def test_resume_goes_on_after_the_variant_a_dead_process_was_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose process died (a segfault) left its report with the variant it was running:
    --resume keeps what it measured, records that variant as an error and runs the rest."""
    names = ["bf16 graph", "bf16 eager", "fp8 eager"]
    ran: list[str] = []

    def measure(args: Any, variant: Any, device: Any, rng: Any, result: dict[str, Any]) -> None:
        ran.append(variant.name)
        result.update(FAKE_FIGURES)

    monkeypatch.setattr(gpu_decode, "measure_variant", measure)
    argv = _fast_argv(tmp_path, "--variants", ",".join(names), "--resume")
    with pytest.raises(SystemExit) as refused:
        gpu_decode.main(argv)
    assert refused.value.code == 2
    assert "--resume: no run to go on with in " in capsys.readouterr().err
    died = {"variants": [{"variant": names[0], **FAKE_FIGURES}], "running": names[1]}
    (tmp_path / "gpu_decode.json").write_text(json.dumps(died))
    assert gpu_decode.main(argv) == 0
    assert ran == [names[2]]
    report = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert [(v["variant"], v.get("error")) for v in report["variants"]] == [
        (names[0], None),
        (names[1], "its process ended while running it (--resume)"),
        (names[2], None),
    ]
    assert report["resumed"] is True and report["running"] is None
