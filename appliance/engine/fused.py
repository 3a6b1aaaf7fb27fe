"""The fixed-shape decode step built from the Triton kernels (`kernels`): few launches per block.

The same step as `LlamaModel.decode_static` (its reference), fused. Per block one launch each for
RoPE of q and k with the KV-cache write, the attention splits and their combination, the four
matrix products (the last takes SiLU(gate) * up as its input) and the two RMSNorms with the
residual add before each: nine. The first norm gathers the token's embedding row and the output
head writes float32 logits, so Llama-3.1-8B's 32 blocks launch 2 + 32 * 9 = 290 kernels a token;
the captured step adds its greedy choice, the argmax and the next position
(`appliance.engine.decode.decode_and_choose`).

FP8, INT8 and INT4 weights are multiplied by weight-only matrix-vector kernels that dequantise
them in registers, so a step quantises no activation and writes no widened weight (the layers'
own INT8/INT4 call dequantises the whole weight; prefill keeps it). Every shape is fixed by the
span and every position is read on the device, so a CUDA graph replays it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from appliance.engine import kernels
from appliance.engine.linear import Fp8Linear, Linear, PlainLinear
from appliance.engine.quantized import Int4Linear, Int8Linear

if TYPE_CHECKING:
    from appliance.engine.llama import KVCache, LlamaModel

__all__ = ["DENSE_PRODUCTS", "decode_step", "matvec"]

# Who multiplies the model-dtype weights (bf16 checkpoints, and the output head in every format):
# "triton" (`kernels.matvec`, which also takes SiLU(gate) * up and writes float32 logits, two
# launches a step fewer per block) or "torch" (cuBLAS through F.linear). bench.gpu_decode
# measures both; the quantized formats always take the Triton kernels.
DENSE_PRODUCTS: Literal["triton", "torch"] = "triton"


def matvec(layer: Linear, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """One token through a linear layer: FP8, INT8 and INT4 (its "dequantize" layout) weights by
    the weight-only matrix-vector kernels, model-dtype weights as DENSE_PRODUCTS says, others by
    the layer itself. `gated`: x is gate then up and the layer takes SiLU(gate) * up."""
    if isinstance(layer, Fp8Linear):
        out = torch.empty(1, layer.weight.shape[0], dtype=layer.out_dtype, device=x.device)
        return kernels.matvec(x, layer.weight, layer.scale, out, gated)
    if isinstance(layer, Int8Linear):
        return kernels.int8_matvec(x, layer.weight, layer.scale, gated)
    if isinstance(layer, Int4Linear) and layer.kernel == "dequantize":
        return kernels.int4_matvec(x, layer.packed, layer.scales_and_zeros, layer.group_size, gated)
    if isinstance(layer, PlainLinear) and DENSE_PRODUCTS == "triton":
        return kernels.matvec(x, layer.weight, gated=gated)
    return layer(kernels.silu_mul(x) if gated else x)


def decode_step(
    model: LlamaModel, step_in: torch.Tensor, cache: KVCache, span: int, logits_out: torch.Tensor
) -> None:
    """`LlamaModel.decode_static`'s contract: token and position from `step_in` (2,), attention
    over the cache's first `span` positions (span > position), logits into `logits_out`."""
    c = model.config
    eps = c.rms_norm_eps
    heads, pos = c.num_attention_heads, step_in[1:2]
    # x (1, hidden): the residual stream, from the token's embedding row.
    h, x = kernels.embed_rms_norm(step_in[0:1], model.embed, model.layers[0].attn_norm, eps)
    norms = [layer.attn_norm for layer in model.layers[1:]] + [model.norm]
    for li, (layer, next_norm) in enumerate(zip(model.layers, norms, strict=True)):
        qkv = matvec(layer.wqkv, h)
        q = kernels.rope_kv_write(qkv, model.cos, model.sin, pos, cache.k[li], cache.v[li], heads)
        attn = kernels.decode_attention(q, cache.k[li], cache.v[li], pos, span)
        h, x = kernels.rms_norm(matvec(layer.wo, attn.view(1, -1)), layer.mlp_norm, eps, x)
        gate_up = matvec(layer.w13, h)
        h, x = kernels.rms_norm(matvec(layer.w2, gate_up, gated=True), next_norm, eps, x)
    if DENSE_PRODUCTS == "triton":
        kernels.matvec(h, model.lm_head, out=logits_out.view(1, -1))
    else:
        logits_out.copy_(F.linear(h[0], model.lm_head))
