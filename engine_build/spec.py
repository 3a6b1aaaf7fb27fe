"""The build spec: one TOML file an operator writes per engine.

Parsing and validation live here so every other module can trust a :class:`BuildSpec` without
re-checking it. Validation refuses contradictions up front (input longer than the sequence,
``opt_num_tokens`` together with multiple profiles, KV reuse without paged context FMHA, ...)
because TensorRT-LLM either rejects them after minutes of work or, worse, silently falls back
to defaults. Unknown keys are errors for the same reason: a typo must not become a default. Every refusal
names the file, the line and the key (appliance.tomlcheck, as the gateway's configuration).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import tomlcheck
from appliance.tomlcheck import Fail, Table
from engine_build.errors import SpecError
from engine_build.formats import (
    AWQ_BLOCK_SIZES,
    BUILD_FORMATS,
    DEFAULT_GROUP_SIZE,
    FORMATS,
    WeightFormat,
    kv_problem,
)

DTYPES = ("bfloat16", "float16")
QUANTIZATIONS = BUILD_FORMATS
KV_CACHE_DTYPES = ("fp8", "int8", "auto")
# quantize.py caps AWQ's calibration at 32 samples whatever --calib_size says; the command passes
# the capped number so the plan shows what runs.
AWQ_CALIB_SIZE_MAX = 32
GEMM_CHOICES = ("gemm_plugin", "low_latency_gemm_plugin")
# GEMM + SwiGLU fusion of the gated MLP (FP8 on Hopper only). Each fused plugin goes with its GEMM
# plugin: NVIDIA's batch-1 latency recipe pairs low_latency_gemm_plugin with
# low_latency_gemm_swiglu_plugin (the low-latency GEMM alone measured slower), and trtllm-build
# takes one SwiGLU plugin or the other, never both — one key makes "both" impossible to write.
SWIGLU_FOR_GEMM = {
    "gemm_plugin": "gemm_swiglu_plugin",
    "low_latency_gemm_plugin": "low_latency_gemm_swiglu_plugin",
}
SWIGLU_CHOICES = ("none", *SWIGLU_FOR_GEMM.values())


@dataclass(frozen=True)
class TrtllmInstall:
    """Where TensorRT-LLM lives on the build host; exactly one of ``venv``/``container``.

    ``container`` is an argv prefix (e.g. ``docker run --rm --gpus all -v /m:/m IMAGE``) that
    the tool commands are appended to; paths must be mounted at the same place inside.
    """

    venv: Path | None
    container: tuple[str, ...]
    quantize_script: str


@dataclass(frozen=True)
class BuildSpec:
    """A validated build spec; field names follow the TOML keys (see docs/ENGINE_BUILD.md)."""

    source: Path
    hf_model_dir: Path
    work_dir: Path
    dtype: str = "bfloat16"
    quantization: str = "fp8"
    kv_cache_dtype: str = "fp8"
    calib_size: int = 512
    calib_dataset: str | None = None
    calib_batch_size: int = 1
    calib_max_seq_length: int = 512
    awq_block_size: int = DEFAULT_GROUP_SIZE
    max_input_len: int = 2048
    max_seq_len: int = 4096
    max_num_tokens: int = 2048
    max_batch_size: int = 1
    opt_num_tokens: int | None = None
    multiple_profiles: bool = True
    tp_size: int = 1
    gpu_ids: tuple[int, ...] = (0,)
    tokens_per_block: int = 32
    enable_kv_cache_reuse: bool = False
    kv_cache_free_gpu_mem_fraction: float = 0.9
    gemm: str = "gemm_plugin"
    gemm_swiglu: str = "none"
    cuda_graph_mode: bool = True
    cuda_graph_cache_size: int = 1
    cancellation_check_period_ms: int = 10
    exclude_input_in_output: bool = True
    # The repository serves structured output (guide inputs, xgrammar tokenizer info) unless off.
    guided_decoding: bool = True
    runtime_overhead_bytes: int = 1 << 30
    trtllm: TrtllmInstall = field(
        default_factory=lambda: TrtllmInstall(None, (), "/opt/TensorRT-LLM/quantize.py")
    )

    @property
    def checkpoint_dir(self) -> Path:
        """Where quantize.py writes the TensorRT-LLM checkpoint."""
        return self.work_dir / "checkpoint"

    @property
    def engine_dir(self) -> Path:
        """Where trtllm-build writes config.json and rank{N}.engine."""
        return self.work_dir / "engine"

    @property
    def log_dir(self) -> Path:
        """Full logs of each stage, kept after failures for the operator."""
        return self.work_dir / "logs"

    @property
    def use_paged_context_fmha(self) -> bool:
        """KV-cache reuse needs paged context FMHA; without reuse the unpaged kernel is faster."""
        return self.enable_kv_cache_reuse

    @property
    def weights_fp8(self) -> bool:
        return self.quantization == "fp8"

    @property
    def kv_fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    @property
    def weight_format(self) -> WeightFormat:
        return FORMATS[self.quantization]

    @property
    def group_size(self) -> int:
        """Inputs per scale of the group-wise (AWQ) formats."""
        return self.awq_block_size

    @property
    def is_awq(self) -> bool:
        return self.quantization in ("int4_awq", "w4a8_awq")

    @property
    def effective_calib_size(self) -> int:
        """The calibration samples quantize.py actually runs (AWQ caps them)."""
        return min(self.calib_size, AWQ_CALIB_SIZE_MAX) if self.is_awq else self.calib_size


# section -> key -> (BuildSpec field, expected TOML type). "size" is a byte size with its unit.
_SCHEMA: dict[str, dict[str, tuple[str, type | str]]] = {
    "model": {
        "hf_model_dir": ("hf_model_dir", str),
        "work_dir": ("work_dir", str),
    },
    "precision": {
        "dtype": ("dtype", str),
        "quantization": ("quantization", str),
        "kv_cache_dtype": ("kv_cache_dtype", str),
        "calib_size": ("calib_size", int),
        "calib_dataset": ("calib_dataset", str),
        "calib_batch_size": ("calib_batch_size", int),
        "calib_max_seq_length": ("calib_max_seq_length", int),
        "awq_block_size": ("awq_block_size", int),
    },
    "limits": {
        "max_input_len": ("max_input_len", int),
        "max_seq_len": ("max_seq_len", int),
        "max_num_tokens": ("max_num_tokens", int),
        "max_batch_size": ("max_batch_size", int),
        "opt_num_tokens": ("opt_num_tokens", int),
        "multiple_profiles": ("multiple_profiles", bool),
    },
    "parallel": {
        "tp_size": ("tp_size", int),
        "gpu_ids": ("gpu_ids", list),
    },
    "kv_cache": {
        "tokens_per_block": ("tokens_per_block", int),
        "enable_reuse": ("enable_kv_cache_reuse", bool),
        "free_gpu_mem_fraction": ("kv_cache_free_gpu_mem_fraction", float),
    },
    "plugins": {
        "gemm": ("gemm", str),
        "gemm_swiglu": ("gemm_swiglu", str),
    },
    "runtime": {
        "cuda_graph_mode": ("cuda_graph_mode", bool),
        "cuda_graph_cache_size": ("cuda_graph_cache_size", int),
        "cancellation_check_period_ms": ("cancellation_check_period_ms", int),
        "exclude_input_in_output": ("exclude_input_in_output", bool),
        "guided_decoding": ("guided_decoding", bool),
    },
    "plan": {
        "runtime_overhead": ("runtime_overhead_bytes", "size"),
    },
}
_TRTLLM_KEYS = {"venv", "container", "quantize_script"}


class _Table(Table):
    """A spec table; refusals are SpecError (exit 2)."""

    error = SpecError


# Refusals of a value built in code (no file to name).
_REFUSE = tomlcheck.refusal(SpecError)


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def _parse_trtllm(top: _Table, base: Path) -> TrtllmInstall:
    if "trtllm" not in top.data:
        top.fail(None, "missing [trtllm] table (venv or container, and quantize_script)")
    t = top.sub("trtllm", _TRTLLM_KEYS)
    venv = t.get("venv", str, None)
    container = t.str_list("container", ()) if "container" in t.data else None
    if (venv is None) == (container is None):
        t.fail(None, "set exactly one of 'venv' (a path) or 'container' (argv list)")
    if container is not None and not container:
        t.fail("container", "expected a non-empty list of strings (argv prefix)")
    if "quantize_script" not in t.data:
        # The wheel does not ship examples/; the script must come from the matching source tag.
        t.fail(
            None,
            "missing quantize_script (path of examples/quantization/quantize.py "
            "from the TensorRT-LLM 1.2 sources; inside the container for 'container')",
        )
    script = str(t.get("quantize_script", str, ""))
    if venv is not None:
        return TrtllmInstall(_resolve(base, venv), (), str(_resolve(base, script)))
    assert container is not None
    return TrtllmInstall(None, container, script)


def parse_spec(text: str, data: dict[str, Any], source: Path) -> BuildSpec:
    """Turn a decoded TOML document into a validated spec; relative paths are spec-relative."""
    base = source.parent
    top = _Table(source, text, "", data, {*_SCHEMA, "trtllm"})
    tables = {section: top.sub(section, set(keys)) for section, keys in _SCHEMA.items()}
    values: dict[str, Any] = {}
    for section, keys in _SCHEMA.items():
        t = tables[section]
        for key, (name, kind) in keys.items():
            if key not in t.data:
                continue
            if kind == "size":
                values[name] = t.size(key, None)
            elif kind is list:
                values[name] = t.int_list(key)
            else:
                assert isinstance(kind, type)
                values[name] = t.get(key, kind, None)
    values["trtllm"] = _parse_trtllm(top, base)
    model = tables["model"]
    values["hf_model_dir"] = _resolve(base, model.require("hf_model_dir"))
    values["work_dir"] = _resolve(base, model.require("work_dir"))
    if "gpu_ids" not in values and values.get("tp_size", 1) > 1:
        values["gpu_ids"] = tuple(range(values["tp_size"]))
    spec = BuildSpec(source=source, **values)

    validate(spec, tomlcheck.refusal_in(tables))
    return spec


def validate(spec: BuildSpec, fail: Fail = _REFUSE) -> None:
    """Refuse contradictory or unsupported values; `fail` names the key (and its line)."""
    choices = {
        "precision.dtype": (spec.dtype, DTYPES),
        "precision.quantization": (spec.quantization, QUANTIZATIONS),
        "precision.kv_cache_dtype": (spec.kv_cache_dtype, KV_CACHE_DTYPES),
        "plugins.gemm": (spec.gemm, GEMM_CHOICES),
        "plugins.gemm_swiglu": (spec.gemm_swiglu, SWIGLU_CHOICES),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            fail(key, f"must be one of {', '.join(allowed)}, got {value!r}")
    why = kv_problem(spec.quantization, spec.kv_cache_dtype)
    if why:
        fail("precision.kv_cache_dtype", why)
    if spec.awq_block_size not in AWQ_BLOCK_SIZES:
        fail(
            "precision.awq_block_size",
            f"must be one of {', '.join(map(str, AWQ_BLOCK_SIZES))} (the group sizes "
            f"TensorRT-LLM's group-wise kernels take), got {spec.awq_block_size}",
        )
    if spec.awq_block_size != DEFAULT_GROUP_SIZE and not spec.is_awq:
        fail(
            "precision.awq_block_size",
            f"applies to int4_awq and w4a8_awq only, not quantization = {spec.quantization!r}",
        )
    if spec.gemm == "low_latency_gemm_plugin" and not spec.weights_fp8:
        fail(
            "plugins.gemm",
            "'low_latency_gemm_plugin' exists only for fp8 weights; "
            "use 'gemm_plugin' with quantization = 'none'",
        )
    if spec.gemm_swiglu != "none":
        if not spec.weights_fp8:
            fail(
                "plugins.gemm_swiglu",
                f"{spec.gemm_swiglu!r} exists only for fp8 weights (Hopper); "
                "set quantization = 'fp8' or gemm_swiglu = 'none'",
            )
        paired = SWIGLU_FOR_GEMM[spec.gemm]
        if spec.gemm_swiglu != paired:
            fail(
                "plugins.gemm_swiglu",
                f"{spec.gemm_swiglu!r} does not pair with plugins.gemm = {spec.gemm!r}; "
                f"use {paired!r} (or 'none')",
            )
    positive = {
        "precision.calib_size": spec.calib_size,
        "precision.calib_batch_size": spec.calib_batch_size,
        "precision.calib_max_seq_length": spec.calib_max_seq_length,
        "limits.max_input_len": spec.max_input_len,
        "limits.max_seq_len": spec.max_seq_len,
        "limits.max_num_tokens": spec.max_num_tokens,
        "limits.max_batch_size": spec.max_batch_size,
        "parallel.tp_size": spec.tp_size,
        "kv_cache.tokens_per_block": spec.tokens_per_block,
        "runtime.cuda_graph_cache_size": spec.cuda_graph_cache_size,
        "runtime.cancellation_check_period_ms": spec.cancellation_check_period_ms,
    }
    for key, count in positive.items():
        if count < 1:
            fail(key, f"must be >= 1, got {count}")
    if spec.max_input_len > spec.max_seq_len:
        fail(
            "limits.max_input_len",
            f"{spec.max_input_len} > limits.max_seq_len ({spec.max_seq_len}): "
            "the sequence includes the input; raise max_seq_len",
        )
    if spec.max_input_len == spec.max_seq_len:
        fail(
            "limits.max_input_len",
            f"equals limits.max_seq_len ({spec.max_seq_len}): no room left for an output token",
        )
    if spec.max_num_tokens < spec.max_input_len:
        # With batch 1 and no chunked context the whole prompt is one forward pass.
        fail(
            "limits.max_num_tokens",
            f"{spec.max_num_tokens} < limits.max_input_len ({spec.max_input_len}): "
            "a full prompt would not fit one context step",
        )
    if spec.opt_num_tokens is not None:
        if spec.multiple_profiles:
            fail(
                "limits.opt_num_tokens",
                "conflicts with limits.multiple_profiles = true (trtllm-build refuses both); "
                "drop one",
            )
        if not 1 <= spec.opt_num_tokens <= spec.max_num_tokens:
            fail(
                "limits.opt_num_tokens",
                f"must be in 1..max_num_tokens ({spec.max_num_tokens}), got {spec.opt_num_tokens}",
            )
    if spec.tokens_per_block & (spec.tokens_per_block - 1):
        fail("kv_cache.tokens_per_block", f"must be a power of two, got {spec.tokens_per_block}")
    if not 0.0 < spec.kv_cache_free_gpu_mem_fraction <= 1.0:
        fail(
            "kv_cache.free_gpu_mem_fraction",
            f"must be in (0, 1], got {spec.kv_cache_free_gpu_mem_fraction}",
        )
    if len(spec.gpu_ids) != spec.tp_size:
        fail(
            "parallel.gpu_ids",
            f"has {len(spec.gpu_ids)} ids but parallel.tp_size is {spec.tp_size}: one GPU per rank",
        )
    if len(set(spec.gpu_ids)) != len(spec.gpu_ids) or min(spec.gpu_ids) < 0:
        fail("parallel.gpu_ids", f"must be distinct non-negative ids, got {list(spec.gpu_ids)}")


def load_spec(path: Path) -> BuildSpec:
    """Read and validate a spec file; every failure is a one-line :class:`SpecError`."""
    text, data = tomlcheck.read(path, "spec", SpecError)
    return parse_spec(text, data, path.resolve())
