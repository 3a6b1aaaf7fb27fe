"""Generated commands parsed by the recorded TensorRT-LLM 1.2 argument lists.

The argument lists (tests/engine_build/data/trtllm_1_2_cli.json; sources and commits in
data/README.md) are rebuilt into argparse parsers, so a misspelt flag or a value outside the
real choices fails here instead of on a GPU host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_build import commands
from engine_build.spec import BuildSpec, TrtllmInstall

from .recorded_cli import CliError, parse

CKPT = Path("/w/checkpoint")
ENGINE = Path("/w/engine")

# Flags the build must always pass explicitly (their defaults moved between releases).
EXPLICIT = (
    "--gpt_attention_plugin",
    "--gemm_plugin",
    "--low_latency_gemm_plugin",
    "--gemm_swiglu_plugin",
    "--low_latency_gemm_swiglu_plugin",
    "--fp8_rowwise_gemm_plugin",
    "--nccl_plugin",
    "--lora_plugin",
    "--context_fmha",
    "--remove_input_padding",
    "--use_paged_context_fmha",
    "--tokens_per_block",
    "--use_fp8_context_fmha",
    "--multiple_profiles",
    "--use_fused_mlp",
    "--reduce_fusion",
    "--user_buffer",
    "--norm_quant_fusion",
    "--kv_cache_type",
)


def spec(**kw: Any) -> BuildSpec:
    kw.setdefault("gpu_ids", tuple(range(kw.get("tp_size", 1))))
    kw.setdefault("trtllm", TrtllmInstall(Path("/opt/trtllm"), (), "/opt/src/quantize.py"))
    return BuildSpec(
        source=Path("s.toml"), hf_model_dir=Path("/m/llama"), work_dir=Path("/w"), **kw
    )


VARIANTS: dict[str, dict[str, Any]] = {
    "default fp8": {},
    "low latency gemm": {"gemm": "low_latency_gemm_plugin"},
    "gemm swiglu": {"gemm_swiglu": "gemm_swiglu_plugin"},
    "low latency gemm swiglu": {
        "gemm": "low_latency_gemm_plugin",
        "gemm_swiglu": "low_latency_gemm_swiglu_plugin",
    },
    "kv reuse": {"enable_kv_cache_reuse": True, "tokens_per_block": 64},
    "bf16": {"quantization": "none", "kv_cache_dtype": "auto"},
    "bf16 weights fp8 kv": {"quantization": "none"},
    "tp2": {"tp_size": 2},
    "opt tokens": {"multiple_profiles": False, "opt_num_tokens": 256},
    "float16 calib dataset": {"dtype": "float16", "calib_dataset": "/data/cnn"},
    "int4 awq": {"quantization": "int4_awq"},
    "int4 awq group 64 int8 kv": {
        "quantization": "int4_awq",
        "awq_block_size": 64,
        "kv_cache_dtype": "int8",
    },
    "w4a8 awq": {"quantization": "w4a8_awq"},
    "int8 smoothquant": {"quantization": "int8_sq", "kv_cache_dtype": "int8"},
    "int8 weight-only": {"quantization": "int8_wo", "kv_cache_dtype": "auto"},
    "int4 weight-only fp8 kv": {"quantization": "int4_wo"},
}


@pytest.mark.parametrize("name", VARIANTS)
def test_trtllm_build_argv_parses_with_real_cli(name: str) -> None:
    s = spec(**VARIANTS[name])
    argv = commands.build_args(s, CKPT, ENGINE)
    ns = parse("trtllm-build", argv)
    assert ns.checkpoint_dir == str(CKPT) and ns.output_dir == str(ENGINE)
    assert ns.max_batch_size == 1 and ns.max_beam_width == 1
    assert ns.max_seq_len == s.max_seq_len and ns.max_input_len == s.max_input_len
    assert ns.workers == s.tp_size
    for flag in EXPLICIT:
        assert flag in argv, flag
    # The real build.py refuses this combination at run time.
    assert not (ns.multiple_profiles == "enable" and ns.opt_num_tokens is not None)


@pytest.mark.parametrize("name", VARIANTS)
def test_quantize_argv_parses_with_real_cli(name: str) -> None:
    s = spec(**VARIANTS[name])
    ns = parse("quantize.py", commands.quantize_args(s, CKPT))
    assert ns.model_dir == "/m/llama" and ns.output_dir == str(CKPT)
    assert ns.tp_size == s.tp_size
    assert ns.qformat == s.weight_format.qformat
    assert ns.kv_cache_dtype == (None if s.kv_cache_dtype == "auto" else s.kv_cache_dtype)
    assert ns.calib_dataset == s.calib_dataset


def test_default_is_the_reference_low_latency_recipe() -> None:
    ns = parse("trtllm-build", commands.build_args(spec(), CKPT, ENGINE))
    assert ns.gemm_plugin == "fp8" and ns.low_latency_gemm_plugin == "disable"
    assert ns.use_fp8_context_fmha == "enable"
    assert ns.use_paged_context_fmha == "disable"  # no KV reuse -> faster unpaged context FMHA
    assert ns.multiple_profiles == "enable" and ns.opt_num_tokens is None
    assert ns.use_fused_mlp == "enable"
    assert ns.reduce_fusion == "disable"  # only matters at TP>1
    assert ns.max_num_tokens == 2048 and ns.tokens_per_block == 32
    assert ns.gpt_attention_plugin == "bfloat16"


def test_low_latency_gemm_knob_swaps_the_gemm_plugin() -> None:
    ns = parse(
        "trtllm-build", commands.build_args(spec(gemm="low_latency_gemm_plugin"), CKPT, ENGINE)
    )
    assert ns.low_latency_gemm_plugin == "fp8" and ns.gemm_plugin == "disable"


@pytest.mark.parametrize(
    ("gemm", "swiglu", "flags"),
    [
        ("gemm_plugin", "none", ("disable", "disable")),
        ("gemm_plugin", "gemm_swiglu_plugin", ("fp8", "disable")),
        ("low_latency_gemm_plugin", "low_latency_gemm_swiglu_plugin", ("disable", "fp8")),
    ],
)
def test_swiglu_knob_sets_exactly_one_fused_plugin(
    gemm: str, swiglu: str, flags: tuple[str, str]
) -> None:
    s = spec(gemm=gemm, gemm_swiglu=swiglu)
    ns = parse("trtllm-build", commands.build_args(s, CKPT, ENGINE))
    assert (ns.gemm_swiglu_plugin, ns.low_latency_gemm_swiglu_plugin) == flags
    # trtllm-build raises "GemmSwiGLU plugin requires --use_fused_mlp flag" otherwise.
    assert ns.use_fused_mlp == "enable"


def test_kv_reuse_builds_paged_context_fmha() -> None:
    ns = parse("trtllm-build", commands.build_args(spec(enable_kv_cache_reuse=True), CKPT, ENGINE))
    assert ns.use_paged_context_fmha == "enable"


def test_tp2_enables_nccl_and_reduce_fusion() -> None:
    ns = parse("trtllm-build", commands.build_args(spec(tp_size=2), CKPT, ENGINE))
    assert ns.nccl_plugin == "bfloat16" and ns.reduce_fusion == "enable" and ns.workers == 2


def test_recorded_cli_rejects_what_the_real_one_rejects() -> None:
    with pytest.raises(CliError):
        parse("trtllm-build", ["--low_latency_gemm_plugin", "bfloat16"])
    with pytest.raises(CliError):
        parse("trtllm-build", ["--use_paged_kv_cache", "enable"])
    with pytest.raises(CliError):
        parse("quantize.py", ["--qformat", "fp8_block"])


def test_venv_and_container_invocations() -> None:
    venv_spec = spec()
    assert commands.quantize_command(venv_spec, CKPT)[:2] == [
        "/opt/trtllm/bin/python",
        "/opt/src/quantize.py",
    ]
    assert commands.build_command(venv_spec, CKPT, ENGINE)[0] == "/opt/trtllm/bin/trtllm-build"
    c = spec(trtllm=TrtllmInstall(None, ("docker", "run", "img"), "/src/quantize.py"))
    assert commands.build_command(c, CKPT, ENGINE)[:4] == ["docker", "run", "img", "trtllm-build"]
    assert commands.version_command(c)[:4] == ["docker", "run", "img", "python3"]
    assert "import tensorrt_llm" not in " ".join(commands.version_command(c))
