"""How the engine server computes: device, dtype, weight format, CUDA graphs, and the fit check.

Everything here is decided before a weight is loaded, so a wrong device or a model that cannot fit
is refused in milliseconds with one line that says what to change, not by an out-of-memory error
minutes into loading. The fit arithmetic is engine_build's planner (`make_plan`): the same weights
+ KV cache + activation/workspace budget a TensorRT-LLM build is planned with, applied to the memory
the device has free right now.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from appliance.engine.device import resolve_device
from appliance.engine.kernels import KernelChoice, resolve_kernels, triton_problem
from appliance.engine.linear import Scaling, WeightQuant
from appliance.engine.llama import LlamaConfig
from appliance.engine.prefill import PREFILL_BUCKETS, bucket_problem
from appliance.engine.prefix_cache import free_device_bytes
from appliance.engine.quantized import DEFAULT_GROUP_SIZE, GROUP_SIZES, GroupQuant
from appliance.engine.random_weights import SHAPES
from appliance.engine.repository import KvCacheParams
from appliance.engine.speculative import NgramSpeculation
from appliance.engine.verify import default_verify_counts, verify_counts_problem
from engine_build.formats import FORMATS, WeightFormat
from engine_build.planner import GIB, MIB, FitPlan, make_plan
from engine_build.spec import BuildSpec

__all__ = [
    "DTYPES",
    "EngineOptions",
    "FitError",
    "check_fit",
    "device_problem",
    "draft_model_problem",
]

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
# What a CUDA context, cuBLAS workspaces and the caching allocator's slack take on a GPU beyond the
# tensors (the planner's default for a TensorRT-LLM engine); on a CPU, the torch runtime itself.
RUNTIME_OVERHEAD_BYTES = BuildSpec.runtime_overhead_bytes
# FP8 tensor cores (and torch._scaled_mm on CUDA) start with Ada (8.9) and Hopper (9.0).
FP8_MIN_CAPABILITY = (8, 9)
# --weights -> the planner's storage format of the linear layers (engine_build.formats).
WEIGHT_FORMATS = {"dtype": "none", "fp8": "fp8", "int8": "int8_group", "int4": "int4_group"}
Weights = Literal["dtype", "fp8", "int8", "int4"]


class FitError(ValueError):
    """The model does not fit the device's free memory; the message has the numbers."""


@dataclass(frozen=True)
class EngineOptions:
    """The `appliance engine` compute options (docs/MODEL_REPOSITORY.md, "Engine server options").

    `dtype` "auto" is float32 on a CPU and bfloat16 on a GPU; `weights` "fp8" quantizes the
    linear layers of every block to E4M3 at load (`fp8_scaling` per output channel or per tensor),
    "int8"/"int4" to weight-only integers with one scale per `weight_group` inputs;
    `cuda_graph` "auto" captures the decode step on a GPU only; `kernels` "auto" runs the decode
    step (captured or not) on the fused Triton kernels on a GPU where triton imports, eager torch
    elsewhere;
    `prefill_buckets` are the prompt lengths whose prefill is captured beside the decode step
    (`appliance.engine.prefill`). `random_weights` names a shape
    from `appliance.engine.random_weights.SHAPES` to serve seeded random weights of instead of each
    model's checkpoint (latency work without a download). `speculative` "ngram" runs prompt-lookup
    speculative decoding (`draft_tokens` drafts a step, n-grams of at most `ngram` tokens); with
    CUDA graphs its verify step is captured for each of `verify_counts` draft counts
    (`appliance.engine.verify`). "draft" drafts with the smaller Llama checkpoint in `draft_model`
    (same tokenizer; `appliance.engine.draft_model`), whose own steps run eager.
    """

    device: str = "cpu"
    dtype: str = "auto"
    weights: Weights = "dtype"
    fp8_scaling: Scaling = "channel"
    weight_group: int = DEFAULT_GROUP_SIZE
    cuda_graph: Literal["auto", "on", "off"] = "auto"
    kernels: KernelChoice = "auto"
    prefill_buckets: tuple[int, ...] = PREFILL_BUCKETS
    random_weights: str | None = None
    seed: int = 0
    speculative: Literal["off", "ngram", "draft"] = "off"
    draft_tokens: int = 4
    ngram: int = 3
    draft_model: str | None = None
    verify_graphs: tuple[int, ...] | None = None

    @property
    def verify_counts(self) -> tuple[int, ...]:
        """The draft counts whose verify step is captured with CUDA graphs: `verify_graphs`, or
        when None those `default_verify_counts` derives from `draft_tokens`; none when speculation
        is off or the step runs eager."""
        if self.speculative == "off" or not self.use_cuda_graph:
            return ()
        if self.verify_graphs is not None:
            return self.verify_graphs
        return default_verify_counts(self.draft_tokens)

    @property
    def speculation(self) -> NgramSpeculation | None:
        """The prompt-lookup drafter's settings; None when speculation is off or drafts with a
        model (which `appliance.engine.loading` builds once the target is loaded)."""
        if self.speculative != "ngram":
            return None
        return NgramSpeculation(self.draft_tokens, self.ngram)

    @property
    def torch_device(self) -> torch.device:
        """The device, indexed (`cuda` is the current CUDA device); valid once `problem()` is None."""
        return resolve_device(self.device)

    @property
    def device_type(self) -> str:
        """cpu or cuda, read without touching CUDA."""
        return torch.device(self.device).type

    @property
    def dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device_type == "cuda" else "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def fp8(self) -> Scaling | None:
        """The FP8 scaling of the linear layers, None for weights in the model dtype."""
        return self.fp8_scaling if self.weights == "fp8" else None

    @property
    def weight_quant(self) -> WeightQuant | None:
        """How the linear layers are quantized at load; None for the model dtype."""
        if self.weights == "int8":
            return GroupQuant(8, self.weight_group)
        if self.weights == "int4":
            return GroupQuant(4, self.weight_group)
        return self.fp8

    @property
    def weights_label(self) -> str:
        if self.weights == "fp8":
            return f"fp8 ({self.fp8_scaling})"
        if self.weights in ("int8", "int4"):
            return f"{self.weights} (group {self.weight_group})"
        return "in the model dtype"

    @property
    def kernel_path(self) -> Literal["triton", "torch"]:
        """The decode step's kernels (`auto` resolved for this device)."""
        return resolve_kernels(self.kernels, torch.device(self.device))

    @property
    def use_cuda_graph(self) -> bool:
        if self.cuda_graph == "auto":
            return self.device_type == "cuda"
        return self.cuda_graph == "on"

    def problem(self) -> tuple[str, str] | None:
        """(option, why) for the first option this process cannot honour; None when all can."""
        why = device_problem(self.device)
        if why:
            return f"--device {self.device}", why
        if self.dtype != "auto" and self.dtype not in DTYPES:
            return f"--dtype {self.dtype}", f"expected auto or one of {', '.join(DTYPES)}"
        if self.weights == "fp8" and self.dtype_name != "bfloat16":
            return (
                "--weights fp8",
                f"FP8 linear layers compute in bfloat16; use --dtype bfloat16, not {self.dtype_name}",
            )
        if self.weights == "fp8" and self.device_type == "cuda":
            major, minor = torch.cuda.get_device_capability(self.torch_device)
            if (major, minor) < FP8_MIN_CAPABILITY:
                return (
                    "--weights fp8",
                    f"FP8 matrix products need compute capability 8.9 or later (Ada, Hopper); "
                    f"this GPU is {major}.{minor}: use --weights dtype",
                )
        if self.weights not in WEIGHT_FORMATS:
            return f"--weights {self.weights}", f"expected one of {', '.join(WEIGHT_FORMATS)}"
        if self.weight_group not in GROUP_SIZES:
            return (
                f"--weight-group {self.weight_group}",
                f"expected one of {', '.join(map(str, GROUP_SIZES))}",
            )
        if self.weight_group != DEFAULT_GROUP_SIZE and self.weights not in ("int8", "int4"):
            return (
                f"--weight-group {self.weight_group}",
                "applies to --weights int8 or int4 only",
            )
        if self.cuda_graph == "on" and self.device_type != "cuda":
            return "--cuda-graph on", "CUDA graphs need a CUDA device; use --cuda-graph off or auto"
        if self.kernels == "triton":
            why = triton_problem(torch.device(self.device))
            if why:
                return "--kernels triton", why
        why = bucket_problem(self.prefill_buckets)
        if why:
            return "--prefill-buckets", why
        if self.random_weights is not None and self.random_weights not in SHAPES:
            return f"--random-weights {self.random_weights}", f"known shapes: {', '.join(SHAPES)}"
        if not 0 <= self.seed < 2**31:
            return f"--seed {self.seed}", "expected an integer in [0, 2**31)"
        if self.speculative not in ("off", "ngram", "draft"):
            return f"--speculative {self.speculative}", "expected off, ngram or draft"
        why = draft_model_problem(self.speculative, self.draft_model)
        if why:
            return f"--draft-model {self.draft_model or ''}".rstrip(), why
        spec = NgramSpeculation(self.draft_tokens, self.ngram).problem()
        if spec:
            option, why = spec
            value = self.draft_tokens if option == "--draft-tokens" else self.ngram
            return f"{option} {value}", why
        if self.verify_graphs is not None:
            listed = ",".join(map(str, self.verify_graphs))
            why = verify_counts_problem(self.verify_graphs)
            if why:
                return f"--verify-graphs {listed}", why
            if self.speculative != "off" and self.draft_tokens not in self.verify_graphs:
                return (
                    f"--draft-tokens {self.draft_tokens}",
                    f"no verify step is captured for {self.draft_tokens} drafts (--verify-graphs "
                    f"{listed}); add {self.draft_tokens} to --verify-graphs, or leave it auto",
                )
        return None


def draft_model_problem(speculative: str, draft_model: str | None) -> str | None:
    """Why `--draft-model` cannot serve `--speculative` (None: it can); the tokenizer is compared
    with the target's at load."""
    if speculative != "draft":
        return None if draft_model is None else "applies to --speculative draft only"
    if not draft_model:
        return "--speculative draft needs a draft model checkpoint directory"
    if not (Path(draft_model) / "config.json").is_file():
        return "no config.json there; expected a Hugging Face Llama checkpoint directory"
    return None


def device_problem(device: str) -> str | None:
    """Why the engine server cannot compute on `device` (None: it can); checked before loading."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        return "not a device; expected cpu, cuda or cuda:N"
    if parsed.type == "cpu":
        return None
    if parsed.type != "cuda":
        return "not a device; expected cpu, cuda or cuda:N"
    if not torch.cuda.is_available():
        build = "" if torch.version.cuda else f" (this torch, {torch.__version__}, has no CUDA)"
        return f"CUDA is not available on this machine; use --device cpu{build}"
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


@dataclass(frozen=True)
class _EngineFitSpec:
    """The planner's `FitSpec` for the engine server: one stream, no tensor parallelism.

    The working cache holds `max_seq_len` tokens at batch 1; activations are one prefill chunk of
    `max_num_tokens`; one CUDA graph reservation per captured attention span.
    """

    dtype: str
    weight_format: WeightFormat
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int
    kv_cache_free_gpu_mem_fraction: float
    cuda_graph_mode: bool
    cuda_graph_cache_size: int
    group_size: int = DEFAULT_GROUP_SIZE
    kv_cache_dtype: str = "auto"
    tp_size: int = 1
    max_batch_size: int = 1
    runtime_overhead_bytes: int = RUNTIME_OVERHEAD_BYTES


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def check_fit(
    config: LlamaConfig,
    options: EngineOptions,
    kv: KvCacheParams,
    max_seq_len: int,
    prefill_chunk: int,
    graphs: int,
    free_bytes: int | None = None,
) -> FitPlan:
    """The planner's fit plan for serving `config` with `options`, or FitError naming every number
    when the model does not fit.

    `free_bytes` defaults to what the device has free now (MemAvailable on a CPU).
    """
    device = options.torch_device
    if free_bytes is None:
        free_bytes = free_device_bytes(device)
    spec = _EngineFitSpec(
        dtype=options.dtype_name,
        weight_format=FORMATS[WEIGHT_FORMATS[options.weights]],
        group_size=options.weight_group,
        max_seq_len=max_seq_len,
        max_num_tokens=min(prefill_chunk, max_seq_len),
        tokens_per_block=kv.tokens_per_block,
        kv_cache_free_gpu_mem_fraction=kv.free_mem_fraction,
        cuda_graph_mode=graphs > 0,
        cuda_graph_cache_size=graphs,
    )
    plan = make_plan(config, spec, free_bytes)
    if plan.fits:
        return plan
    weights = options.dtype_name if options.weights == "dtype" else options.weights_label
    hints = ["lower max_seq_len in config.pbtxt"]
    if options.weights != "int4":
        hints.append(
            "use --weights int4" if options.weights != "dtype" else "use --weights fp8 or int4"
        )
    hints.append("free memory on the device")
    raise FitError(
        f"does not fit on {device}: needs {_size(plan.required_bytes)} = weights "
        f"{_size(plan.weight_bytes)} ({weights}) + KV cache {_size(plan.kv_bytes_needed)} "
        f"({max_seq_len} tokens) + activations {_size(plan.activation_bytes + plan.logits_bytes)}"
        f" + runtime {_size(plan.overhead_bytes)}, with the KV cache at most "
        f"{kv.free_mem_fraction:g} of what is left, and {_size(free_bytes)} is free; "
        + ", or ".join(hints)
    )
