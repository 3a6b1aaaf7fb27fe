"""The ``tensorrt_llm`` model's config.pbtxt, built as a protobuf message, never from a template.

Building a ``model_config_pb2.ModelConfig`` and printing it with ``text_format`` means the file
always parses and never contains a ``${...}`` placeholder; Triton's fill_template flow silently
falls back to defaults for any key it forgot, which is exactly how an engine ends up running
without CUDA graphs or with KV reuse it was not built for.

The tensor names and types follow the TensorRT-LLM triton_backend template
``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt`` @
0c8de69a1ca6213eebb20a51873890ff128666c2 (the post-0.19 names: ``seed``, ``min_tokens``); only
the inputs the gateway can send are declared. Parameter keys are those the backend reads
(``gpt_model_path`` is the engine directory key in the backend's C++; ``engine_dir`` is written
too because docs/MODEL_REPOSITORY.md names it).

Guided decoding (grammar-constrained output) is part of the same contract: the per-request inputs
GUIDED_DECODING_INPUTS, whose guide types are GUIDE_TYPES, and the model parameters
``guided_decoding_backend`` (XGRAMMAR) and ``xgrammar_tokenizer_info_path``. The template declares
the two inputs on every model; here they are declared only on a model with guided decoding on, so
a gateway sees from the model's config whether it may send a guide, instead of learning it from
the backend's "GuidedDecoder is not setup" error.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from engine_build.kv_blocks import TOKENS_PER_BLOCK_PARAMETER

MODEL_NAME = "tensorrt_llm"
BACKEND = "tensorrtllm"

# (name, data type, dims, optional, ragged)
_INPUTS: tuple[tuple[str, int, tuple[int, ...], bool, bool], ...] = (
    ("input_ids", mc.TYPE_INT32, (-1,), False, True),
    ("input_lengths", mc.TYPE_INT32, (1,), False, False),
    ("request_output_len", mc.TYPE_INT32, (1,), False, False),
    ("end_id", mc.TYPE_INT32, (1,), True, False),
    ("pad_id", mc.TYPE_INT32, (1,), True, False),
    ("stop_words_list", mc.TYPE_INT32, (2, -1), True, True),
    ("bad_words_list", mc.TYPE_INT32, (2, -1), True, True),
    ("temperature", mc.TYPE_FP32, (1,), True, False),
    ("runtime_top_k", mc.TYPE_INT32, (1,), True, False),
    ("runtime_top_p", mc.TYPE_FP32, (1,), True, False),
    ("seed", mc.TYPE_UINT64, (1,), True, False),
    ("min_tokens", mc.TYPE_INT32, (1,), True, False),
    ("return_log_probs", mc.TYPE_BOOL, (1,), True, False),
    ("repetition_penalty", mc.TYPE_FP32, (1,), True, False),
    ("presence_penalty", mc.TYPE_FP32, (1,), True, False),
    ("frequency_penalty", mc.TYPE_FP32, (1,), True, False),
    ("exclude_input_in_output", mc.TYPE_BOOL, (1,), True, False),
    ("stop", mc.TYPE_BOOL, (1,), True, False),
    ("streaming", mc.TYPE_BOOL, (1,), True, False),
)
REQUIRED_INPUTS = ("input_ids", "input_lengths", "request_output_len")

# The per-request inputs of guided decoding: the guide's type (one of GUIDE_TYPES) and its text
# (the JSON Schema, regular expression or EBNF grammar; ignored for "json", any JSON value).
GUIDE_TYPE_INPUT = "guided_decoding_guide_type"
GUIDE_INPUT = "guided_decoding_guide"
GUIDED_DECODING_INPUTS = (GUIDE_TYPE_INPUT, GUIDE_INPUT)
# The one `guided_decoding_backend` the backend's C++ runtime accepts.
XGRAMMAR = "xgrammar"

# The per-request perf metrics of the tensorrtllm backend: with the optional input
# `return_perf_metrics` (BOOL [1]) true, every response carries the request's RequestPerfMetrics so
# far, shape [1] each, as the backend's config.pbtxt template declares them on every model. KV-cache
# blocks (INT32): `kv_cache_reused_blocks` the prompt blocks taken from the reuse pool,
# `kv_cache_alloc_total_blocks` the prompt blocks allocated instead (not reused),
# `kv_cache_alloc_new_blocks` those of them that held no reusable K/V before; all three are counted
# once, when the request's sequence is added to the KV cache, so every response carries the same
# values. Times (INT64 nanoseconds of the executor's steady clock). Speculative decoding: the draft
# tokens proposed (`total_draft_tokens`), those accepted (`total_accepted_draft_tokens`) and their
# ratio (`acceptance_rate`).
PERF_METRICS_INPUT = "return_perf_metrics"
KV_CACHE_REUSED_BLOCKS_OUTPUT = "kv_cache_reused_blocks"
KV_CACHE_OUTPUTS: tuple[tuple[str, int], ...] = (
    ("kv_cache_alloc_new_blocks", mc.TYPE_INT32),
    (KV_CACHE_REUSED_BLOCKS_OUTPUT, mc.TYPE_INT32),
    ("kv_cache_alloc_total_blocks", mc.TYPE_INT32),
)
TIMING_OUTPUTS: tuple[tuple[str, int], ...] = (
    ("arrival_time_ns", mc.TYPE_INT64),
    ("first_scheduled_time_ns", mc.TYPE_INT64),
    ("first_token_time_ns", mc.TYPE_INT64),
    ("last_token_time_ns", mc.TYPE_INT64),
)
DRAFT_TOKENS_OUTPUT = "total_draft_tokens"
ACCEPTED_DRAFT_TOKENS_OUTPUT = "total_accepted_draft_tokens"
ACCEPTANCE_RATE_OUTPUT = "acceptance_rate"
SPEC_OUTPUTS: tuple[tuple[str, int], ...] = (
    (ACCEPTANCE_RATE_OUTPUT, mc.TYPE_FP32),
    (ACCEPTED_DRAFT_TOKENS_OUTPUT, mc.TYPE_INT32),
    (DRAFT_TOKENS_OUTPUT, mc.TYPE_INT32),
)
PERF_OUTPUTS = KV_CACHE_OUTPUTS + TIMING_OUTPUTS + SPEC_OUTPUTS
# The per-request switch of speculation (BOOL; false: this request decodes without drafts). The
# tensorrtllm backend has none: a TensorRT-LLM engine speculates on every request of a model whose
# `decoding_mode` is speculative. The appliance engine server declares it on the models it serves
# with `--speculative`, and only there.
SPECULATION_INPUT = "appliance_speculation"
# `decoding_mode` values with which the backend speculates on every request.
SPECULATIVE_DECODING_MODES = ("medusa", "eagle", "lookahead", "redrafter", "explicit_draft_tokens")

# The most likely alternatives per generated token. The tensorrtllm backend has none (its
# `output_log_probs` hold the chosen token's log-probability alone); the appliance engine server
# declares them on every model it serves, and only there. TOP_LOGPROBS_INPUT (INT32 [1], 0 to
# MAX_TOP_LOGPROBS; 0 or absent: none) asks for k alternatives; each response then carries, for
# each generated token of its `output_ids`, the k token ids (TOP_LOGPROB_IDS_OUTPUT, INT32) and
# their log-probabilities (TOP_LOGPROBS_OUTPUT, FP32), most likely first, [batch, beam, tokens, k].
# The log-probabilities are those `output_log_probs` holds for the chosen token: the log-softmax
# over the whole vocabulary of the logits the token was chosen from.
TOP_LOGPROBS_INPUT = "appliance_top_logprobs"
TOP_LOGPROB_IDS_OUTPUT = "appliance_top_logprob_ids"
TOP_LOGPROBS_OUTPUT = "appliance_top_logprob_values"
MAX_TOP_LOGPROBS = 20

_OUTPUTS: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("output_ids", mc.TYPE_INT32, (-1, -1)),
    ("sequence_length", mc.TYPE_INT32, (-1,)),
    ("cum_log_probs", mc.TYPE_FP32, (-1,)),
    ("output_log_probs", mc.TYPE_FP32, (-1, -1)),
    ("context_logits", mc.TYPE_FP32, (-1, -1)),
    ("generation_logits", mc.TYPE_FP32, (-1, -1, -1)),
    ("batch_index", mc.TYPE_INT32, (1,)),
    ("sequence_index", mc.TYPE_INT32, (1,)),
)
REQUIRED_OUTPUTS = ("output_ids", "sequence_length")
# Type and dims of every input above and of the required outputs, as the template declares them
# and the gateway sends and reads them (`verify` checks a declared one against these).
TENSOR_SHAPES: dict[tuple[str, str], tuple[int, tuple[int, ...]]] = {
    **{("input", name): (dtype, dims) for name, dtype, dims, _, _ in _INPUTS},
    **{
        ("output", name): (dtype, dims)
        for name, dtype, dims in _OUTPUTS
        if name in REQUIRED_OUTPUTS
    },
}

# Parameters the tensorrtllm backend (1.2 line, inflight_batcher_llm model_instance_state.cc) reads
# with no fallback when a model instance is created: `getBatchingTypeFromParams` reads
# gpt_model_type and `getGuidedDecodingConfigFromParams` the other three, and a missing key throws
# "Cannot find parameter with name: ..." so the model never loads. Every other parameter it reads
# sits in a try/catch with a logged default. Empty strings turn guided decoding off.
BACKEND_REQUIRED_PARAMETERS = (
    "gpt_model_type",
    "tokenizer_dir",
    "xgrammar_tokenizer_info_path",
    "guided_decoding_backend",
)
# Integer parameters -> (lowest, highest) that `repo` writes and `verify` accepts. The backend
# reads them as int32 and, on a value it cannot read, logs a warning and uses its default. A
# cancellation check every second at least: a cancelled request keeps the GPU until the next one.
# CUDA graphs: each cached graph reserves GPU memory; batch 1 needs one.
PARAMETER_RANGES: dict[str, tuple[int, int]] = {
    "cancellation_check_period_ms": (1, 1000),
    "cuda_graph_cache_size": (1, 256),
}
# The values the backend accepts for gpt_model_type ("v1" is static batching).
GPT_MODEL_TYPES = ("inflight_fused_batching", "inflight_batching", "V1", "v1")


@dataclass(frozen=True)
class GuidedDecoding:
    """Where a model with guided decoding on has its tokenizer: the directory (``tokenizer_dir``)
    and the tokenizer info file xgrammar reads (``xgrammar_tokenizer_info_path``). Absolute: the
    tensorrtllm backend opens the file from tritonserver's working directory."""

    tokenizer_dir: str
    tokenizer_info_path: str


@dataclass(frozen=True)
class RepoParams:
    """Everything that varies between repositories; the rest is fixed by the latency goal."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    tokens_per_block: int
    kv_cache_free_gpu_mem_fraction: float
    enable_kv_cache_reuse: bool
    cuda_graph_mode: bool
    cuda_graph_cache_size: int
    cancellation_check_period_ms: int
    exclude_input_in_output: bool
    gpu_device_ids: tuple[int, ...]
    hf_model_dir: str
    engine_dir: str | None
    guided_decoding: GuidedDecoding | None = None  # None: guided decoding off
    # Speculative decoding: parameters the backend reads for the mode (decoding_mode, choices,
    # lookahead sizes), written verbatim; `draft_inputs` declares the draft-target inputs.
    speculative: tuple[tuple[str, str], ...] = ()
    draft_inputs: bool = False
    draft_logits: bool = False
    name: str = MODEL_NAME
    max_tokens_in_paged_kv_cache: int | None = None
    # The engine's max_seq_len when it differs from `max_seq_len` (speculation adds the draft
    # tokens written past a request's last token): attention must cover the whole KV sequence.
    attention_window: int | None = None


def _bool(v: bool) -> str:
    return "true" if v else "false"


def parameters(p: RepoParams) -> dict[str, str]:
    """The full parameters map; every value is a literal."""
    params = {
        "max_beam_width": "1",
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": "inflight_fused_batching",
        # Read unconditionally by the backend; empty: no guided decoding.
        "tokenizer_dir": p.guided_decoding.tokenizer_dir if p.guided_decoding else "",
        "xgrammar_tokenizer_info_path": (
            p.guided_decoding.tokenizer_info_path if p.guided_decoding else ""
        ),
        "guided_decoding_backend": XGRAMMAR if p.guided_decoding else "",
        "batch_scheduler_policy": "guaranteed_no_evict",
        "kv_cache_free_gpu_mem_fraction": f"{p.kv_cache_free_gpu_mem_fraction:g}",
        "enable_kv_cache_reuse": _bool(p.enable_kv_cache_reuse),
        "enable_chunked_context": "false",
        "max_attention_window_size": str(p.attention_window or p.max_seq_len),
        "exclude_input_in_output": _bool(p.exclude_input_in_output),
        "cancellation_check_period_ms": str(p.cancellation_check_period_ms),
        "cuda_graph_mode": _bool(p.cuda_graph_mode),
        "cuda_graph_cache_size": str(p.cuda_graph_cache_size),
        "gpu_device_ids": ",".join(str(i) for i in p.gpu_device_ids),
        # Not read by the backend; they let the gateway, `verify` and the engine server see the
        # engine's limits and KV block size.
        "max_input_len": str(p.max_input_len),
        "max_seq_len": str(p.max_seq_len),
        TOKENS_PER_BLOCK_PARAMETER: str(p.tokens_per_block),
        "hf_model_dir": p.hf_model_dir,
    }
    if p.engine_dir is not None:
        params["gpt_model_path"] = p.engine_dir
        params["engine_dir"] = p.engine_dir
    if p.max_tokens_in_paged_kv_cache is not None:
        params["max_tokens_in_paged_kv_cache"] = str(p.max_tokens_in_paged_kv_cache)
    params.update(p.speculative)
    return params


def model_config(p: RepoParams) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=p.name, backend=BACKEND, max_batch_size=p.max_batch_size)
    cfg.model_transaction_policy.decoupled = True
    cfg.dynamic_batching.preferred_batch_size.append(p.max_batch_size)
    cfg.dynamic_batching.max_queue_delay_microseconds = 0
    for name, dtype, dims, optional, ragged in _INPUTS:
        t = cfg.input.add(name=name, data_type=dtype, dims=list(dims), optional=optional)
        if ragged:
            t.allow_ragged_batch = True
        if dims == (1,):
            t.reshape.SetInParent()  # shape [] per request, as the template declares
    if p.guided_decoding is not None:
        for name in GUIDED_DECODING_INPUTS:
            # As the template declares them: [1] per request, no reshape.
            cfg.input.add(
                name=name,
                data_type=mc.TYPE_STRING,
                dims=[1],
                optional=True,
                allow_ragged_batch=True,
            )
    if p.draft_inputs:
        # As the template declares them; draft_logits only when acceptance uses logits.
        cfg.input.add(
            name="draft_input_ids",
            data_type=mc.TYPE_INT32,
            dims=[-1],
            optional=True,
            allow_ragged_batch=True,
        )
        if p.draft_logits:
            cfg.input.add(
                name="draft_logits",
                data_type=mc.TYPE_FP32,
                dims=[-1, -1],
                optional=True,
                allow_ragged_batch=True,
            )
        t = cfg.input.add(
            name="draft_acceptance_threshold", data_type=mc.TYPE_FP32, dims=[1], optional=True
        )
        t.reshape.SetInParent()
    for name, dtype, dims in _OUTPUTS:
        cfg.output.add(name=name, data_type=dtype, dims=list(dims))
    declare_perf_metrics(cfg)
    cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    for key, value in parameters(p).items():
        cfg.parameters[key].string_value = value
    return cfg


def declare_perf_metrics(cfg: mc.ModelConfig) -> None:
    """Declares PERF_METRICS_INPUT and PERF_OUTPUTS on `cfg` where it does not yet (as the
    template declares them: [1] each, the input reshaped to [] per request)."""
    if PERF_METRICS_INPUT not in {i.name for i in cfg.input}:
        t = cfg.input.add(name=PERF_METRICS_INPUT, data_type=mc.TYPE_BOOL, dims=[1], optional=True)
        t.reshape.SetInParent()
    outputs = {o.name for o in cfg.output}
    for name, dtype in PERF_OUTPUTS:
        if name not in outputs:
            cfg.output.add(name=name, data_type=dtype, dims=[1])


def render(cfg: mc.ModelConfig) -> str:
    return str(text_format.MessageToString(cfg))


def parse(text: str) -> mc.ModelConfig:
    """Parse protobuf text format; raises ``text_format.ParseError`` on bad input."""
    cfg = mc.ModelConfig()
    text_format.Parse(text, cfg)
    return cfg
