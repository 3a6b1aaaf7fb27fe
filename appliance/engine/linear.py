"""The decoder's linear layers: plain (weights in the model dtype), FP8 E4M3 with scales, or
weight-only INT8/INT4 with group-wise scales (`appliance.engine.quantized`).

At batch 1 a decode step reads every weight once, so bytes per weight are the step time on a GPU:
FP8 halves what bf16 reads. The FP8 layer is W8A8 through `torch._scaled_mm`: weights are quantized
once at load, and each call quantizes its activations on the fly (one scale per token row, or one
for the whole tensor), so the product runs on FP8 tensor cores and both operands are one byte.

Scaling follows TensorRT-LLM's FP8 recipe: a scale maps the largest magnitude onto E4M3's largest
finite value (448), values are clamped into [-448, 448] before the cast (E4M3 has no infinity, so
the result must not depend on how a cast treats a value that rounds past 448), and the product is
rescaled by scale_a * scale_b. "channel"
keeps one weight scale per output row and one activation scale per token (rowwise scaling);
"tensor" keeps one scale per weight matrix and per activation tensor.

`torch._scaled_mm` needs both inner dimensions and the output dimension divisible by 16, the
weight operand column-major (a row-major (out, in) weight transposed is), float32 scales and, for
rowwise scaling on CUDA, bfloat16 output; `quantize_linear` refuses shapes it cannot take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from appliance.engine.quantized import GroupQuant, quantize_group_linear

__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "Fp8Linear",
    "Linear",
    "PlainLinear",
    "Scaling",
    "WeightQuant",
    "dequantize",
    "quantize",
    "quantize_linear",
]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# A scale is never zero: an all-zero row (or activation) would otherwise divide 0 by 0.
_MIN_SCALE = 1e-12
# `torch._scaled_mm`'s alignment rule for every dimension but the activation rows.
_FP8_ALIGN = 16

Scaling = Literal["channel", "tensor"]
# How a block's linear layers are stored when not in the model dtype: FP8 with that scaling, or a
# weight-only group-wise integer format.
WeightQuant = Scaling | GroupQuant


class Linear(Protocol):
    """y = x @ W.T for x of shape (tokens, in); what a decoder block calls."""

    @property
    def nbytes(self) -> int:
        """Bytes of weight (and scale) storage: what a batch-1 step reads."""
        ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class PlainLinear:
    """A weight in the model dtype."""

    weight: torch.Tensor  # (out, in)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def quantize(x: torch.Tensor, scaling: Scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 tensor, float32 scales) with x ≈ q * scale.

    "channel": one scale per row of a 2-D x, shape (rows, 1); "tensor": one scale, shape ().
    """
    magnitude = x.detach().abs().float()
    amax = magnitude.amax(dim=-1, keepdim=True) if scaling == "channel" else magnitude.amax()
    scale = (amax / E4M3_MAX).clamp(min=_MIN_SCALE)
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values an E4M3 tensor and its scales stand for."""
    return q.float() * scale


@dataclass
class Fp8Linear:
    """An E4M3 weight with float32 scales; activations are quantized per call."""

    weight: torch.Tensor  # (out, in), float8_e4m3fn, row-major
    scale: torch.Tensor  # (out, 1) for "channel", () for "tensor"; float32
    scaling: Scaling
    out_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize(x, self.scaling)
        # Rowwise scaling takes scale_a as (tokens, 1) and scale_b as (1, out).
        scale_b = self.scale.view(1, -1) if self.scaling == "channel" else self.scale
        return torch._scaled_mm(
            xq, self.weight.t(), scale_a=x_scale, scale_b=scale_b, out_dtype=self.out_dtype
        )


def quantize_linear(
    name: str, weight: torch.Tensor, scaling: WeightQuant, out_dtype: torch.dtype
) -> Linear:
    """Quantize an (out, in) weight at load; `name` says which in a refusal (ValueError)."""
    if isinstance(scaling, GroupQuant):
        return quantize_group_linear(name, weight, scaling, out_dtype)
    out_features, in_features = weight.shape
    if out_features % _FP8_ALIGN or in_features % _FP8_ALIGN:
        raise ValueError(
            f"{name}: shape ({out_features}, {in_features}) cannot take FP8 weights: "
            f"torch._scaled_mm needs both dimensions divisible by {_FP8_ALIGN}; serve this "
            "checkpoint with --weights dtype"
        )
    with torch.inference_mode():
        q, scale = quantize(weight, scaling)
    return Fp8Linear(q.contiguous(), scale, scaling, out_dtype)
