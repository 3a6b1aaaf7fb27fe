"""The fixed-shape decode step built from the Triton kernels (`kernels`): few launches per block.

The same step as `LlamaModel.decode_static` (its reference), fused: per block one launch each for
RMSNorm with the residual add before it, RoPE of q and k with the KV-cache write, attention over
the live positions (two: the splits and their combination), SiLU(gate) * up, and the four matrix
products. FP8, INT8 and INT4 weights are multiplied by weight-only matrix-vector kernels that
dequantise them in registers, so a step quantises no activation and writes no widened weight (the
layers' own INT8/INT4 call dequantises the whole weight; prefill keeps it). Every shape is fixed by the span and every
position is read on the device, so a CUDA graph replays it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from appliance.engine import kernels
from appliance.engine.linear import Fp8Linear, Linear
from appliance.engine.quantized import Int4Linear, Int8Linear

if TYPE_CHECKING:
    from appliance.engine.llama import KVCache, LlamaModel

__all__ = ["decode_step", "matvec"]


def matvec(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """One token through a linear layer: FP8, INT8 and INT4 (its "dequantize" layout) weights by
    the weight-only matrix-vector kernels, others by the layer itself."""
    if isinstance(layer, Fp8Linear):
        return kernels.fp8_matvec(x, layer.weight, layer.scale, layer.out_dtype)
    if isinstance(layer, Int8Linear):
        return kernels.int8_matvec(x, layer.weight, layer.scale)
    if isinstance(layer, Int4Linear) and layer.kernel == "dequantize":
        return kernels.int4_matvec(x, layer.packed, layer.scales_and_zeros, layer.group_size)
    return layer(x)


def decode_step(
    model: LlamaModel, step_in: torch.Tensor, cache: KVCache, span: int, logits_out: torch.Tensor
) -> None:
    """`LlamaModel.decode_static`'s contract: token and position from `step_in` (2,), attention
    over the cache's first `span` positions (span > position), logits into `logits_out`."""
    c = model.config
    eps = c.rms_norm_eps
    heads, pos = c.num_attention_heads, step_in[1:2]
    x = F.embedding(step_in[0:1], model.embed)  # (1, hidden): the residual stream
    h, _ = kernels.rms_norm(x, model.layers[0].attn_norm, eps)
    norms = [layer.attn_norm for layer in model.layers[1:]] + [model.norm]
    for li, (layer, next_norm) in enumerate(zip(model.layers, norms, strict=True)):
        qkv = matvec(layer.wqkv, h)
        q = kernels.rope_kv_write(qkv, model.cos, model.sin, pos, cache.k[li], cache.v[li], heads)
        attn = kernels.decode_attention(q, cache.k[li], cache.v[li], pos, span)
        h, x = kernels.rms_norm(matvec(layer.wo, attn.view(1, -1)), layer.mlp_norm, eps, x)
        act = kernels.silu_mul(matvec(layer.w13, h))
        h, x = kernels.rms_norm(matvec(layer.w2, act), next_norm, eps, x)
    logits_out.copy_(F.linear(h[0], model.lm_head))
