"""The build spec: one TOML file an operator writes per engine.

Parsing and validation live here so every other module can trust a :class:`BuildSpec` without
re-checking it. Validation refuses contradictions up front (input longer than the sequence,
``opt_num_tokens`` together with multiple profiles, KV reuse without paged context FMHA, ...)
because TensorRT-LLM either rejects them after minutes of work or, worse, silently falls back
to defaults. Unknown keys are errors for the same reason: a typo must not become a default.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_build.errors import BuildError

DTYPES = ("bfloat16", "float16")
QUANTIZATIONS = ("fp8", "none")
KV_CACHE_DTYPES = ("fp8", "auto")
GEMM_CHOICES = ("gemm_plugin", "low_latency_gemm_plugin")


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
    cuda_graph_mode: bool = True
    cuda_graph_cache_size: int = 1
    cancellation_check_period_ms: int = 10
    exclude_input_in_output: bool = True
    runtime_overhead_mib: int = 1024
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


# section -> key -> (BuildSpec field, expected python type)
_SCHEMA: dict[str, dict[str, tuple[str, type | tuple[type, ...]]]] = {
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
        "free_gpu_mem_fraction": ("kv_cache_free_gpu_mem_fraction", (float, int)),
    },
    "plugins": {
        "gemm": ("gemm", str),
    },
    "runtime": {
        "cuda_graph_mode": ("cuda_graph_mode", bool),
        "cuda_graph_cache_size": ("cuda_graph_cache_size", int),
        "cancellation_check_period_ms": ("cancellation_check_period_ms", int),
        "exclude_input_in_output": ("exclude_input_in_output", bool),
    },
    "plan": {
        "runtime_overhead_mib": ("runtime_overhead_mib", int),
    },
}
_TRTLLM_KEYS = ("venv", "container", "quantize_script")


def _check_type(where: str, value: Any, expected: type | tuple[type, ...]) -> None:
    # bool is an int subclass: "max_batch_size = true" must not pass as 1.
    if isinstance(value, bool) and expected is not bool:
        raise BuildError(f"{where}: expected {_type_name(expected)}, got a boolean")
    if not isinstance(value, expected):
        raise BuildError(f"{where}: expected {_type_name(expected)}, got {type(value).__name__}")


def _type_name(expected: type | tuple[type, ...]) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def _parse_trtllm(base: Path, table: Any) -> TrtllmInstall:
    if not isinstance(table, dict):
        raise BuildError("[trtllm] must be a table with 'venv' or 'container'")
    unknown = sorted(set(table) - set(_TRTLLM_KEYS))
    if unknown:
        raise BuildError(f"[trtllm]: unknown key {unknown[0]!r}")
    venv = table.get("venv")
    container = table.get("container")
    if (venv is None) == (container is None):
        raise BuildError("[trtllm]: set exactly one of 'venv' (a path) or 'container' (argv list)")
    script = table.get("quantize_script")
    if script is None:
        # The wheel does not ship examples/; the script must come from the matching source tag.
        raise BuildError(
            "[trtllm]: missing quantize_script (path of examples/quantization/quantize.py "
            "from the TensorRT-LLM 1.2 sources; inside the container for 'container')"
        )
    _check_type("trtllm.quantize_script", script, str)
    if venv is not None:
        _check_type("trtllm.venv", venv, str)
        return TrtllmInstall(_resolve(base, venv), (), str(_resolve(base, script)))
    if not isinstance(container, list) or not container:
        raise BuildError("trtllm.container: expected a non-empty list of strings (argv prefix)")
    for item in container:
        _check_type("trtllm.container[]", item, str)
    return TrtllmInstall(None, tuple(container), script)


def parse_spec(data: dict[str, Any], source: Path) -> BuildSpec:
    """Turn a decoded TOML document into a validated spec; relative paths are spec-relative."""
    base = source.parent
    values: dict[str, Any] = {}
    for section, table in data.items():
        if section == "trtllm":
            continue
        if section not in _SCHEMA:
            raise BuildError(f"{source}: unknown section [{section}]")
        if not isinstance(table, dict):
            raise BuildError(f"{source}: [{section}] must be a table")
        for key, value in table.items():
            if key not in _SCHEMA[section]:
                raise BuildError(f"{source}: unknown key {section}.{key}")
            name, expected = _SCHEMA[section][key]
            _check_type(f"{section}.{key}", value, expected)
            values[name] = value
    if "trtllm" not in data:
        raise BuildError(f"{source}: missing [trtllm] section (venv or container)")
    values["trtllm"] = _parse_trtllm(base, data["trtllm"])
    for required in ("hf_model_dir", "work_dir"):
        if required not in values:
            raise BuildError(f"{source}: missing model.{required}")
    values["hf_model_dir"] = _resolve(base, values["hf_model_dir"])
    values["work_dir"] = _resolve(base, values["work_dir"])
    if "gpu_ids" in values:
        ids = values["gpu_ids"]
        for i in ids:
            _check_type("parallel.gpu_ids[]", i, int)
        values["gpu_ids"] = tuple(ids)
    elif values.get("tp_size", 1) > 1:
        values["gpu_ids"] = tuple(range(values["tp_size"]))
    if "kv_cache_free_gpu_mem_fraction" in values:
        values["kv_cache_free_gpu_mem_fraction"] = float(values["kv_cache_free_gpu_mem_fraction"])
    spec = BuildSpec(source=source, **values)
    validate(spec)
    return spec


def validate(spec: BuildSpec) -> None:
    """Refuse contradictory or unsupported values with the key to change in the message."""
    if spec.dtype not in DTYPES:
        raise BuildError(f"precision.dtype must be one of {', '.join(DTYPES)}, got {spec.dtype!r}")
    if spec.quantization not in QUANTIZATIONS:
        raise BuildError(
            f"precision.quantization must be one of {', '.join(QUANTIZATIONS)}, "
            f"got {spec.quantization!r}"
        )
    if spec.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise BuildError(
            f"precision.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
            f"got {spec.kv_cache_dtype!r}"
        )
    if spec.gemm not in GEMM_CHOICES:
        raise BuildError(
            f"plugins.gemm must be one of {', '.join(GEMM_CHOICES)}, got {spec.gemm!r}"
        )
    if spec.gemm == "low_latency_gemm_plugin" and not spec.weights_fp8:
        raise BuildError(
            "plugins.gemm = 'low_latency_gemm_plugin' exists only for fp8 weights; "
            "use 'gemm_plugin' with quantization = 'none'"
        )
    positive = {
        "precision.calib_size": spec.calib_size,
        "limits.max_input_len": spec.max_input_len,
        "limits.max_seq_len": spec.max_seq_len,
        "limits.max_num_tokens": spec.max_num_tokens,
        "limits.max_batch_size": spec.max_batch_size,
        "parallel.tp_size": spec.tp_size,
        "kv_cache.tokens_per_block": spec.tokens_per_block,
        "runtime.cuda_graph_cache_size": spec.cuda_graph_cache_size,
        "runtime.cancellation_check_period_ms": spec.cancellation_check_period_ms,
    }
    for key, value in positive.items():
        if value < 1:
            raise BuildError(f"{key} must be >= 1, got {value}")
    if spec.runtime_overhead_mib < 0:
        raise BuildError(f"plan.runtime_overhead_mib must be >= 0, got {spec.runtime_overhead_mib}")
    if spec.max_input_len > spec.max_seq_len:
        raise BuildError(
            f"limits.max_input_len ({spec.max_input_len}) > limits.max_seq_len "
            f"({spec.max_seq_len}): the sequence includes the input; raise max_seq_len"
        )
    if spec.max_input_len == spec.max_seq_len:
        raise BuildError(
            f"limits.max_input_len equals limits.max_seq_len ({spec.max_seq_len}): "
            "no room left for a single output token"
        )
    if spec.max_num_tokens < spec.max_input_len:
        # With batch 1 and no chunked context the whole prompt is one forward pass.
        raise BuildError(
            f"limits.max_num_tokens ({spec.max_num_tokens}) < limits.max_input_len "
            f"({spec.max_input_len}): a full prompt would not fit one context step"
        )
    if spec.opt_num_tokens is not None:
        if spec.multiple_profiles:
            raise BuildError(
                "limits.opt_num_tokens conflicts with limits.multiple_profiles = true "
                "(trtllm-build refuses both); drop one"
            )
        if not 1 <= spec.opt_num_tokens <= spec.max_num_tokens:
            raise BuildError(
                f"limits.opt_num_tokens must be in 1..max_num_tokens ({spec.max_num_tokens})"
            )
    if spec.tokens_per_block & (spec.tokens_per_block - 1):
        raise BuildError(
            f"kv_cache.tokens_per_block must be a power of two, got {spec.tokens_per_block}"
        )
    if not 0.0 < spec.kv_cache_free_gpu_mem_fraction <= 1.0:
        raise BuildError(
            "kv_cache.free_gpu_mem_fraction must be in (0, 1], got "
            f"{spec.kv_cache_free_gpu_mem_fraction}"
        )
    if len(spec.gpu_ids) != spec.tp_size:
        raise BuildError(
            f"parallel.gpu_ids has {len(spec.gpu_ids)} ids but parallel.tp_size is "
            f"{spec.tp_size}: one GPU per rank"
        )
    if len(set(spec.gpu_ids)) != len(spec.gpu_ids) or min(spec.gpu_ids) < 0:
        raise BuildError(f"parallel.gpu_ids must be distinct non-negative ids: {spec.gpu_ids}")


def load_spec(path: Path) -> BuildSpec:
    """Read and validate a spec file; every failure is a one-line :class:`BuildError`."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise BuildError(f"cannot read spec {path}: {err.strerror or err}") from err
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise BuildError(f"spec {path} is not valid TOML: {err}") from err
    return parse_spec(data, path.resolve())
