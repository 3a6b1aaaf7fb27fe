"""The INT8/INT4 weight-only matrix-vector kernels against the dequantised torch reference, and
where the decode step uses them; on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set
by conftest.py; on a CUDA host they run compiled)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from appliance.engine import fused, kernels, quantized
from appliance.engine.quantized import (
    GroupQuant,
    Int4Linear,
    Int8Linear,
    dequantize_int8,
    quantize_group_linear,
)
from appliance.engine.random_weights import random_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (out, in, group): rows not a multiple of the 16-row tile (40, 17, 33), inputs not a multiple of
# the 256-wide tile (384, 320) or narrower than it (96), every group size.
SHAPES = [(40, 384, 128), (24, 96, 32), (17, 320, 64), (33, 512, 256)]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
# Against the float32 product of the dequantised weight (scales in the model dtype, widened
# exactly): float32 differs only in summation order; a bfloat16 result by its own rounding, half a
# unit in the last place (2^-8) compiled, one (2^-7) in the interpreter, which rounds toward zero.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 1e-3)}
# Against the layer's eager call, which rounds the dequantised weight and the product to bf16.
EAGER_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _layer(bits: int, shape: tuple[int, int, int], dtype: torch.dtype) -> Int8Linear | Int4Linear:
    out_features, in_features, group = shape
    gen = torch.Generator().manual_seed(out_features * in_features + group)
    w = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5
    w[0, :group] *= 30  # one outlier group: its own scale, the rest untouched
    fmt = GroupQuant(8 if bits == 8 else 4, group)
    return quantize_group_linear("w", w.to(DEVICE), fmt, dtype, int4_kernel="dequantize")


def _tokens(n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(n)).to(DEVICE, dtype)


def _run(layer: Int8Linear | Int4Linear, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, Int8Linear):
        return kernels.int8_matvec(x, layer.weight, layer.scale)
    return kernels.int4_matvec(x, layer.packed, layer.scales_and_zeros, layer.group_size)


def _dequantized_f32(layer: Int8Linear | Int4Linear) -> torch.Tensor:
    if isinstance(layer, Int8Linear):
        return dequantize_int8(layer.weight, layer.scale, torch.float32)
    return layer.dequantized(torch.float32)


@DTYPES
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tokens", [1, 3])
def test_the_matvec_equals_the_dequantized_product(
    bits: int, shape: tuple[int, int, int], dtype: torch.dtype, tokens: int
) -> None:
    layer = _layer(bits, shape, dtype)
    x = _tokens(tokens, shape[1], dtype)
    got = _run(layer, x)
    assert got.shape == (tokens, shape[0]) and got.dtype == dtype
    rtol, atol = TOLERANCE[dtype]
    ref = x.float() @ _dequantized_f32(layer).t()  # weight-only: x is not quantised
    torch.testing.assert_close(got.float(), ref, rtol=rtol, atol=atol)
    rtol, atol = EAGER_TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), layer(x).float(), rtol=rtol, atol=atol)


def test_a_bad_width_is_refused_before_the_launch() -> None:
    layer = _layer(4, (16, 128, 32), torch.float32)
    assert isinstance(layer, Int4Linear)
    with pytest.raises(
        ValueError, match=r"shape \(1, 96\) for a weight of 128 inputs: needs rows of 128"
    ):
        kernels.int4_matvec(_tokens(1, 96, torch.float32), layer.packed, layer.scales_and_zeros, 32)
    layer8 = _layer(8, (16, 128, 32), torch.float32)
    assert isinstance(layer8, Int8Linear)
    with pytest.raises(ValueError, match=r"shape \(1, 160\) for a weight of 128 inputs"):
        kernels.int8_matvec(_tokens(1, 160, torch.float32), layer8.weight, layer8.scale)


@DTYPES
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("tokens", [1, 3])
def test_a_gated_matvec_equals_silu_mul_then_the_matvec(
    bits: int, dtype: torch.dtype, tokens: int
) -> None:
    """SiLU(gate) * up taken while loading the input: the same rounding as the two launches, so
    the same result up to summation order."""
    layer = _layer(bits, (40, 384, 128), dtype)

    def gated(x: torch.Tensor) -> torch.Tensor:
        if isinstance(layer, Int8Linear):
            return kernels.int8_matvec(x, layer.weight, layer.scale, gated=True)
        return kernels.int4_matvec(x, layer.packed, layer.scales_and_zeros, 128, gated=True)

    gate_up = 3 * _tokens(tokens, 2 * 384, dtype)
    got = gated(gate_up)
    torch.testing.assert_close(got, _run(layer, kernels.silu_mul(gate_up)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs gate and up rows of 768"):
        gated(_tokens(1, 384, dtype))


def _spy(monkeypatch: pytest.MonkeyPatch, kind: str) -> list[tuple[int, ...]]:
    """Record the x shape of each one-token product of weight kind `kind` ("int8", "int4"),
    which still runs."""
    calls: list[tuple[int, ...]] = []
    real: Callable[..., torch.Tensor] = kernels.token_product

    def spy(x: torch.Tensor, weight: kernels.TokenWeight, **kwargs: Any) -> torch.Tensor:
        if weight.kind == kind:
            calls.append(tuple(x.shape))
        return real(x, weight, **kwargs)

    monkeypatch.setattr(kernels, "token_product", spy)
    return calls


def test_the_step_matvec_takes_the_kernel_for_int8_and_int4_dequantize_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    int8 = _spy(monkeypatch, "int8")
    int4 = _spy(monkeypatch, "int4")
    x = _tokens(1, 128, torch.float32)
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    fused.matvec(quantize_group_linear("w", w, GroupQuant(8, 32), torch.float32), x)
    assert int8 == [(1, 128)] and int4 == []
    layer = quantize_group_linear("w", w, GroupQuant(4, 32), torch.float32, "dequantize")
    fused.matvec(layer, x)
    assert int4 == [(1, 128)]
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and DEVICE.type == "cpu":
        # torch's CPU int4 kernel's packed layout is not the one the Triton kernel reads.
        packed = quantize_group_linear("w", w, GroupQuant(4, 32), torch.float32, "int4pack")
        torch.testing.assert_close(fused.matvec(packed, x), packed(x))
        assert int4 == [(1, 128)]


@pytest.mark.parametrize("bits", [8, 4])
def test_decode_steps_on_triton_kernels_use_the_matvec_and_prefill_does_not(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the fused Triton step (`kernels` "triton": auto on a CUDA device where Triton imports)
    each of a block's four linear layers takes the kernel once per decode step, at one token; a
    prefill takes the row-tile kernel instead (`test_fused_rows`), and the eager torch step the
    layers' own dequantising call."""
    # The layout a CUDA device gets; on the CPU torch's own int4 kernel would be chosen.
    monkeypatch.setattr(quantized, "_int4_kernel", lambda weight: "dequantize")
    model = random_model("tiny", DEVICE, torch.bfloat16, GroupQuant(bits, 32), seed=5)  # type: ignore[arg-type]
    calls = _spy(monkeypatch, f"int{bits}")
    model.kernels = "triton"
    prompt = [7, 300, 42, 11, 5]
    cache = model.new_cache(64)
    model.forward(prompt, cache, 0)
    assert calls == []
    step_in = torch.tensor([9, len(prompt)], device=DEVICE)
    got = torch.empty(model.config.vocab_size, dtype=torch.float32, device=DEVICE)
    ref = torch.empty_like(got)
    with torch.inference_mode():
        model.decode_static(step_in, cache, 16, got)
        assert len(calls) == 4 * model.config.num_hidden_layers
        assert {rows for rows, _ in calls} == {1}
        calls.clear()
        model.kernels = "torch"
        model.decode_static(step_in, cache, 16, ref)
    assert calls == []
    # The eager step rounds each dequantised weight to bf16; the kernel keeps it in float32.
    assert float((got - ref).norm() / ref.norm()) < 0.01


def test_auto_kernels_are_triton_only_on_cuda_where_triton_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The condition of the tests above: the decode step runs on the Triton kernels (and so INT8
    and INT4 on the matvec) by default only on a CUDA device where Triton imports."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kernels.resolve_kernels("auto", cpu) == "torch"  # even under the interpreter
    monkeypatch.setattr(kernels, "triton_problem", lambda device: None)
    assert kernels.resolve_kernels("auto", cuda) == "triton"
    monkeypatch.setattr(kernels, "triton_problem", lambda device: "no triton")
    assert kernels.resolve_kernels("auto", cuda) == "torch"
    assert kernels.resolve_kernels("torch", cuda) == "torch"
