"""The weight-only FP8 product for a few rows (`kernels.fp8_matmul`) against the float32 product
of the widened weight, and where an FP8 layer takes it; on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from appliance.engine import kernels
from appliance.engine.linear import Fp8Linear, quantize_linear

# (rows, out, in): one row, rows not a multiple of the 16-row tile, inputs not a multiple of the
# 64-wide step, outputs not a multiple of the 32-row tile.
SHAPES = [(1, 48, 256), (5, 96, 384), (17, 64, 160), (40, 80, 128)]
# float32 differs from the reference only in summation order; bfloat16 by its own rounding of the
# result (the interpreter rounds toward zero: a unit, 2^-7, not half of one).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 1e-3)}


def _layer(shape: tuple[int, int, int], scaling: str, dtype: torch.dtype) -> Fp8Linear:
    _, n_out, n_in = shape
    gen = torch.Generator().manual_seed(n_out * n_in)
    w = torch.randn(n_out, n_in, generator=gen) * n_in**-0.5
    layer = quantize_linear("w", w, scaling, dtype)  # type: ignore[arg-type]
    assert isinstance(layer, Fp8Linear)
    return layer


def _rows(shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    m, _, n_in = shape
    return torch.randn(m, n_in, generator=torch.Generator().manual_seed(m)).to(dtype)


def _reference(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    return x.float() @ (layer.weight.float() * layer.scale).t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("scaling", ["channel", "tensor"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_product_equals_the_widened_weights_product(
    shape: tuple[int, int, int], scaling: str, dtype: torch.dtype
) -> None:
    layer = _layer(shape, scaling, dtype)
    x = _rows(shape, dtype)
    got = kernels.fp8_matmul(x, layer.weight, layer.scale, dtype)
    assert got.dtype == dtype and got.shape == (shape[0], shape[1])
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), _reference(x, layer), rtol=rtol, atol=atol)


def test_a_weight_of_other_inputs_is_refused() -> None:
    layer = _layer(SHAPES[0], "channel", torch.float32)
    with pytest.raises(ValueError, match=r"input of shape \(2, 128\) for a weight of 128 inputs"):
        kernels.fp8_matmul(torch.zeros(2, 128), layer.weight, layer.scale, torch.float32)


def test_an_fp8_layer_on_a_triton_device_takes_the_product_for_few_rows_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Up to FP8_MATMUL_MAX_ROWS rows (a short prefill, a verify step) the weight-only product;
    more rows quantise the activations for the FP8 tensor cores. The interpreter stands in for
    the CUDA device here."""
    calls: list[tuple[int, ...]] = []
    real = kernels.fp8_matmul

    def spy(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real(x, *args)

    monkeypatch.setattr(kernels, "fp8_matmul", spy)
    monkeypatch.setattr(kernels, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(kernels, "FP8_MATMUL_MAX_ROWS", 8)
    layer = _layer((1, 32, 64), "channel", torch.float32)
    few = torch.randn(2, 3, 64)  # leading dimensions are kept
    got = layer(few)
    assert calls == [(6, 64)] and got.shape == (2, 3, 32)
    torch.testing.assert_close(got, _reference(few.reshape(6, 64), layer).view(2, 3, 32))
    layer(torch.randn(9, 64))
    assert calls == [(6, 64)]  # 9 rows: the quantised product
