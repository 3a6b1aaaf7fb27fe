"""Weight-only INT8/INT4 layers against the float reference, and their refusals at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from appliance.engine.llama import CheckpointError, LlamaModel
from appliance.engine.quality import greedy
from appliance.engine.quantized import (
    GroupQuant,
    Int4Linear,
    Int8Linear,
    dequantize_int8,
    quantize_group_linear,
)
from appliance.engine.random_weights import random_model


def _weight(out_features: int = 64, in_features: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[3, 17] = 1.5  # an outlier spoils its own group only
    return w


def _group_bound(w: torch.Tensor, group: int, levels: int) -> torch.Tensor:
    """Half a quantization step per group, broadcast to the weight's shape."""
    g = w.reshape(w.shape[0], -1, group)
    span = g.amax(-1) - g.amin(-1) if levels == 15 else 2 * g.abs().amax(-1)
    step = span / levels
    return (step / 2).repeat_interleave(group, dim=1)


def test_int8_weight_within_half_a_step_per_group() -> None:
    w = _weight()
    layer = quantize_group_linear("w", w, GroupQuant(8, 64), torch.float32)
    assert isinstance(layer, Int8Linear)
    err = (dequantize_int8(layer.weight, layer.scale, torch.float32) - w).abs()
    assert bool((err <= _group_bound(w, 64, 254) + 1e-7).all())
    # The outlier's group has a coarse step; every other group keeps a fine one.
    assert err[3, :64].max() > 5 * err[3, 64:].max()


def test_int8_output_matches_float_reference() -> None:
    w = _weight()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    layer = quantize_group_linear("w", w, GroupQuant(8, 128), torch.float32)
    ref = x @ w.t()
    rel = (layer(x) - ref).norm() / ref.norm()
    assert rel < 0.01  # stated tolerance: 1 % relative (Frobenius) error
    assert layer.nbytes == 64 * 256 + 64 * 2 * 4


@pytest.mark.parametrize("kernel", ["int4pack", "dequantize"])
def test_int4_weight_within_half_a_step_and_output_close(kernel: str) -> None:
    w = _weight()
    layer = quantize_group_linear("w", w, GroupQuant(4, 64), torch.float32, kernel)  # type: ignore[arg-type]
    assert isinstance(layer, Int4Linear) and layer.kernel == kernel
    err = (layer.dequantized(torch.float32) - w).abs()
    assert bool((err <= _group_bound(w, 64, 15) + 1e-5).all())
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    ref = x @ w.t()
    rel = (layer(x) - ref).norm() / ref.norm()
    assert rel < 0.12  # stated tolerance for 4 bits with an outlier group: 12 % relative
    assert layer.nbytes == 64 * 256 // 2 + (256 // 64) * 64 * 2 * 4


def test_int4_kernel_and_dequantize_paths_agree() -> None:
    w = _weight(seed=3)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    fast = quantize_group_linear("w", w, GroupQuant(4, 128), torch.float32, "int4pack")
    slow = quantize_group_linear("w", w, GroupQuant(4, 128), torch.float32, "dequantize")
    torch.testing.assert_close(fast(x), slow(x), rtol=1e-4, atol=1e-4)


def test_int4_kernel_in_bfloat16() -> None:
    w = _weight(seed=5)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    fast = quantize_group_linear("w", w, GroupQuant(4, 128), torch.bfloat16, "int4pack")
    slow = quantize_group_linear("w", w, GroupQuant(4, 128), torch.bfloat16, "dequantize")
    assert fast(x).dtype == torch.bfloat16
    torch.testing.assert_close(fast(x).float(), slow(x).float(), rtol=0.02, atol=0.02)


def test_rows_the_cpu_kernel_cannot_pack_fall_back_to_dequantize() -> None:
    layer = quantize_group_linear("w", _weight(out_features=40), GroupQuant(4, 128), torch.float32)
    assert isinstance(layer, Int4Linear) and layer.kernel == "dequantize"


def test_group_not_dividing_inputs_is_refused_with_the_layer_name() -> None:
    with pytest.raises(
        ValueError,
        match=r"^blk\.w: 576 inputs are not divisible by the weight group 128; use --weight-group 64$",
    ):
        quantize_group_linear("blk.w", torch.zeros(32, 576), GroupQuant(4, 128), torch.float32)
    with pytest.raises(ValueError, match="weight group 48 is not one of 32, 64, 128, 256"):
        quantize_group_linear("blk.w", torch.zeros(32, 96), GroupQuant(8, 48), torch.float32)


def test_checkpoint_whose_shapes_the_group_cannot_take_is_refused_at_load(micro_dir: Path) -> None:
    # The micro model's hidden size is 48: no supported group divides it.
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.qkv: 48 inputs"):
        LlamaModel.load(micro_dir, fp8=GroupQuant(8, 32))


def test_tiny_model_int8_greedy_tokens_equal_float() -> None:
    reference = random_model("tiny", seed=7)
    int8 = random_model("tiny", fp8=GroupQuant(8, 128), seed=7)
    assert int8.weight_bytes < reference.weight_bytes
    for prompt in ([5, 9, 200, 31], [1, 2, 3], [400, 17, 17, 17, 88, 9]):
        assert greedy(int8, prompt, 24) == greedy(reference, prompt, 24)


def test_tiny_model_int4_greedy_tokens_mostly_agree() -> None:
    reference = random_model("tiny", seed=7)
    int4 = random_model("tiny", fp8=GroupQuant(4, 128), seed=7)
    same = total = 0
    for prompt in ([5, 9, 200, 31], [1, 2, 3], [400, 17, 17, 17, 88, 9]):
        ref = greedy(reference, prompt, 16)
        got = greedy(int4, prompt, 16)
        # Count up to the first divergence: after it, the two continue from different text.
        agree = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), 16)
        same += agree
        total += 16
    assert same / total >= 0.5  # stated bound for 4-bit random weights


def test_float32_prefill_through_the_int4_kernel_stays_close() -> None:
    # Many float32 rows run the CPU kernel in bfloat16 (its float32 path is slow for them).
    w = _weight(seed=8)
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(9))
    fast = quantize_group_linear("w", w, GroupQuant(4, 64), torch.float32, "int4pack")
    slow = quantize_group_linear("w", w, GroupQuant(4, 64), torch.float32, "dequantize")
    got = fast(x)
    assert got.dtype == torch.float32
    ref = slow(x)
    assert (got - ref).norm() / ref.norm() < 0.01  # bfloat16 activations: 1 % relative
