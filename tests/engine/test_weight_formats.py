"""The engine server's --weights int8/int4 options: refusals and the fit check's bytes."""

from __future__ import annotations

import pytest
import torch

from appliance.engine.options import EngineOptions, FitError, check_fit
from appliance.engine.quantized import GroupQuant
from appliance.engine.random_weights import random_config, random_model
from appliance.engine.repository import KvCacheParams

KV = KvCacheParams(
    max_seq_len=None,
    tokens_per_block=32,
    enable_reuse=False,
    max_tokens=None,
    free_mem_fraction=0.9,
)


def test_weight_options_resolve_to_group_formats() -> None:
    assert EngineOptions(weights="int8").weight_quant == GroupQuant(8, 128)
    assert EngineOptions(weights="int4", weight_group=64).weight_quant == GroupQuant(4, 64)
    assert EngineOptions(weights="fp8", fp8_scaling="tensor").weight_quant == "tensor"
    assert EngineOptions().weight_quant is None
    assert EngineOptions(weights="int4", weight_group=64).weights_label == "int4 (group 64)"


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        (
            EngineOptions(weights="int4", weight_group=100),
            ("--weight-group 100", "expected one of 32, 64, 128, 256"),
        ),
        (
            EngineOptions(weight_group=64),
            ("--weight-group 64", "applies to --weights int8 or int4 only"),
        ),
    ],
)
def test_bad_weight_options_refused(options: EngineOptions, problem: tuple[str, str]) -> None:
    assert options.problem() == problem


def test_int_weights_run_in_float32_and_bfloat16() -> None:
    assert EngineOptions(weights="int4").problem() is None
    assert EngineOptions(weights="int8", dtype="bfloat16").problem() is None


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_fit_check_counts_the_bytes_the_layers_hold(weights: str) -> None:
    config = random_config("tiny")
    options = EngineOptions(weights=weights)  # type: ignore[arg-type]
    plan = check_fit(config, options, KV, 256, 64, 0, free_bytes=8 << 30)
    model = random_model("tiny", fp8=options.weight_quant)
    linear = sum(
        layer.wqkv.nbytes + layer.wo.nbytes + layer.w13.nbytes + layer.w2.nbytes
        for layer in model.layers
    )
    c = config
    others = 2 * c.vocab_size * c.hidden_size + c.num_hidden_layers * 2 * c.hidden_size
    others += c.hidden_size
    assert plan.weight_bytes == linear + others * 4  # float32 on the CPU


def test_fit_check_int4_needs_fewer_bytes_and_says_so() -> None:
    config = random_config("llama-3.1-8b")
    sizes = {
        w: check_fit(
            config,
            EngineOptions(dtype="bfloat16", weights=w),
            KV,
            8192,
            2048,
            0,
            80 << 30,
        ).weight_bytes
        for w in ("dtype", "fp8", "int8", "int4")
    }
    assert sizes["int4"] < sizes["int8"] < sizes["dtype"]
    assert sizes["fp8"] < sizes["int8"]  # int8 adds a scale per 128 inputs
    with pytest.raises(FitError, match=r"weights .* \(int8 \(group 128\)\).*use --weights int4"):
        check_fit(
            config, EngineOptions(dtype="bfloat16", weights="int8"), KV, 8192, 2048, 0, 8 << 30
        )


def test_int8_model_runs_in_bfloat16() -> None:
    model = random_model("tiny", dtype=torch.bfloat16, fp8=GroupQuant(8, 128), seed=3)
    logits = model.forward(list(range(1, 20)), model.new_cache(32), 0)
    assert torch.isfinite(logits).all()
