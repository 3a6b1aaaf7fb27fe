"""Weight-only INT8 and INT4 linear layers with group-wise scales, quantized at load.

Activations stay in the model dtype; only the weights shrink (W8A16 / W4A16). Each run of
`group_size` consecutive inputs of an output row has its own scale, so one outlier spoils only its
group. Quantization is round-to-nearest from the checkpoint's float weights:

- INT8, symmetric: ``scale = amax / 127``, ``q = round(w / scale)`` in [-127, 127].
- INT4, asymmetric (the layout torch's ``_weight_int4pack_mm`` kernels take): per group
  ``scale = (max - min) / 15``, ``q = round((w - min) / scale)`` in [0, 15], stored with
  ``zero = min + 8 * scale`` so that ``w ≈ (q - 8) * scale + zero``.

Scales and zero points are kept in the model dtype. The INT4 product runs on torch's CPU kernel
``_weight_int4pack_mm_for_cpu`` where it applies (CPU, output rows divisible by 16); everywhere else,
and for INT8, each call dequantizes the weight and multiplies (`F.linear`): correct on any device,
but it writes a full-width copy of the weight per call, so it saves memory, not time (a decode
step on the fused Triton kernels multiplies one token by the INT8 weight or the "dequantize"
INT4 layout in registers instead: `kernels.int8_matvec`, `kernels.int4_matvec`). The CPU
kernel in float32 is fast for one token but far slower than `F.linear` for a 512-token prefill
chunk (bench.weight_kernels, docs/PERFORMANCE.md#weight-formats), so a float32 call with more than `_F32_KERNEL_ROWS` rows
runs the kernel in bfloat16 (activations cast, bfloat16 copies of the scales) and casts back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "GROUP_SIZES",
    "GroupQuant",
    "Int4Linear",
    "Int8Linear",
    "dequantize_int4",
    "dequantize_int8",
    "int4_linear",
    "quantize_group_linear",
    "quantize_int4",
    "quantize_int8",
]

DEFAULT_GROUP_SIZE = 128
# The group sizes torch's int4 kernels accept; INT8 takes the same for one set of choices.
GROUP_SIZES = (32, 64, 128, 256)
_MIN_SCALE = 1e-8
# `_convert_weight_to_int4pack_for_cpu` needs the output rows divisible by 16.
_INT4PACK_ROWS = 16
_F32_KERNEL_ROWS = 4
Int4Kernel = Literal["int4pack", "dequantize"]


@dataclass(frozen=True)
class GroupQuant:
    """A weight-only format: `bits` 8 or 4, one scale per `group_size` inputs per output row."""

    bits: Literal[8, 4]
    group_size: int = DEFAULT_GROUP_SIZE

    @property
    def label(self) -> str:
        return f"int{self.bits} (group {self.group_size})"


def _groups(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    out_features, in_features = weight.shape
    return weight.float().reshape(out_features, in_features // group_size, group_size)


def quantize_int8(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 (out, in), float32 scales (out, in / group)) with w ≈ q * scale per group."""
    g = _groups(weight, group_size)
    scale = (g.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=_MIN_SCALE)
    q = (g / scale).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(weight.shape), scale.squeeze(-1)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out_features, in_features = q.shape
    groups = scale.shape[1]
    w = q.reshape(out_features, groups, in_features // groups).to(dtype) * scale.unsqueeze(-1)
    return w.reshape(out_features, in_features)


def quantize_int4(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q in [0, 15] as int32 (out, in), scale, zero (out, in / group), float32)."""
    g = _groups(weight, group_size)
    low = g.amin(dim=-1, keepdim=True)
    high = g.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=_MIN_SCALE)
    q = ((g - low) / scale).round().clamp(0, 15).to(torch.int32)
    zero = low + 8 * scale
    return q.reshape(weight.shape), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    out_features, in_features = q.shape
    groups = scale.shape[1]
    grouped = q.reshape(out_features, groups, in_features // groups).to(dtype) - 8
    w = grouped * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    return w.reshape(out_features, in_features)


@dataclass
class Int8Linear:
    """INT8 weight (out, in) with a model-dtype scale per group; dequantized per call."""

    weight: torch.Tensor  # int8 (out, in)
    scale: torch.Tensor  # (out, in / group), model dtype

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * self.scale.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_int8(self.weight, self.scale, x.dtype))


@dataclass
class Int4Linear:
    """INT4 weight, two per byte, with a model-dtype scale and zero point per group."""

    packed: torch.Tensor  # "int4pack": the kernel's layout; "dequantize": uint8 (out, in / 2)
    scales_and_zeros: torch.Tensor  # (in / group, out, 2), model dtype
    group_size: int
    out_features: int
    in_features: int
    kernel: Int4Kernel
    # bfloat16 scales for float32 prefill calls on the CPU kernel (None unless float32 int4pack).
    scales_and_zeros_bf16: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Weights and the model-dtype scales: what a decode step reads."""
        sz = self.scales_and_zeros
        return self.packed.numel() * self.packed.element_size() + sz.numel() * sz.element_size()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The (out, in) weight this layer stands for (the reference of the kernel path)."""
        if self.kernel == "int4pack":
            eye = torch.eye(self.in_features, dtype=dtype, device=self.packed.device)
            w: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, self.packed, self.group_size, self.scales_and_zeros.to(dtype)
            )
            return w.t().contiguous()
        low = self.packed & 0x0F
        high = self.packed >> 4
        q = torch.stack([high, low], dim=-1).reshape(self.out_features, self.in_features)
        scale = self.scales_and_zeros[..., 0].t()
        zero = self.scales_and_zeros[..., 1].t()
        return dequantize_int4(q, scale, zero, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "int4pack":
            flat = x.reshape(-1, self.in_features)
            if self.scales_and_zeros_bf16 is not None and flat.shape[0] > _F32_KERNEL_ROWS:
                y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    flat.bfloat16(), self.packed, self.group_size, self.scales_and_zeros_bf16
                ).to(x.dtype)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    flat, self.packed, self.group_size, self.scales_and_zeros
                )
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized(x.dtype))


def _int4_kernel(weight: torch.Tensor) -> Int4Kernel:
    cpu_kernel = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    if weight.device.type == "cpu" and cpu_kernel and weight.shape[0] % _INT4PACK_ROWS == 0:
        return "int4pack"
    return "dequantize"


def quantize_group_linear(
    name: str,
    weight: torch.Tensor,
    fmt: GroupQuant,
    dtype: torch.dtype,
    int4_kernel: Int4Kernel | None = None,
) -> Int8Linear | Int4Linear:
    """Quantize an (out, in) float weight at load; ValueError naming `name` when the group does
    not divide the inputs (or is not a size the kernels take)."""
    in_features = weight.shape[1]
    g = fmt.group_size
    if g not in GROUP_SIZES:
        raise ValueError(
            f"{name}: weight group {g} is not one of {', '.join(map(str, GROUP_SIZES))}"
        )
    if in_features % g:
        divisors = [d for d in GROUP_SIZES if in_features % d == 0]
        hint = f"use --weight-group {divisors[-1]}" if divisors else "use --weights dtype or fp8"
        raise ValueError(
            f"{name}: {in_features} inputs are not divisible by the weight group {g}; {hint}"
        )
    with torch.inference_mode():
        if fmt.bits == 8:
            q8, scale = quantize_int8(weight, g)
            return Int8Linear(q8.contiguous(), scale.to(dtype).contiguous())
        q4, scale, zero = quantize_int4(weight, g)
        return int4_linear(q4, scale, zero, g, dtype, int4_kernel)


def int4_linear(
    q4: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    int4_kernel: Int4Kernel | None = None,
) -> Int4Linear:
    """The layer of INT4 values q4 (out, in) in [0, 15] with per-group `scale` and `zero`
    (out, in / group_size), standing for ``(q4 - 8) * scale + zero``; on q4's device."""
    out_features, in_features = q4.shape
    with torch.inference_mode():
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(dtype).contiguous()
        kernel = int4_kernel or _int4_kernel(q4)
        if kernel == "int4pack":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q4.to(torch.int32).contiguous(), 1
            )
        else:
            pairs = q4.to(torch.uint8).reshape(out_features, in_features // 2, 2)
            packed = (pairs[..., 0] << 4) | pairs[..., 1]
        bf16 = None
        if kernel == "int4pack" and dtype == torch.float32:
            bf16 = scales_and_zeros.bfloat16()
        return Int4Linear(
            packed.contiguous(),
            scales_and_zeros,
            group_size,
            out_features,
            in_features,
            kernel,
            bf16,
        )
