"""VRAM fit arithmetic: pure functions of the model shape, the spec and the GPU size.

The rule being enforced is that the whole model lives in GPU memory. What Triton's
``tensorrt_llm`` model actually does at start-up is load the weights, reserve activations and
runtime buffers, then take ``kv_cache_free_gpu_mem_fraction`` of what is *left* for the paged KV
pool. So the plan fits when that pool holds ``max_batch_size`` sequences of ``max_seq_len``
tokens (rounded up to whole KV blocks) on every GPU.

Precision model: the linear layers of every decoder block (q, k, v, o, gate, up, down) are stored
in the spec's weight format, with its scales, zero points and smoothing factors
(``engine_build.formats``: FP8 one byte, INT8 one byte, INT4 half a byte, plus per-tensor,
per-channel or per-group scales); the embedding table, ``lm_head`` and the RMSNorm weights stay in
``dtype`` (2 bytes) because quantize.py leaves them alone unless ``--quantize_lm_head``. The KV cache
takes one byte per element in FP8 or INT8, else ``dtype``. Tensor parallelism splits the linear layers and ``lm_head`` across ranks;
the embedding table is replicated (``use_parallel_embedding`` is off by default) and so are the
norms. KV heads are split across ranks, but a rank never holds less than one.
``lm_head`` is counted even for tied embeddings because the engine keeps its own copy.

The arithmetic reads only the fields of ``FitSpec``, so the engine server checks that a model fits
the device it is about to load onto with these same functions (``appliance.engine.options``); a
``BuildSpec`` is one. ``dtype`` float32 (the engine server's CPU default) counts 4 bytes.

Activation/workspace headroom is an estimate, not a TensorRT measurement: two live buffers of
the widest per-token activation (hidden + q/k/v + 2 × MLP intermediate, in ``dtype``) for
``max_num_tokens`` tokens, float32 logits for the batch, and a fixed runtime overhead (CUDA
context, cuBLAS workspaces, decoder buffers; ``[plan] runtime_overhead``) plus 32 MiB per
cached CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from engine_build.checkpoint import ModelShape
from engine_build.errors import SpecError
from engine_build.formats import WeightFormat
from engine_build.spec import BuildSpec

MIB = 1 << 20
GIB = 1 << 30
CUDA_GRAPH_RESERVE_BYTES = 32 * MIB
ACTIVATION_BUFFERS = 2
LOGITS_BYTES = 4
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class FitSpec(Protocol):
    """What the fit arithmetic reads of a plan; ``BuildSpec`` has every field."""

    @property
    def dtype(self) -> str: ...
    @property
    def weight_format(self) -> WeightFormat: ...
    @property
    def group_size(self) -> int: ...
    @property
    def kv_cache_dtype(self) -> str: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def max_num_tokens(self) -> int: ...
    @property
    def max_batch_size(self) -> int: ...
    @property
    def tokens_per_block(self) -> int: ...
    @property
    def kv_cache_free_gpu_mem_fraction(self) -> float: ...
    @property
    def cuda_graph_mode(self) -> bool: ...
    @property
    def cuda_graph_cache_size(self) -> int: ...
    @property
    def runtime_overhead_bytes(self) -> int: ...


@dataclass(frozen=True)
class ParamCounts:
    """Whole-model parameter counts by storage class."""

    linear: int
    embedding: int
    lm_head: int
    norms: int

    @property
    def total(self) -> int:
        return self.linear + self.embedding + self.lm_head + self.norms


@dataclass(frozen=True)
class FitPlan:
    """Every number of the fit table, in bytes per GPU unless the name says otherwise."""

    params: ParamCounts
    weight_bytes: int
    kv_bytes_per_token: int
    kv_tokens_needed: int
    kv_bytes_needed: int
    activation_bytes: int
    logits_bytes: int
    overhead_bytes: int
    gpu_memory_bytes: int
    kv_pool_bytes: int
    # Speculative decoding: the draft model's weights and its capped KV pool, or the Medusa
    # heads / EAGLE drafter weights (their KV is part of kv_bytes_per_token).
    draft_bytes: int = 0

    @property
    def fits(self) -> bool:
        return self.kv_pool_bytes >= self.kv_bytes_needed

    @property
    def kv_pool_tokens(self) -> int:
        return max(0, self.kv_pool_bytes) // self.kv_bytes_per_token

    @property
    def required_bytes(self) -> int:
        """Memory this plan needs if the KV pool were exactly the configured sequences."""
        return (
            self.weight_bytes
            + self.activation_bytes
            + self.logits_bytes
            + self.overhead_bytes
            + self.kv_bytes_needed
            + self.draft_bytes
        )


def count_params(shape: ModelShape) -> ParamCounts:
    """Parameter counts of a Llama-layout decoder (no biases)."""
    h, hd = shape.hidden_size, shape.head_dim
    q_out = shape.num_attention_heads * hd
    kv_out = shape.num_key_value_heads * hd
    attn = h * q_out + 2 * h * kv_out + q_out * h
    mlp = 3 * h * shape.intermediate_size
    layers = shape.num_hidden_layers
    return ParamCounts(
        linear=layers * (attn + mlp),
        embedding=shape.vocab_size * h,
        lm_head=shape.vocab_size * h,
        norms=layers * 2 * h + h,
    )


def kv_heads_per_gpu(shape: ModelShape, tp: int) -> int:
    """KV heads on one rank: split when there are enough, replicated (1 per rank) when not."""
    return max(1, math.ceil(shape.num_key_value_heads / tp))


def _linear_shapes(shape: ModelShape, tp: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of a block on one rank, by its checkpoint name."""
    h, hd = shape.hidden_size, shape.head_dim
    q_out = shape.num_attention_heads * hd // tp
    kv_out = kv_heads_per_gpu(shape, tp) * hd
    inter = shape.intermediate_size // tp
    return {
        "self_attn.q_proj": (h, q_out),
        "self_attn.k_proj": (h, kv_out),
        "self_attn.v_proj": (h, kv_out),
        "self_attn.o_proj": (q_out, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }


def group_problem(shape: ModelShape, spec: FitSpec) -> str | None:
    """Why a group-wise format cannot take this model's shapes (None: it can), naming the layer."""
    if spec.weight_format.scales != "group":
        return None
    for name, (inputs, _) in _linear_shapes(shape, spec.tp_size).items():
        if inputs % spec.group_size:
            return (
                f"model.layers.*.{name}: {inputs} inputs per rank are not divisible by the group "
                f"size {spec.group_size}; use another group size or format"
            )
    return None


def check_groups(shape: ModelShape, spec: FitSpec) -> None:
    """SpecError when the format's groups do not divide a layer (see `group_problem`)."""
    why = group_problem(shape, spec)
    if why:
        raise SpecError(why)


def weight_bytes_per_gpu(shape: ModelShape, spec: FitSpec) -> int:
    """Bytes of weights on one rank for the spec's weight format and tensor parallelism."""
    tp = spec.tp_size
    h = shape.hidden_size
    wide = DTYPE_BYTES[spec.dtype]
    fmt = spec.weight_format
    per_layer = sum(
        fmt.linear_bytes(i, o, wide, spec.group_size) for i, o in _linear_shapes(shape, tp).values()
    )
    linear_bytes = shape.num_hidden_layers * per_layer
    embedding = shape.vocab_size * h
    lm_head = math.ceil(shape.vocab_size / tp) * h
    norms = shape.num_hidden_layers * 2 * h + h
    return linear_bytes + (embedding + lm_head + norms) * wide


def kv_bytes_per_token(shape: ModelShape, spec: FitSpec) -> int:
    """K and V for one token across all layers on one rank."""
    elem = 1 if spec.kv_cache_dtype in ("fp8", "int8") else DTYPE_BYTES[spec.dtype]
    return (
        2 * shape.num_hidden_layers * kv_heads_per_gpu(shape, spec.tp_size) * shape.head_dim * elem
    )


def activation_bytes(shape: ModelShape, spec: FitSpec) -> int:
    """Estimated activation workspace for one ``max_num_tokens`` step on one rank."""
    tp = spec.tp_size
    q = shape.num_attention_heads * shape.head_dim // tp
    kv = 2 * kv_heads_per_gpu(shape, tp) * shape.head_dim
    widest = shape.hidden_size + q + kv + 2 * (shape.intermediate_size // tp)
    return spec.max_num_tokens * widest * DTYPE_BYTES[spec.dtype] * ACTIVATION_BUFFERS


@dataclass(frozen=True)
class DraftCost:
    """What speculative decoding adds per GPU: ``bytes`` held before the target's KV pool
    (draft engine weights and KV, or head/drafter weights), ``kv_per_token`` added to the
    target's KV per token (EAGLE's drafter layers), ``extra_tokens`` added to its sequence."""

    bytes: int = 0
    kv_per_token: int = 0
    extra_tokens: int = 0


def draft_cost(shape: ModelShape, spec: BuildSpec, draft_shape: ModelShape | None) -> DraftCost:
    """The speculative mode's memory, from the target's shape and (draft-target: the draft
    model's; EAGLE: the drafter's config.json) ``draft_shape``.

    - draft_target: the draft engine's weights in the spec's format plus its KV pool, capped at
      one ``max_seq_len`` sequence (the repository writes that cap).
    - medusa: ``num_medusa_heads`` heads, each ``num_medusa_layers`` residual blocks (hidden x
      hidden weight and bias) and its own ``lm_head`` (vocab x hidden), in ``dtype``.
    - eagle: ``num_eagle_layers`` EAGLE nets, each the drafter's decoder layers, its fc (2 x
      hidden -> hidden), a vocab embedding and an ``lm_head`` copy, in ``dtype``; each net's
      layers keep KV cache per token like the target's.
    - lookahead: no weights; its sequences are ``max_draft_len`` longer (all modes are).
    """
    s = spec.speculative
    extra = s.extra_seq_len
    wide = DTYPE_BYTES[spec.dtype]
    h, tp = shape.hidden_size, spec.tp_size
    if s.mode == "draft_target" and draft_shape is not None:
        blocks = math.ceil(spec.max_seq_len / spec.tokens_per_block)
        tokens = blocks * spec.tokens_per_block * spec.max_batch_size
        kv = tokens * kv_bytes_per_token(draft_shape, spec)
        return DraftCost(weight_bytes_per_gpu(draft_shape, spec) + kv, 0, extra)
    if s.mode == "medusa":
        per_head = s.num_medusa_layers * (h * h + h) + shape.vocab_size * h
        return DraftCost(s.num_medusa_heads * per_head * wide // tp, 0, extra)
    if s.mode == "eagle" and draft_shape is not None:
        d = draft_shape
        block = sum(i * o for i, o in _linear_shapes(d, tp).values()) + 2 * d.hidden_size
        net = d.num_hidden_layers * block + 2 * h * h + 2 * shape.vocab_size * h // tp
        per_token = kv_bytes_per_token(d, spec) * s.num_eagle_layers
        return DraftCost(s.num_eagle_layers * net * wide, per_token, extra)
    return DraftCost(0, 0, extra)


def make_plan(
    shape: ModelShape, spec: FitSpec, gpu_memory_bytes: int, draft: DraftCost | None = None
) -> FitPlan:
    """The fit table for one GPU of ``gpu_memory_bytes`` (the smallest of the spec's GPUs)."""
    draft = draft or DraftCost()
    per_token = kv_bytes_per_token(shape, spec) + draft.kv_per_token
    blocks = math.ceil((spec.max_seq_len + draft.extra_tokens) / spec.tokens_per_block)
    tokens = blocks * spec.tokens_per_block * spec.max_batch_size
    weights = weight_bytes_per_gpu(shape, spec)
    act = activation_bytes(shape, spec)
    logits = spec.max_batch_size * shape.vocab_size * LOGITS_BYTES
    cuda_graphs = spec.cuda_graph_cache_size if spec.cuda_graph_mode else 0
    overhead = spec.runtime_overhead_bytes + cuda_graphs * CUDA_GRAPH_RESERVE_BYTES
    free_after = gpu_memory_bytes - weights - act - logits - overhead - draft.bytes
    pool = math.floor(free_after * spec.kv_cache_free_gpu_mem_fraction) if free_after > 0 else 0
    return FitPlan(
        params=count_params(shape),
        weight_bytes=weights,
        kv_bytes_per_token=per_token,
        kv_tokens_needed=tokens,
        kv_bytes_needed=tokens * per_token,
        activation_bytes=act,
        logits_bytes=logits,
        overhead_bytes=overhead,
        gpu_memory_bytes=gpu_memory_bytes,
        kv_pool_bytes=pool,
        draft_bytes=draft.bytes,
    )


def _gib(n: int) -> str:
    if n < GIB:
        return f"{n / MIB:9.1f} MiB"
    return f"{n / GIB:9.2f} GiB"


def _format_label(spec: BuildSpec) -> str:
    if spec.quantization == "none":
        return spec.dtype
    if spec.weight_format.scales == "group":
        return f"{spec.quantization} linear, group {spec.group_size}"
    return f"{spec.quantization} linear"


def render_table(plan: FitPlan, spec: BuildSpec) -> str:
    """Human table; the last line is the verdict so a log grep finds it."""
    rows = [
        ("parameters (whole model)", f"{plan.params.total / 1e9:9.3f} B"),
        (
            f"weights per GPU ({_format_label(spec)}, tp={spec.tp_size})",
            _gib(plan.weight_bytes),
        ),
        ("activations (estimate)", _gib(plan.activation_bytes)),
        ("logits", _gib(plan.logits_bytes)),
        ("runtime overhead + CUDA graphs", _gib(plan.overhead_bytes)),
        *(
            [(f"speculative ({spec.speculative.mode})", _gib(plan.draft_bytes))]
            if spec.speculative.on
            else []
        ),
        (
            f"KV cache per token ({spec.dtype if spec.kv_cache_dtype == 'auto' else spec.kv_cache_dtype})",
            f"{plan.kv_bytes_per_token:>9} B",
        ),
        (
            f"KV needed ({spec.max_batch_size} x {spec.engine_max_seq_len} tok, "
            f"block {spec.tokens_per_block})",
            _gib(plan.kv_bytes_needed),
        ),
        ("GPU memory", _gib(plan.gpu_memory_bytes)),
        (
            f"KV pool ({spec.kv_cache_free_gpu_mem_fraction:g} of the rest)",
            _gib(plan.kv_pool_bytes),
        ),
        ("KV pool tokens", f"{plan.kv_pool_tokens:>9}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines.append(f"{'verdict'.ljust(width)}  {verdict}")
    return "\n".join(lines)


def advice(plan: FitPlan, spec: BuildSpec) -> list[str]:
    """What to change when the plan does not fit, most effective first."""
    out: list[str] = []
    if spec.weight_format.weight_bits in (0, 16):
        out.append(
            "set precision.quantization = 'fp8' or 'int8_wo' (halves the linear-layer weights), "
            "or 'int4_awq' (quarters them)"
        )
    elif spec.weight_format.weight_bits == 8 and spec.quantization != "int8_sq":
        out.append(
            "set precision.quantization = 'int4_awq' (halves the linear-layer weights again)"
        )
    if spec.kv_cache_dtype == "auto":
        kv8 = [d for d in ("fp8", "int8") if d in spec.weight_format.kv_cache_dtypes]
        if kv8:
            out.append(f"set precision.kv_cache_dtype = {kv8[0]!r} (halves the KV cache)")
    short = plan.kv_bytes_needed - plan.kv_pool_bytes
    if plan.kv_pool_bytes > 0 and short > 0:
        fit_tokens = plan.kv_pool_tokens // max(1, spec.max_batch_size)
        if fit_tokens > spec.max_input_len:
            out.append(f"lower limits.max_seq_len to <= {fit_tokens}")
    if spec.max_batch_size > 1:
        out.append("lower limits.max_batch_size to 1")
    out.append("raise parallel.tp_size (and add gpu_ids) to split weights across GPUs")
    out.append("or use a GPU with more memory")
    return out
