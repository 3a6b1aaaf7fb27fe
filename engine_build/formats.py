"""Weight formats: what each `precision.quantization` value stores, needs and costs.

One table (`FORMATS`) holds every fact the rest of engine_build reads about a format: the
``--qformat`` quantize.py takes for it, the bytes of a linear layer's weights and scales, whether
quantize.py calibrates it, the KV-cache dtypes it can be built with and the oldest GPU that runs it.

Storage per linear layer of ``in`` inputs and ``out`` outputs, as TensorRT-LLM 1.2 checkpoints hold
it (quantize.py exports through ModelOpt; weight-only formats are quantized by trtllm-build from the
``dtype`` weights the checkpoint carries with ``quant_algo`` W8A16/W4A16):

- ``none``: ``in * out`` weights in ``dtype``.
- ``fp8``: one byte per weight; its per-tensor float32 scales (two floats a layer) are not counted.
- ``int8_sq`` (W8A8 SmoothQuant, per channel): one byte per weight, a float32 scale per output
  channel and the smoothing factors, one float32 per input channel.
- ``int8_wo`` / ``int4_wo`` (W8A16 / W4A16): one or half a byte per weight and one ``dtype`` scale
  per output channel (TensorRT-LLM's weight-only formats are per channel, not group-wise).
- ``int4_awq`` (W4A16 AWQ) / ``w4a8_awq`` (W4A8 AWQ): half a byte per weight, one ``dtype`` scale per
  group of ``awq_block_size`` inputs per output, and AWQ's pre-quantization scale, one ``dtype`` per
  input channel. ModelOpt's AWQ is symmetric: no zero points are stored.
- The engine server's own group-wise formats (``int8_group``, ``int4_group``; not trtllm-build
  values) store one ``dtype`` scale per group, and int4 a ``dtype`` zero point per group as well.

GPU floors (NVIDIA Model Optimizer's support matrix): FP8 activations or weights (``fp8``,
``w4a8_awq``) and an FP8 KV cache need compute capability 8.9 (Ada) or later; INT8 SmoothQuant and
AWQ need 8.0 (Ampere) or later; the weight-only formats and bf16 run wherever TensorRT-LLM runs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = [
    "AWQ_BLOCK_SIZES",
    "DEFAULT_GROUP_SIZE",
    "FORMATS",
    "FP8_MIN_CAPABILITY",
    "WeightFormat",
    "capability_problem",
    "kv_problem",
    "parse_capability",
]

# quantize.py's --awq_block_size default; TensorRT-LLM's group-wise kernels take 64 or 128.
DEFAULT_GROUP_SIZE = 128
AWQ_BLOCK_SIZES = (64, 128)
FP8_MIN_CAPABILITY = (8, 9)
AMPERE = (8, 0)


@dataclass(frozen=True)
class WeightFormat:
    """How one format stores a linear layer, and what it takes to build and run it."""

    name: str
    qformat: str  # quantize.py --qformat
    weight_bits: int  # 0: the model dtype
    scales: str  # "none", "tensor", "channel" or "group"
    scale_bytes: int  # 0: the model dtype's width
    zero_points: bool = False
    pre_quant_scale: bool = False  # AWQ's per-input smoothing, stored in the model dtype
    smoothing_f32: bool = False  # SmoothQuant's per-input factors, float32
    calibrated: bool = False  # quantize.py runs calibration batches
    fp8_activations: bool = False
    kv_cache_dtypes: tuple[str, ...] = ("auto", "fp8", "int8")
    min_capability: tuple[int, int] = (0, 0)
    builds: bool = True  # a trtllm-build value (the engine server's own formats are not)

    def linear_bytes(self, in_features: int, out_features: int, wide: int, group: int) -> int:
        """Bytes of one (out, in) linear layer: weights, scales, zero points, smoothing factors."""
        if self.weight_bits == 0:
            return in_features * out_features * wide
        weights = math.ceil(in_features * out_features * self.weight_bits / 8)
        scale = self.scale_bytes or wide
        if self.scales == "tensor":
            per_scale = 0
        elif self.scales == "channel":
            per_scale = out_features
        else:
            per_scale = out_features * math.ceil(in_features / group)
        extra = per_scale * scale * (2 if self.zero_points else 1)
        if self.pre_quant_scale:
            extra += in_features * wide
        if self.smoothing_f32:
            extra += in_features * 4
        return weights + extra


FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("none", "full_prec", 0, "none", 0),
        WeightFormat(
            "fp8",
            "fp8",
            8,
            "tensor",
            4,
            calibrated=True,
            fp8_activations=True,
            kv_cache_dtypes=("auto", "fp8"),
            min_capability=FP8_MIN_CAPABILITY,
        ),
        WeightFormat(
            "int8_sq",
            "int8_sq",
            8,
            "channel",
            4,
            smoothing_f32=True,
            calibrated=True,
            # ModelOpt pairs SmoothQuant with an INT8 KV cache; FP8 and INT8 SQ do not combine.
            kv_cache_dtypes=("auto", "int8"),
            min_capability=AMPERE,
        ),
        WeightFormat(
            "int4_awq",
            "int4_awq",
            4,
            "group",
            0,
            pre_quant_scale=True,
            calibrated=True,
            min_capability=AMPERE,
        ),
        WeightFormat(
            "w4a8_awq",
            "w4a8_awq",
            4,
            "group",
            0,
            pre_quant_scale=True,
            calibrated=True,
            fp8_activations=True,
            kv_cache_dtypes=("auto", "fp8"),
            min_capability=FP8_MIN_CAPABILITY,
        ),
        WeightFormat("int8_wo", "int8_wo", 8, "channel", 0),
        WeightFormat("int4_wo", "int4_wo", 4, "channel", 0),
        # The engine server's round-to-nearest group-wise formats (appliance.engine.quantized).
        WeightFormat("int8_group", "", 8, "group", 0, builds=False),
        WeightFormat("int4_group", "", 4, "group", 0, zero_points=True, builds=False),
    )
}
BUILD_FORMATS = tuple(name for name, f in FORMATS.items() if f.builds)


def parse_capability(text: str) -> tuple[int, int]:
    """``--compute-capability 9.0`` -> (9, 0); ValueError with what to write otherwise."""
    m = re.fullmatch(r"([0-9]{1,2})\.([0-9]{1,2})", text.strip())
    if m is None:
        raise ValueError(f"--compute-capability {text!r}: expected MAJOR.MINOR, e.g. 8.0 or 9.0")
    return int(m.group(1)), int(m.group(2))


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def capability_problem(quantization: str, kv_cache_dtype: str, cc: tuple[int, int]) -> str | None:
    """Why a GPU of compute capability `cc` cannot run this format (None: it can)."""
    fmt = FORMATS[quantization]
    if cc < fmt.min_capability:
        what = "FP8 activations" if fmt.fp8_activations else f"{quantization} kernels"
        fallback = "int4_awq" if quantization == "w4a8_awq" else "int8_wo, int4_wo or none"
        return (
            f"precision.quantization = {quantization!r} needs {what} on compute capability "
            f"{_cc(fmt.min_capability)} or later; this GPU is {_cc(cc)}: use {fallback}"
        )
    if kv_cache_dtype == "fp8" and cc < FP8_MIN_CAPABILITY:
        return (
            f"precision.kv_cache_dtype = 'fp8' needs compute capability "
            f"{_cc(FP8_MIN_CAPABILITY)} or later; this GPU is {_cc(cc)}: use 'int8' or 'auto'"
        )
    return None


def kv_problem(quantization: str, kv_cache_dtype: str) -> str | None:
    """Why this KV-cache dtype does not go with this format (None: it does)."""
    allowed = FORMATS[quantization].kv_cache_dtypes
    if kv_cache_dtype in allowed:
        return None
    return (
        f"{kv_cache_dtype!r} does not go with precision.quantization = {quantization!r}; "
        f"use one of {', '.join(allowed)}"
    )
