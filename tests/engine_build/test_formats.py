"""The weight formats besides fp8: their quantize.py/trtllm-build flags, bytes and refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_build import cli, commands, formats, planner
from engine_build.checkpoint import read_shape
from engine_build.errors import SpecError
from engine_build.spec import BuildSpec, TrtllmInstall, validate

from .recorded_cli import parse

DATA = Path(__file__).parent / "data"
CKPT = Path("/w/checkpoint")
ENGINE = Path("/w/engine")
GIB = 1 << 30

# Llama-3.1-8B per block: (in, out) of q, k, v, o, gate, up, down.
LAYERS = 32
LINEAR_8B = 6_979_321_856
OUTS_PER_BLOCK = 4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096
INS_PER_BLOCK = 4096 * 6 + 14336
# embedding + lm_head + norms in bfloat16
OTHER_8B = (2 * 128256 * 4096 + LAYERS * 2 * 4096 + 4096) * 2


def spec(**kw: Any) -> BuildSpec:
    kw.setdefault("trtllm", TrtllmInstall(Path("/opt/trtllm"), (), "/opt/src/quantize.py"))
    return BuildSpec(source=Path("s.toml"), hf_model_dir=Path("/m"), work_dir=Path("/w"), **kw)


def test_awq_passes_group_size_and_capped_calibration() -> None:
    ns = parse("quantize.py", commands.quantize_args(spec(quantization="int4_awq"), CKPT))
    assert ns.qformat == "int4_awq" and ns.awq_block_size == 128
    assert ns.calib_size == 32  # quantize.py runs at most 32 AWQ samples whatever is asked
    assert ns.batch_size == 1 and ns.calib_max_seq_length == 512
    s = spec(quantization="w4a8_awq", awq_block_size=64, calib_size=16, calib_batch_size=4)
    ns = parse("quantize.py", commands.quantize_args(s, CKPT))
    assert (ns.qformat, ns.awq_block_size, ns.calib_size, ns.batch_size) == ("w4a8_awq", 64, 16, 4)


def test_weight_only_without_quantized_kv_does_not_calibrate() -> None:
    argv = commands.quantize_args(spec(quantization="int8_wo", kv_cache_dtype="auto"), CKPT)
    ns = parse("quantize.py", argv)
    assert ns.qformat == "int8_wo" and ns.kv_cache_dtype is None
    assert "--calib_size" not in argv and "--awq_block_size" not in argv


def test_non_fp8_formats_take_the_dtype_gemm_plugin() -> None:
    for q, kv in (
        ("int4_awq", "fp8"),
        ("w4a8_awq", "fp8"),
        ("int8_sq", "int8"),
        ("int4_wo", "auto"),
    ):
        ns = parse(
            "trtllm-build",
            commands.build_args(spec(quantization=q, kv_cache_dtype=kv), CKPT, ENGINE),
        )
        assert ns.gemm_plugin == "bfloat16", q
        assert ns.low_latency_gemm_plugin == "disable" and ns.use_fp8_context_fmha == "disable"


def test_kv_cache_dtypes_each_format_allows() -> None:
    validate(spec(quantization="int8_sq", kv_cache_dtype="int8"))
    validate(spec(quantization="int4_awq", kv_cache_dtype="int8"))
    with pytest.raises(
        SpecError, match=r"'fp8' does not go with precision.quantization = 'int8_sq'"
    ):
        validate(spec(quantization="int8_sq"))  # the default KV dtype is fp8
    with pytest.raises(SpecError, match=r"'int8' does not go with .* 'fp8'; use one of auto, fp8"):
        validate(spec(kv_cache_dtype="int8"))


def test_awq_block_size_bounded_and_awq_only() -> None:
    with pytest.raises(SpecError, match="awq_block_size': must be one of 64, 128"):
        validate(spec(quantization="int4_awq", awq_block_size=96))
    with pytest.raises(SpecError, match="applies to int4_awq and w4a8_awq only"):
        validate(spec(quantization="int8_wo", awq_block_size=64))


def test_planner_bytes_per_format_hand_numbers() -> None:
    shape = read_shape(DATA / "llama-3.1-8b")
    bytes_of = {
        q: planner.make_plan(shape, spec(quantization=q, kv_cache_dtype=kv), 80 * GIB).weight_bytes
        for q, kv in (
            ("none", "auto"),
            ("fp8", "fp8"),
            ("int8_wo", "auto"),
            ("int4_wo", "auto"),
            ("int8_sq", "int8"),
            ("int4_awq", "fp8"),
        )
    }
    assert bytes_of["none"] == LINEAR_8B * 2 + OTHER_8B
    assert bytes_of["fp8"] == LINEAR_8B + OTHER_8B
    # weight-only: per-channel bf16 scales
    assert bytes_of["int8_wo"] == LINEAR_8B + LAYERS * OUTS_PER_BLOCK * 2 + OTHER_8B
    assert bytes_of["int4_wo"] == LINEAR_8B // 2 + LAYERS * OUTS_PER_BLOCK * 2 + OTHER_8B
    # SmoothQuant: float32 per-channel scales and per-input smoothing factors
    sq = LINEAR_8B + LAYERS * (OUTS_PER_BLOCK + INS_PER_BLOCK) * 4
    assert bytes_of["int8_sq"] == sq + OTHER_8B
    # AWQ: a bf16 scale per 128 inputs per output, a bf16 pre-quant scale per input, no zeros
    awq = LINEAR_8B // 2 + LINEAR_8B // 128 * 2 + LAYERS * INS_PER_BLOCK * 2
    assert bytes_of["int4_awq"] == awq + OTHER_8B == 5_703_081_984
    plan = planner.make_plan(shape, spec(quantization="int8_sq", kv_cache_dtype="int8"), 80 * GIB)
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128  # one byte per K/V element


def test_engine_group_formats_count_zero_points() -> None:
    int4 = formats.FORMATS["int4_group"].linear_bytes(256, 32, 4, 128)
    int8 = formats.FORMATS["int8_group"].linear_bytes(256, 32, 4, 128)
    assert int4 == 256 * 32 // 2 + 32 * 2 * 4 * 2  # scale and zero per group, float32
    assert int8 == 256 * 32 + 32 * 2 * 4


def test_group_not_dividing_a_layer_names_it() -> None:
    shape = read_shape(DATA / "llama-3.1-8b")
    s = spec(quantization="int4_awq", tp_size=3, gpu_ids=(0, 1, 2))
    with pytest.raises(
        SpecError,
        match=r"self_attn.o_proj: 1365 inputs per rank are not divisible by the group size 128",
    ):
        planner.check_groups(shape, s)
    planner.check_groups(shape, spec(quantization="int4_awq"))


@pytest.mark.parametrize(
    ("quantization", "kv", "cc", "message"),
    [
        (
            "w4a8_awq",
            "fp8",
            (8, 0),
            "FP8 activations on compute capability 8.9 or later; this GPU is 8.0: use int4_awq",
        ),
        ("fp8", "fp8", (8, 6), "FP8 activations on compute capability 8.9"),
        ("int4_awq", "fp8", (8, 0), "kv_cache_dtype = 'fp8' needs compute capability 8.9"),
        ("int8_sq", "int8", (7, 5), "'int8_sq' needs int8_sq kernels on compute capability 8.0"),
    ],
)
def test_formats_the_gpu_cannot_run_are_refused(
    quantization: str, kv: str, cc: tuple[int, int], message: str
) -> None:
    assert message in (formats.capability_problem(quantization, kv, cc) or "")


def test_formats_the_gpu_runs_pass() -> None:
    assert formats.capability_problem("w4a8_awq", "fp8", (9, 0)) is None
    assert formats.capability_problem("int4_awq", "int8", (8, 0)) is None
    assert formats.capability_problem("int8_wo", "auto", (7, 0)) is None


def test_parse_capability() -> None:
    assert formats.parse_capability("9.0") == (9, 0)
    for bad in ("9", "sm90", "9.x", ""):
        with pytest.raises(ValueError, match=r"expected MAJOR\.MINOR"):
            formats.parse_capability(bad)


def test_plan_cli_refuses_w4a8_on_ampere(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from .conftest import spec_sections, write_spec

    sections = spec_sections(checkpoint, tmp_path / "work", fake_trtllm)
    sections["precision"]["quantization"] = "w4a8_awq"
    path = write_spec(tmp_path / "spec.toml", sections)
    argv = ["plan", "--spec", str(path), "--gpu-memory", "80GiB"]
    assert cli.main([*argv, "--compute-capability", "8.0"]) == cli.EXIT_INPUT
    err = capsys.readouterr().err
    assert "w4a8_awq" in err and "this GPU is 8.0" in err and len(err.strip().splitlines()) == 1
    assert cli.main([*argv, "--compute-capability", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "w4a8_awq linear, group 128" in out and "--awq_block_size 128" in out
