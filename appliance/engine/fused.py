"""The fixed-shape decode step built from the Triton kernels (`kernels`): few launches per block.

The same step as `LlamaModel.decode_static` (its reference), fused. Per block one launch each for
RoPE of q and k with the KV-cache write, the attention splits and their combination, the four
matrix products (the last takes SiLU(gate) * up as its input) and the two RMSNorms with the
residual add before each: nine. The first norm gathers the token's embedding row and the output
head writes float32 logits, so Llama-3.1-8B's 32 blocks launch 2 + 32 * 9 = 290 kernels a token;
the captured step adds its greedy choice, the argmax and the next position
(`appliance.engine.decode.decode_and_choose`). `folded_step` (while FOLDED) runs the same block in
six: each norm and residual add inside the products beside it, RoPE and the KV write in the qkv
product's epilogue (2 + 32 * 6 = 194).

FP8, INT8 and INT4 weights are multiplied by weight-only matrix-vector kernels that dequantise
them in registers, so a step quantises no activation and writes no widened weight (the layers'
own INT8/INT4 call dequantises the whole weight; a long prefill keeps it). Every shape is fixed
by the span and every position is read on the device, so a CUDA graph replays it.

`static_rows` is the same step for a few token rows: the fixed-shape prefill of a short prompt
and the verify step of speculative decoding (`LlamaModel.prefill_static`, `verify_static`). Its
products share each weight read across a tile of rows (`kernels.rows_matmul`, weight-only in
every format) and its attention is causal over the cache (`kernels.prefill_attention`), so a
128-token prefill launches about as many kernels as a decode step. `prefill` runs an eager
prefill on it, or past FUSED_ROWS tokens on the fused small steps between torch's products.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from appliance.engine import kernels
from appliance.engine.linear import Fp8Linear, Linear, PlainLinear
from appliance.engine.quantized import Int4Linear, Int8Linear

if TYPE_CHECKING:
    from appliance.engine.llama import KVCache, LlamaModel

__all__ = [
    "DENSE_PRODUCTS",
    "FOLDED",
    "FUSED_ROWS",
    "decode_step",
    "folded_step",
    "matvec",
    "prefill",
    "rows_logits",
    "rows_product",
    "static_rows",
]

# Who multiplies the model-dtype weights (bf16 checkpoints, and the output head in every format):
# "triton" (`kernels.matvec`, which also takes SiLU(gate) * up and writes float32 logits, two
# launches a step fewer per block) or "torch" (cuBLAS through F.linear). bench.gpu_decode
# measures both; the quantized formats always take the Triton kernels.
DENSE_PRODUCTS: Literal["triton", "torch"] = "triton"
# The most token rows a fixed-shape prefill or verify step runs on these kernels (`static_rows`):
# past it a prefill's products are bound by arithmetic, not by the weight's bytes, and torch's
# tuned products (cuBLAS, `torch._scaled_mm` on FP8 tensor cores) are the better fit.
FUSED_ROWS = 128
# The decode step with its small launches folded into the products (`folded_step`): six launches
# a block instead of nine. Off until a GPU run has measured it against the unfolded step:
# bench.gpu_decode runs both.
FOLDED = False


def matvec(layer: Linear, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """One token through a linear layer: FP8, INT8 and INT4 (its "dequantize" layout) weights by
    the weight-only matrix-vector kernels, model-dtype weights as DENSE_PRODUCTS says, others by
    the layer itself. `gated`: x is gate then up and the layer takes SiLU(gate) * up."""
    return _product(layer, x, gated, rows=False)


def rows_product(layer: Linear, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """A few token rows x (rows, in) through a linear layer: `matvec`'s choice of kernel, with
    each row tile sharing a read of the weight (`kernels.rows_matmul`)."""
    return _product(layer, x, gated, rows=True)


def _token_weight(layer: Linear) -> kernels.TokenWeight | None:
    """The layer's weight as a one-token Triton kernel takes it; None where the layer multiplies
    for itself (model-dtype weights with DENSE_PRODUCTS "torch", INT4 in the tinygemm layout)."""
    if isinstance(layer, Fp8Linear):
        return kernels.TokenWeight.dense(layer.weight, layer.scale)
    if isinstance(layer, Int8Linear):
        return kernels.TokenWeight.int8(layer.weight, layer.scale)
    if isinstance(layer, Int4Linear) and layer.kernel == "dequantize":
        return kernels.TokenWeight.int4(layer.packed, layer.scales_and_zeros, layer.group_size)
    if isinstance(layer, PlainLinear) and DENSE_PRODUCTS == "triton":
        return kernels.TokenWeight.dense(layer.weight)
    return None


def _product(layer: Linear, x: torch.Tensor, gated: bool, rows: bool) -> torch.Tensor:
    """`matvec` (rows False) or `rows_product` (rows True): the same choice of kernel by the
    layer's format, the one-token or the row-tile family of it."""
    if not rows:
        weight = _token_weight(layer)
        if weight is None:
            return layer(kernels.silu_mul(x) if gated else x)
        out = None
        if isinstance(layer, Fp8Linear):
            out = torch.empty(1, weight.n_out, dtype=layer.out_dtype, device=x.device)
        return kernels.token_product(x, weight, gated=gated, out=out)
    if isinstance(layer, Fp8Linear):
        out = torch.empty(x.shape[0], layer.weight.shape[0], dtype=layer.out_dtype, device=x.device)
        return kernels.rows_matmul(x, layer.weight, layer.scale, out, gated)
    if isinstance(layer, Int8Linear):
        return kernels.int8_rows_matmul(x, layer.weight, layer.scale, gated)
    if isinstance(layer, Int4Linear) and layer.kernel == "dequantize":
        return kernels.int4_rows_matmul(
            x, layer.packed, layer.scales_and_zeros, layer.group_size, gated
        )
    if isinstance(layer, PlainLinear) and DENSE_PRODUCTS == "triton":
        return kernels.rows_matmul(x, layer.weight, gated=gated)
    return layer(kernels.silu_mul(x) if gated else x)


def static_rows(
    model: LlamaModel, ids: torch.Tensor, meta: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """The final-normed hidden states (bucket, hidden) of `LlamaModel.prefill_static`'s rows (at
    most FUSED_ROWS), whose contract this is, on the fused kernels: per block one launch each for
    the two norms, RoPE with the KV write, attention and the four products.

    A padded row runs its padding id like a live token, one position after the other: its K/V
    land after the live rows' and no live row attends to them (attention is causal).
    """
    c = model.config
    eps = c.rms_norm_eps
    heads, start = c.num_attention_heads, meta[0:1]
    rows = ids.shape[0]
    h, x = kernels.embed_rms_norm(ids, model.embed, model.layers[0].attn_norm, eps)
    norms = [layer.attn_norm for layer in model.layers[1:]] + [model.norm]
    for li, (layer, next_norm) in enumerate(zip(model.layers, norms, strict=True)):
        qkv = rows_product(layer.wqkv, h)
        q = kernels.rope_kv_write(qkv, model.cos, model.sin, start, cache.k[li], cache.v[li], heads)
        attn = kernels.prefill_attention(q, cache.k[li], cache.v[li], start)
        h, x = kernels.rms_norm(rows_product(layer.wo, attn.view(rows, -1)), layer.mlp_norm, eps, x)
        gate_up = rows_product(layer.w13, h)
        h, x = kernels.rms_norm(rows_product(layer.w2, gate_up, gated=True), next_norm, eps, x)
    return h


def prefill(
    model: LlamaModel, token_ids: Sequence[int], cache: KVCache, start: int
) -> torch.Tensor:
    """`LlamaModel.forward`'s contract for several tokens (an eager prefill, or a chunk of one):
    float32 logits (vocab,) of the last of `token_ids` at positions start.., the cache holding
    their K/V afterwards; the caller has checked the ids and positions.

    At most FUSED_ROWS tokens run `static_rows` as they are. More run the same small steps on
    the fused kernels (a norm with the residual add, RoPE writing K and V into the cache) with
    the layers' own products and torch's fused attention (flash attention on a GPU from position
    0): at a long prompt's width the products are bound by arithmetic, and the norms, RoPE and
    SiLU * up in eager torch move several times the activations' bytes through float32 copies.
    """
    c = model.config
    n = len(token_ids)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    logits = torch.empty(1, c.vocab_size, dtype=torch.float32, device=model.device)
    if n <= FUSED_ROWS:
        meta = torch.tensor((start, n), dtype=torch.long, device=model.device)
        rows_logits(model, static_rows(model, ids, meta, cache)[-1:], logits)
        return logits[0]
    eps, heads, end = c.rms_norm_eps, c.num_attention_heads, start + n
    start_at = torch.tensor((start,), dtype=torch.long, device=model.device)
    mask = model.prefill_mask(start, end)
    h, x = kernels.embed_rms_norm(ids, model.embed, model.layers[0].attn_norm, eps)
    norms = [layer.attn_norm for layer in model.layers[1:]] + [model.norm]
    for li, (layer, next_norm) in enumerate(zip(model.layers, norms, strict=True)):
        q = kernels.rope_kv_write(
            layer.wqkv(h), model.cos, model.sin, start_at, cache.k[li], cache.v[li], heads
        )
        attn = model.attend_prefill(
            q.transpose(0, 1), cache.k[li, :, :end], cache.v[li, :, :end], mask
        )
        h, x = kernels.rms_norm(
            layer.wo(attn.transpose(0, 1).reshape(n, -1)), layer.mlp_norm, eps, x
        )
        h, x = kernels.rms_norm(layer.w2(kernels.silu_mul(layer.w13(h))), next_norm, eps, x)
    rows_logits(model, h[-1:], logits)
    return logits[0]


def rows_logits(model: LlamaModel, h: torch.Tensor, logits_out: torch.Tensor) -> None:
    """Float32 logits (rows, vocab) of final-normed rows h into `logits_out`, values rounded to
    the model dtype as the eager output head's are."""
    if DENSE_PRODUCTS == "triton" and h.shape[0] == 1:
        kernels.matvec(h, model.lm_head, out=logits_out)
    elif DENSE_PRODUCTS == "triton":
        kernels.rows_matmul(h, model.lm_head, out=logits_out)
    else:
        logits_out.copy_(F.linear(h, model.lm_head))


def decode_step(
    model: LlamaModel, step_in: torch.Tensor, cache: KVCache, span: int, logits_out: torch.Tensor
) -> None:
    """`LlamaModel.decode_static`'s contract: token and position from `step_in` (2,), attention
    over the cache's first `span` positions (span > position), logits into `logits_out`."""
    if FOLDED and folded_step(model, step_in, cache, span, logits_out):
        return
    c = model.config
    eps = c.rms_norm_eps
    heads, pos = c.num_attention_heads, step_in[1:2]
    # x (1, hidden): the residual stream, from the token's embedding row.
    h, x = kernels.embed_rms_norm(step_in[0:1], model.embed, model.layers[0].attn_norm, eps)
    norms = [layer.attn_norm for layer in model.layers[1:]] + [model.norm]
    for li, (layer, next_norm) in enumerate(zip(model.layers, norms, strict=True)):
        qkv = matvec(layer.wqkv, h)
        q = kernels.rope_kv_write(qkv, model.cos, model.sin, pos, cache.k[li], cache.v[li], heads)
        attn = kernels.decode_attention(q[0], cache.k[li], cache.v[li], pos, span)
        h, x = kernels.rms_norm(matvec(layer.wo, attn.view(1, -1)), layer.mlp_norm, eps, x)
        gate_up = matvec(layer.w13, h)
        h, x = kernels.rms_norm(matvec(layer.w2, gate_up, gated=True), next_norm, eps, x)
    if DENSE_PRODUCTS == "triton":
        kernels.matvec(h, model.lm_head, out=logits_out.view(1, -1))
    else:
        logits_out.copy_(F.linear(h[0], model.lm_head))


def folded_step(
    model: LlamaModel, step_in: torch.Tensor, cache: KVCache, span: int, logits_out: torch.Tensor
) -> bool:
    """`decode_step` with each block's small launches folded into its products: RMSNorm and the
    residual add before it (the add in the product that ends the sum, `kernels.Residual`; the
    norm in the product that reads it, `kernels.Norm`) and RoPE with the KV write (the qkv
    product's epilogue, `kernels.Rope`). Per block: the qkv product, attention's two launches,
    then the output, gate-up and down products; 2 + 6 * layers launches a token.

    False, having run nothing, where a product is not a Triton kernel (`_token_weight`)."""
    products = [(layer.wqkv, layer.wo, layer.w13, layer.w2) for layer in model.layers]
    weights = _token_weights(
        [w for block in products for w in block] + [PlainLinear(model.lm_head)]
    )
    if weights is None:
        return False
    c = model.config
    eps = c.rms_norm_eps
    pos = step_in[1:2]
    h: torch.Tensor | kernels.Norm
    h, x = kernels.embed_rms_norm(step_in[0:1], model.embed, model.layers[0].attn_norm, eps)
    residual: torch.Tensor | kernels.Residual = x
    norms = [layer.attn_norm for layer in model.layers[1:]] + [model.norm]
    for li, (layer, next_norm) in enumerate(zip(model.layers, norms, strict=True)):
        qkv, wo, w13, w2 = weights[4 * li : 4 * li + 4]
        rope = kernels.Rope(
            model.cos, model.sin, pos, cache.k[li], cache.v[li], c.num_attention_heads
        )
        q = kernels.token_product(h, qkv, rope=rope)
        attn = kernels.decode_attention(q[0], cache.k[li], cache.v[li], pos, span)
        residual = kernels.token_product_add(attn.view(1, -1), wo, residual)
        gate_up = kernels.token_product(kernels.Norm(residual, layer.mlp_norm, eps), w13)
        residual = kernels.token_product_add(gate_up, w2, residual, gated=True)
        h = kernels.Norm(residual, next_norm, eps)
    kernels.token_product(h, weights[-1], out=logits_out.view(1, -1))
    return True


def _token_weights(layers: Sequence[Linear]) -> list[kernels.TokenWeight] | None:
    """Each layer's `_token_weight`; None if any has none."""
    found = []
    for layer in layers:
        weight = _token_weight(layer)
        if weight is None:
            return None
        found.append(weight)
    return found
