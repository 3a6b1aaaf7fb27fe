"""Fit arithmetic against numbers computed by hand from the public Llama-3.1 shapes.

Llama-3.1-8B: V=128256, H=4096, I=14336, L=32, heads 32, KV heads 8, head_dim 128.
  per layer: q 4096*4096=16,777,216; k,v 4096*1024=4,194,304 each; o 16,777,216
             -> attention 41,943,040; MLP 3*4096*14336 = 176,160,768 -> linear 218,103,808
  linear 32*218,103,808 = 6,979,321,856; embedding = lm_head = 128256*4096 = 525,336,576;
  norms 32*2*4096 + 4096 = 266,240; total 8,030,261,248 (the published "8.03B").
  fp8 weights: 6,979,321,856*1 + (525,336,576*2 + 266,240)*2 = 9,081,200,640 B.
  KV/token fp8: 2 * 32 layers * 8 heads * 128 * 1 B = 65,536 B; 4096 tokens -> 268,435,456 B.
  activations: 2048 tok * (4096 + 4096 + 2*8*128 + 2*14336 = 38,912) * 2 B * 2 = 318,767,104.
  logits: 128256 * 4 = 513,024. overhead: 1024 MiB + 1 graph * 32 MiB = 1,107,296,256.
  80 GiB = 85,899,345,920 -> rest 75,391,568,896 -> pool floor(0.9*rest) = 67,852,412,006.
Llama-3.1-70B: H=8192, I=28672, L=80, heads 64, KV 8.
  linear/layer: 2*8192*8192 + 2*8192*1024 + 3*8192*28672 = 855,638,016; *80 = 68,451,041,280
  embedding = lm_head = 1,050,673,152; norms 80*2*8192 + 8192 = 1,318,912
  total 70,553,706,496; fp8: 68,451,041,280 + (2*1,050,673,152 + 1,318,912)*2 = 72,656,371,712
  TP2: 68,451,041,280/2 + (1,050,673,152 + 525,336,576 + 1,318,912)*2 = 37,380,177,920
  KV/token fp8 TP1: 2*80*8*128 = 163,840; TP2 (4 heads/rank): 81,920.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_build import planner
from engine_build.checkpoint import ModelShape, read_shape, shape_from_config
from engine_build.errors import BuildError
from engine_build.spec import BuildSpec

from .conftest import DATA

GIB = 1 << 30


def spec(**kw: Any) -> BuildSpec:
    kw.setdefault("gpu_ids", tuple(range(kw.get("tp_size", 1))))
    return BuildSpec(source=Path("s.toml"), hf_model_dir=Path("m"), work_dir=Path("w"), **kw)


def shape(name: str) -> ModelShape:
    return read_shape(DATA / name)


def test_llama_8b_fp8_on_80gib_hand_numbers() -> None:
    p = planner.make_plan(shape("llama-3.1-8b"), spec(), 80 * GIB)
    assert p.params.total == 8_030_261_248
    assert p.params.linear == 6_979_321_856
    assert p.weight_bytes == 9_081_200_640
    assert p.kv_bytes_per_token == 65_536
    assert p.kv_tokens_needed == 4096
    assert p.kv_bytes_needed == 268_435_456
    assert p.activation_bytes == 318_767_104
    assert p.logits_bytes == 513_024
    assert p.overhead_bytes == 1_107_296_256
    assert p.kv_pool_bytes == 67_852_412_006
    assert p.kv_pool_tokens == 67_852_412_006 // 65_536
    assert p.fits


def test_llama_8b_bf16_doubles_linear_and_kv() -> None:
    p = planner.make_plan(
        shape("llama-3.1-8b"), spec(quantization="none", kv_cache_dtype="auto"), 80 * GIB
    )
    assert p.weight_bytes == 8_030_261_248 * 2 == 16_060_522_496
    assert p.kv_bytes_per_token == 131_072


def test_llama_70b_fp8_fits_one_80gib_gpu() -> None:
    p = planner.make_plan(shape("llama-3.1-70b"), spec(), 80 * GIB)
    assert p.params.total == 70_553_706_496
    assert p.weight_bytes == 72_656_371_712
    assert p.kv_bytes_per_token == 163_840
    assert p.activation_bytes == 2048 * (8192 + 8192 + 2048 + 2 * 28672) * 2 * 2 == 620_756_992
    rest = 80 * GIB - 72_656_371_712 - 620_756_992 - 513_024 - 1_107_296_256
    assert p.kv_pool_bytes == int(rest * 0.9) == 10_362_967_142
    assert p.fits


def test_llama_70b_bf16_does_not_fit_80gib_and_advice_names_fp8() -> None:
    s = spec(quantization="none", kv_cache_dtype="auto")
    p = planner.make_plan(shape("llama-3.1-70b"), s, 80 * GIB)
    assert p.weight_bytes == 141_107_412_992
    assert not p.fits and p.kv_pool_bytes == 0
    tips = planner.advice(p, s)
    assert tips[0].startswith("set precision.quantization = 'fp8'")
    assert "DOES NOT FIT" in planner.render_table(p, s)


def test_llama_70b_fp8_tp2_splits_weights_and_kv_heads() -> None:
    s = spec(tp_size=2)
    assert planner.make_plan(shape("llama-3.1-70b"), spec(), 48 * GIB).fits is False
    p = planner.make_plan(shape("llama-3.1-70b"), s, 48 * GIB)
    assert p.weight_bytes == 37_380_177_920
    assert p.kv_bytes_per_token == 81_920
    assert p.fits


def test_kv_heads_replicated_when_tp_exceeds_them() -> None:
    sh = shape("llama-3.1-8b")
    assert planner.kv_heads_per_gpu(sh, 8) == 1
    assert planner.kv_heads_per_gpu(sh, 16) == 1


def test_sequence_rounds_up_to_whole_kv_blocks() -> None:
    p = planner.make_plan(
        shape("llama-3.1-8b"), spec(max_seq_len=4097, tokens_per_block=64), 80 * GIB
    )
    assert p.kv_tokens_needed == 4160  # ceil(4097/64) = 65 blocks
    assert p.kv_bytes_needed == 4160 * 65_536


def test_tight_gpu_reports_the_largest_sequence_that_fits() -> None:
    s = spec(max_seq_len=131072, max_input_len=2048)
    # 10 GiB: rest = 10 GiB - weights - act - logits - overhead; pool well under 131072 tokens
    p = planner.make_plan(shape("llama-3.1-8b"), s, 10 * GIB)
    assert not p.fits
    tips = planner.advice(p, s)
    assert any(t.startswith(f"lower limits.max_seq_len to <= {p.kv_pool_tokens}") for t in tips)


def test_unsupported_architecture_refused() -> None:
    with pytest.raises(BuildError, match="unsupported architecture 'MixtralForCausalLM'"):
        shape_from_config({"architectures": ["MixtralForCausalLM"]}, Path("c.json"))


def test_missing_checkpoint_and_config_are_distinct_errors(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="checkpoint directory missing"):
        read_shape(tmp_path / "nope")
    with pytest.raises(BuildError, match=r"checkpoint config\.json missing"):
        read_shape(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(BuildError, match=r"not valid JSON"):
        read_shape(tmp_path)


def test_bad_kv_heads_refused() -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 5,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
    }
    with pytest.raises(BuildError, match="num_key_value_heads 5 must divide 32"):
        shape_from_config(cfg, Path("c.json"))


@settings(max_examples=200, deadline=None)
@given(
    gib=st.integers(min_value=1, max_value=200),
    seq_pow=st.integers(min_value=10, max_value=17),
    tp=st.sampled_from([1, 2, 4, 8]),
    fp8=st.booleans(),
)
def test_more_memory_never_unfits_and_fp8_never_costs_more(
    gib: int, seq_pow: int, tp: int, fp8: bool
) -> None:
    sh = shape("llama-3.1-70b")
    s = spec(
        tp_size=tp,
        max_seq_len=2**seq_pow,
        max_input_len=1024,
        max_num_tokens=1024,
        quantization="fp8" if fp8 else "none",
        kv_cache_dtype="fp8" if fp8 else "auto",
    )
    small = planner.make_plan(sh, s, gib * GIB)
    big = planner.make_plan(sh, s, (gib + 8) * GIB)
    assert big.kv_pool_bytes >= small.kv_pool_bytes
    assert not small.fits or big.fits
    wide = spec(tp_size=tp, quantization="none", kv_cache_dtype="auto")
    assert planner.weight_bytes_per_gpu(sh, s) <= planner.weight_bytes_per_gpu(sh, wide)
    # Splitting across more ranks never needs more per GPU.
    if tp > 1:
        half = spec(tp_size=tp // 2, quantization=s.quantization, kv_cache_dtype=s.kv_cache_dtype)
        assert planner.weight_bytes_per_gpu(sh, s) <= planner.weight_bytes_per_gpu(sh, half)


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}, "rope_theta"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": [1]}}, "rope_theta"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10**400}}, "rope_theta"),
        ({"rope_theta": 10**400}, "rope_theta"),
        ({"rms_norm_eps": 10**400}, "rms_norm_eps"),
        ({"rope_scaling": {**LLAMA3_SCALING, "factor": 10**400}}, "factor"),
        ({"rope_scaling": {**LLAMA3_SCALING, "factor": "nan"}}, "factor"),
        ({"rope_scaling": {**LLAMA3_SCALING, "low_freq_factor": True}}, "low_freq_factor"),
        (
            {"rope_scaling": {**LLAMA3_SCALING, "original_max_position_embeddings": 8192.5}},
            "original_max_position_embeddings",
        ),
        (
            {"rope_scaling": {**LLAMA3_SCALING, "low_freq_factor": 4.0, "high_freq_factor": 4.0}},
            "high_freq_factor 4 must exceed low_freq_factor 4",
        ),
    ],
)
def test_config_numbers_out_of_any_range_are_one_line_errors(
    overrides: dict[str, Any], key: str
) -> None:
    """A config.json number that is not a finite positive number is a CheckpointError naming
    the key, never a ValueError/OverflowError traceback or a NaN carried into RoPE."""
    cfg = json.loads((DATA / "llama-3.1-8b" / "config.json").read_text())
    cfg.update(overrides)
    if "rope_parameters" in overrides:
        del cfg["rope_scaling"], cfg["rope_theta"]
    with pytest.raises(BuildError, match=key):
        shape_from_config(cfg, Path("c.json"))
