"""Spec parsing: defaults, paths, and a one-line refusal for every contradictory value."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from engine_build.errors import SpecError
from engine_build.spec import load_spec

from .conftest import spec_sections, write_spec


def _spec(tmp_path: Path, **overrides: dict[str, Any]) -> Path:
    sections = spec_sections(tmp_path / "hf", tmp_path / "work", tmp_path / "venv", **overrides)
    return write_spec(tmp_path / "spec.toml", sections)


def test_defaults_are_the_low_latency_ones(tmp_path: Path) -> None:
    s = load_spec(_spec(tmp_path))
    assert s.max_batch_size == 1
    assert s.quantization == "fp8" and s.kv_cache_dtype == "fp8"
    assert s.cuda_graph_mode is True
    assert s.guided_decoding is True  # structured output unless the operator turns it off
    assert s.enable_kv_cache_reuse is False and s.use_paged_context_fmha is False
    assert s.gpu_ids == (0,)
    assert s.checkpoint_dir == tmp_path / "work" / "checkpoint"
    assert s.engine_dir == tmp_path / "work" / "engine"


def test_relative_paths_are_relative_to_the_spec(tmp_path: Path) -> None:
    path = write_spec(
        tmp_path / "spec.toml",
        {
            "model": {"hf_model_dir": "models/m", "work_dir": "out"},
            "trtllm": {
                "container": ["docker", "run", "--rm", "img"],
                "quantize_script": "/app/quantize.py",
            },
        },
    )
    s = load_spec(path)
    assert s.hf_model_dir == (tmp_path / "models" / "m").resolve()
    assert s.trtllm.container == ("docker", "run", "--rm", "img")
    assert s.trtllm.venv is None


def test_tp_size_defaults_gpu_ids(tmp_path: Path) -> None:
    s = load_spec(_spec(tmp_path, parallel={"tp_size": 2}))
    assert s.gpu_ids == (0, 1)


HUGE = 99999999999999999999
BAD: list[tuple[dict[str, dict[str, Any]], str]] = [
    (
        {"limits": {"max_input_len": 8192, "max_seq_len": 4096}},
        "key 'limits.max_input_len': 8192 > limits.max_seq_len (4096)",
    ),
    ({"limits": {"max_input_len": 4096, "max_seq_len": 4096}}, "no room left"),
    (
        {"limits": {"opt_num_tokens": 512, "multiple_profiles": True}},
        "key 'limits.opt_num_tokens': conflicts with limits.multiple_profiles",
    ),
    (
        {"limits": {"max_num_tokens": 1024}},
        "key 'limits.max_num_tokens': 1024 < limits.max_input_len",
    ),
    (
        {"limits": {"max_batch_size": 0}},
        "key 'limits.max_batch_size': must be between 1 and 2048 (the appliance serves 1;",
    ),
    ({"limits": {"max_batch_size": True}}, "key 'limits.max_batch_size': expected int, got bool"),
    ({"limits": {"max_seq_len": "4096"}}, "key 'limits.max_seq_len': expected int, got str"),
    (
        {"limits": {"max_seqlen": 4096}},
        "key 'limits.max_seqlen': unknown key; known keys are max_batch_size, max_input_len,",
    ),
    ({"extra": {"x": 1}}, "key 'extra': unknown key; known keys are kv_cache, limits, model,"),
    ({"precision": {"dtype": "float32"}}, "key 'precision.dtype': must be one of"),
    ({"precision": {"quantization": "int3_awq"}}, "key 'precision.quantization': must be one of"),
    (
        {"precision": {"quantization": "none"}, "plugins": {"gemm": "low_latency_gemm_plugin"}},
        "exists only for fp8 weights",
    ),
    ({"plugins": {"gemm": "cublas"}}, "key 'plugins.gemm': must be one of"),
    ({"plugins": {"gemm_swiglu": "both"}}, "key 'plugins.gemm_swiglu': must be one of none,"),
    (
        {"precision": {"quantization": "none"}, "plugins": {"gemm_swiglu": "gemm_swiglu_plugin"}},
        "key 'plugins.gemm_swiglu': 'gemm_swiglu_plugin' exists only for fp8 weights",
    ),
    (
        {"plugins": {"gemm_swiglu": "low_latency_gemm_swiglu_plugin"}},
        "does not pair with plugins.gemm = 'gemm_plugin'; use 'gemm_swiglu_plugin'",
    ),
    (
        {"plugins": {"gemm": "low_latency_gemm_plugin", "gemm_swiglu": "gemm_swiglu_plugin"}},
        "use 'low_latency_gemm_swiglu_plugin'",
    ),
    ({"kv_cache": {"tokens_per_block": 48}}, "power of two"),
    ({"kv_cache": {"free_gpu_mem_fraction": 1.5}}, "must be in (0, 1], got 1.5"),
    ({"parallel": {"tp_size": 2, "gpu_ids": [0]}}, "has 1 ids but parallel.tp_size is 2"),
    ({"parallel": {"tp_size": 2, "gpu_ids": [1, 1]}}, "distinct"),
    ({"trtllm": {"container": ["docker"]}}, "set exactly one of 'venv'"),
    (
        {"trtllm": {"quantize": "x"}},
        "key 'trtllm.quantize': unknown key; known keys are container,",
    ),
    (
        {"runtime": {"guided_decoding": "yes"}},
        "key 'runtime.guided_decoding': expected bool, got str",
    ),
    # Every number is bounded, not only sign-checked: the runtime ones land in config.pbtxt.
    (
        {"runtime": {"cancellation_check_period_ms": HUGE}},
        "key 'runtime.cancellation_check_period_ms': must be between 1 and 1000 "
        f"(milliseconds a cancelled request may keep the GPU), got {HUGE}",
    ),
    (
        {"runtime": {"cuda_graph_cache_size": 257}},
        "key 'runtime.cuda_graph_cache_size': must be between 1 and 256",
    ),
    ({"limits": {"max_batch_size": HUGE}}, "key 'limits.max_batch_size': must be between 1 and"),
    ({"precision": {"calib_size": HUGE}}, "key 'precision.calib_size': must be between 1 and"),
    (
        {"limits": {"max_num_tokens": 2**31}},
        "key 'limits.max_num_tokens': must be between 1 and 2147483647",
    ),
    ({"parallel": {"tp_size": HUGE}}, "key 'parallel.tp_size': must be between 1 and 64"),
    ({"parallel": {"gpu_ids": [HUGE]}}, "key 'parallel.gpu_ids': must be distinct ids between"),
    ({"kv_cache": {"tokens_per_block": 2048}}, "key 'kv_cache.tokens_per_block': must be between"),
    ({"plan": {"runtime_overhead": "2TiB"}}, "key 'plan.runtime_overhead': must be at most 1TiB"),
    (
        {"plan": {"runtime_overhead": "9" * 400 + "GiB"}},
        "key 'plan.runtime_overhead': must be at most 1TiB (per GPU), got more than 1PiB",
    ),
    # Byte sizes carry their unit: a bare number would be bytes.
    ({"plan": {"runtime_overhead": 1024}}, "key 'plan.runtime_overhead': expected str, got int"),
    ({"plan": {"runtime_overhead": "1024"}}, "expected a number with a unit, such as 80GiB"),
    # An empty path would name the spec's own folder (or pass --calib_dataset "").
    ({"precision": {"calib_dataset": ""}}, "key 'precision.calib_dataset': must not be empty"),
    ({"trtllm": {"venv": ""}}, "key 'trtllm.venv': must not be empty"),
    ({"trtllm": {"quantize_script": ""}}, "key 'trtllm.quantize_script': must not be empty"),
]


def test_quantize_script_required(tmp_path: Path) -> None:
    path = write_spec(
        tmp_path / "s.toml",
        {"model": {"hf_model_dir": "a", "work_dir": "b"}, "trtllm": {"venv": "v"}},
    )
    with pytest.raises(SpecError, match="missing quantize_script"):
        load_spec(path)


@pytest.mark.parametrize(("overrides", "message"), BAD)
def test_contradictions_refused_with_one_line(
    tmp_path: Path, overrides: dict[str, dict[str, Any]], message: str
) -> None:
    path = _spec(tmp_path, **overrides)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert message in str(info.value)
    assert str(info.value).startswith(f"{path}:")
    assert "\n" not in str(info.value)


def test_refusal_names_the_line_of_the_key(tmp_path: Path) -> None:
    path = _spec(tmp_path, limits={"max_input_len": 2048, "max_seq_len": 1024})
    lines = path.read_text().splitlines()
    line = lines.index("max_input_len = 2048") + 1
    with pytest.raises(
        SpecError, match=rf"^{re.escape(str(path))}:{line}: key 'limits\.max_input_len'"
    ):
        load_spec(path)


def test_guided_decoding_can_be_turned_off(tmp_path: Path) -> None:
    assert load_spec(_spec(tmp_path, runtime={"guided_decoding": False})).guided_decoding is False


def test_runtime_overhead_takes_a_unit(tmp_path: Path) -> None:
    assert load_spec(
        _spec(tmp_path, plan={"runtime_overhead": "1536MiB"})
    ).runtime_overhead_bytes == (1536 << 20)


def test_missing_trtllm_section(tmp_path: Path) -> None:
    path = write_spec(tmp_path / "s.toml", {"model": {"hf_model_dir": "a", "work_dir": "b"}})
    with pytest.raises(SpecError, match=r"missing \[trtllm\] table"):
        load_spec(path)


def test_missing_model_dir(tmp_path: Path) -> None:
    path = write_spec(
        tmp_path / "s.toml",
        {"model": {"work_dir": "b"}, "trtllm": {"venv": "v", "quantize_script": "q.py"}},
    )
    with pytest.raises(SpecError, match=r"key 'model': missing required key 'hf_model_dir'"):
        load_spec(path)


def test_unreadable_and_malformed_spec(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"absent\.toml: cannot read spec"):
        load_spec(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nhf_model_dir = 1")
    with pytest.raises(SpecError, match=r"bad\.toml: not valid TOML"):
        load_spec(bad)
