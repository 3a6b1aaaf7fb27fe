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
from engine_build import kv_blocks, pbtxt
from engine_build.errors import BuildError, SpecError
from engine_build.formats import (
    AWQ_BLOCK_SIZES,
    BUILD_FORMATS,
    DEFAULT_GROUP_SIZE,
    FORMATS,
    WeightFormat,
    kv_problem,
)
from engine_build.hf_config import read_config
from engine_build.speculative import (
    DRAFT_LEN_MAX,
    MODES,
    Speculative,
    non_leaves_per_level,
    tree_problem,
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
# trtllm-build's PluginConfig.validate raises NotImplementedError for these plugins on SM 100
# (compute capability 10.0 exactly) when they are set.
SM100 = (10, 0)
SM100_REFUSED = ("low_latency_gemm_plugin", "gemm_swiglu_plugin", "low_latency_gemm_swiglu_plugin")


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
    tokens_per_block: int = kv_blocks.DEFAULT_TOKENS_PER_BLOCK
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
    speculative: Speculative = field(default_factory=Speculative)
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
    def draft_checkpoint_dir(self) -> Path:
        """The draft model's TensorRT-LLM checkpoint (draft-target speculation)."""
        return self.work_dir / "draft_checkpoint"

    @property
    def draft_engine_dir(self) -> Path:
        """The draft model's engine (draft-target speculation)."""
        return self.work_dir / "draft_engine"

    @property
    def use_paged_context_fmha(self) -> bool:
        """KV-cache reuse needs paged context FMHA; without reuse the unpaged kernel is faster.
        EAGLE needs it too (trtllm-build turns it on for EAGLE whatever the flag says)."""
        return self.enable_kv_cache_reuse or self.speculative.mode == "eagle"

    @property
    def engine_max_seq_len(self) -> int:
        """The ``max_seq_len`` trtllm-build records: the spec's plus what speculation adds."""
        return self.max_seq_len + self.speculative.extra_seq_len

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
# [speculative] keys -> the modes that take them ("mode" goes with every mode).
_SPECULATIVE_KEYS: dict[str, tuple[str, ...]] = {
    "max_draft_len": ("draft_target", "eagle"),
    "draft_hf_model_dir": ("draft_target",),
    "use_draft_logits": ("draft_target",),
    "medusa_model_dir": ("medusa",),
    "num_medusa_heads": ("medusa",),
    "num_medusa_layers": ("medusa",),
    "medusa_choices": ("medusa",),
    "eagle_model_dir": ("eagle",),
    "num_eagle_layers": ("eagle",),
    "max_non_leaves_per_layer": ("eagle",),
    "eagle_choices": ("eagle",),
    "eagle_dynamic_tree": ("eagle",),
    "lookahead_window_size": ("lookahead",),
    "lookahead_ngram_size": ("lookahead",),
    "lookahead_verification_set_size": ("lookahead",),
}
# What each mode cannot run without.
_SPECULATIVE_REQUIRED: dict[str, tuple[str, ...]] = {
    "draft_target": ("draft_hf_model_dir", "max_draft_len"),
    "medusa": ("medusa_model_dir", "medusa_choices"),
    "eagle": ("eagle_model_dir", "eagle_choices", "max_draft_len"),
    "lookahead": (
        "lookahead_window_size",
        "lookahead_ngram_size",
        "lookahead_verification_set_size",
    ),
}


# Integer settings -> (lowest, highest, what bounds them). The token limits are int32 in
# TensorRT-LLM and the backend's parameters; the runtime ones are config.pbtxt parameters
# (pbtxt.PARAMETER_RANGES, which `verify` checks too).
INT32_MAX = 2**31 - 1
GPUS_MAX = 64
RUNTIME_OVERHEAD_MAX = 1 << 40
_RANGES: dict[str, tuple[int, int, str]] = {
    "precision.calib_size": (1, 65536, "calibration samples"),
    "precision.calib_batch_size": (1, 1024, "samples per calibration batch"),
    "precision.calib_max_seq_length": (1, 1 << 20, "tokens per calibration sample"),
    "limits.max_input_len": (1, INT32_MAX, "tokens, int32 in TensorRT-LLM"),
    "limits.max_seq_len": (1, INT32_MAX, "tokens, int32 in TensorRT-LLM"),
    "limits.max_num_tokens": (1, INT32_MAX, "tokens, int32 in TensorRT-LLM"),
    "limits.max_batch_size": (1, 2048, "the appliance serves 1; trtllm-build's default is 2048"),
    "parallel.tp_size": (1, GPUS_MAX, "GPUs of one host"),
    "kv_cache.tokens_per_block": (1, 1024, "tokens per KV-cache block, a power of two"),
    "runtime.cuda_graph_cache_size": (
        1,
        pbtxt.PARAMETER_RANGES["cuda_graph_cache_size"][1],
        "CUDA graphs kept, each reserving GPU memory",
    ),
    "runtime.cancellation_check_period_ms": (
        1,
        pbtxt.PARAMETER_RANGES["cancellation_check_period_ms"][1],
        "milliseconds a cancelled request may keep the GPU",
    ),
}


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
    # An empty path would resolve to the spec's own folder.
    if not script:
        t.fail("quantize_script", "must not be empty")
    if venv == "":
        t.fail("venv", "must not be empty")
    if venv is not None:
        return TrtllmInstall(_resolve(base, venv), (), str(_resolve(base, script)))
    assert container is not None
    return TrtllmInstall(None, container, script)


def _choices(t: _Table, key: str) -> tuple[tuple[int, ...], ...]:
    value = t.get(key, list, [])
    ok = all(
        isinstance(path, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in path)
        for path in value
    )
    if not ok:
        t.fail(key, f"expected a list of integer lists, e.g. [[0], [0, 0], [1]], got {value!r}")
    # Bounded before the tree is walked (its parent checks cost paths x depth): every path is a
    # draft token, and the backend reads the indices as int32.
    if len(value) > DRAFT_LEN_MAX:
        t.fail(key, f"has {len(value)} paths; at most {DRAFT_LEN_MAX} (one draft token each)")
    deepest = max((len(path) for path in value), default=0)
    if deepest > DRAFT_LEN_MAX:
        t.fail(key, f"has a path of {deepest} indices; at most {DRAFT_LEN_MAX}")
    wide = next((i for path in value for i in path if i > INT32_MAX), None)
    if wide is not None:
        t.fail(key, f"index {wide} is larger than {INT32_MAX} (the backend reads int32)")
    return tuple(tuple(path) for path in value)


def _parse_speculative(top: _Table, base: Path) -> Speculative:
    t = top.sub("speculative", {"mode", *_SPECULATIVE_KEYS})
    mode = str(t.get("mode", str, "none"))
    if mode not in MODES:
        t.fail("mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
    for key, modes in _SPECULATIVE_KEYS.items():
        if key in t.data and mode not in modes:
            t.fail(key, f"does not go with mode = {mode!r} (only {', '.join(modes)}); remove it")
    for key in _SPECULATIVE_REQUIRED.get(mode, ()):
        if key not in t.data:
            t.fail(None, f"mode = {mode!r} needs {key!r}")

    def path(key: str) -> Path | None:
        raw = t.get(key, str, None)
        return None if raw is None else _resolve(base, raw)

    return Speculative(
        mode=mode,
        max_draft_len=t.get("max_draft_len", int, 0),
        draft_hf_model_dir=path("draft_hf_model_dir"),
        use_draft_logits=t.get("use_draft_logits", bool, False),
        medusa_model_dir=path("medusa_model_dir"),
        num_medusa_heads=t.get("num_medusa_heads", int, 4),
        num_medusa_layers=t.get("num_medusa_layers", int, 1),
        medusa_choices=_choices(t, "medusa_choices"),
        eagle_model_dir=path("eagle_model_dir"),
        num_eagle_layers=t.get("num_eagle_layers", int, 4),
        max_non_leaves_per_layer=t.get("max_non_leaves_per_layer", int, 10),
        eagle_choices=_choices(t, "eagle_choices"),
        eagle_dynamic_tree=t.get("eagle_dynamic_tree", bool, False),
        lookahead_window_size=t.get("lookahead_window_size", int, 0),
        lookahead_ngram_size=t.get("lookahead_ngram_size", int, 0),
        lookahead_verification_set_size=t.get("lookahead_verification_set_size", int, 0),
    )


def parse_spec(text: str, data: dict[str, Any], source: Path) -> BuildSpec:
    """Turn a decoded TOML document into a validated spec; relative paths are spec-relative."""
    base = source.parent
    top = _Table(source, text, "", data, {*_SCHEMA, "trtllm", "speculative"})
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
                if values[name] == "":
                    # An empty name or path is never meant: quantize.py cannot load "".
                    t.fail(key, "must not be empty")
    values["trtllm"] = _parse_trtllm(top, base)
    values["speculative"] = _parse_speculative(top, base)
    model = tables["model"]
    values["hf_model_dir"] = _resolve(base, model.require("hf_model_dir"))
    values["work_dir"] = _resolve(base, model.require("work_dir"))
    # Compared as the file system resolves them: an absolute path may hold ".." or a link.
    if values["work_dir"].resolve().is_relative_to(values["hf_model_dir"].resolve()):
        # The checkpoint's fingerprint covers every file under it, so outputs written there
        # would make every build start again from the checkpoint stage.
        model.fail(
            "work_dir",
            f"{values['work_dir']} is inside hf_model_dir {values['hf_model_dir']}; "
            "put the build outputs beside the checkpoint, not in it",
        )
    if "gpu_ids" not in values and values.get("tp_size", 1) > 1:
        # Capped so that an out-of-range tp_size reaches validate(), which names it.
        values["gpu_ids"] = tuple(range(min(values["tp_size"], GPUS_MAX)))
    spec = BuildSpec(source=source, **values)
    outputs = (spec.checkpoint_dir, spec.engine_dir, spec.draft_checkpoint_dir)
    for output in (*outputs, spec.draft_engine_dir):
        if spec.hf_model_dir.resolve().is_relative_to(output.resolve()):
            model.fail(
                "hf_model_dir",
                f"{spec.hf_model_dir} is inside {output}, which `build` removes before it "
                "writes it; keep the checkpoint outside work_dir's outputs",
            )

    speculative = top.sub("speculative", {"mode", *_SPECULATIVE_KEYS})
    validate(spec, tomlcheck.refusal_in({**tables, "speculative": speculative}))
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
    for key, (low, high, what) in _RANGES.items():
        value = getattr(spec, key.split(".", 1)[1])
        if not low <= value <= high:
            fail(key, f"must be between {low} and {high} ({what}), got {value}")
    if spec.runtime_overhead_bytes > RUNTIME_OVERHEAD_MAX:
        size = spec.runtime_overhead_bytes
        got = f"{size} bytes" if size < 2**50 else "more than 1PiB"
        fail("plan.runtime_overhead", f"must be at most 1TiB (per GPU), got {got}")
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
    if len(set(spec.gpu_ids)) != len(spec.gpu_ids) or not all(
        0 <= i < GPUS_MAX for i in spec.gpu_ids
    ):
        fail(
            "parallel.gpu_ids",
            f"must be distinct ids between 0 and {GPUS_MAX - 1}, got {list(spec.gpu_ids)}",
        )
    if spec.speculative.on:
        validate_speculative(spec, fail)


def validate_speculative(spec: BuildSpec, fail: Fail = _REFUSE) -> None:
    """Refuse a speculative setting the 1.2 build or backend would reject or ignore."""
    s = spec.speculative
    if s.mode not in MODES:
        fail("speculative.mode", f"must be one of {', '.join(MODES)}, got {s.mode!r}")
    if s.mode in ("medusa", "eagle") and (
        spec.quantization != "none" or spec.kv_cache_dtype != "auto"
    ):
        # The medusa/eagle examples support FP16/BF16 and convert without quantize.py.
        fail(
            "precision.quantization",
            f"mode = {s.mode!r} builds from examples/{s.mode}/convert_checkpoint.py, which "
            "supports FP16/BF16 only: set quantization = 'none' and kv_cache_dtype = 'auto'",
        )
    if s.mode == "draft_target" and not spec.enable_kv_cache_reuse:
        fail(
            "kv_cache.enable_reuse",
            "mode = 'draft_target' needs KV-cache reuse (the target is built with paged "
            "context FMHA and re-reads accepted tokens' blocks): set enable_reuse = true",
        )
    if s.mode == "medusa":
        why = tree_problem(s.medusa_choices, "medusa_choices")
        if why:
            fail("speculative.medusa_choices", why)
        depth = max(len(p) for p in s.medusa_choices)
        if depth > s.num_medusa_heads:
            fail(
                "speculative.medusa_choices",
                f"paths {depth} deep need {depth} heads; num_medusa_heads is {s.num_medusa_heads}",
            )
        if not 1 <= s.num_medusa_heads <= 16 or not 1 <= s.num_medusa_layers <= 8:
            fail(
                "speculative.num_medusa_heads",
                "num_medusa_heads must be in 1..16 and num_medusa_layers in 1..8",
            )
    if s.mode == "eagle":
        if s.eagle_dynamic_tree:
            fail(
                "speculative.eagle_dynamic_tree",
                "the tensorrtllm backend builds its EagleConfig from eagle_choices only, so "
                "EAGLE-2's dynamic tree cannot be set on a Triton model; set it false",
            )
        why = tree_problem(s.eagle_choices, "eagle_choices")
        if why:
            fail("speculative.eagle_choices", why)
        depth = max(len(p) for p in s.eagle_choices)
        if depth != s.num_eagle_layers:
            fail(
                "speculative.eagle_choices",
                f"the deepest path has {depth} tokens but num_eagle_layers is "
                f"{s.num_eagle_layers}; TensorRT-LLM needs them equal",
            )
        if not 1 <= s.max_non_leaves_per_layer <= DRAFT_LEN_MAX:
            fail(
                "speculative.max_non_leaves_per_layer",
                f"must be between 1 and {DRAFT_LEN_MAX} (nodes per tree level), "
                f"got {s.max_non_leaves_per_layer}",
            )
        widest = max(non_leaves_per_level(s.eagle_choices).values(), default=0)
        if widest > s.max_non_leaves_per_layer:
            fail(
                "speculative.eagle_choices",
                f"a level has {widest} non-leaf nodes; max_non_leaves_per_layer is "
                f"{s.max_non_leaves_per_layer}",
            )
        if len(s.eagle_choices) > s.max_draft_len:
            fail(
                "speculative.max_draft_len",
                f"{s.max_draft_len} < {len(s.eagle_choices)} paths in eagle_choices",
            )
    if s.mode == "lookahead":
        w, n, g = (
            s.lookahead_window_size,
            s.lookahead_ngram_size,
            s.lookahead_verification_set_size,
        )
        if w < 2 or n < 2 or g < 1:
            fail(
                "speculative.lookahead_window_size",
                f"(window, ngram, verification set) = ({w}, {n}, {g}) does not speculate; "
                "the smallest that does is (2, 2, 1), or use mode = 'none'",
            )
    draft = s.draft_len
    key = (
        "speculative.max_draft_len"
        if s.mode in ("draft_target", "eagle")
        else (
            "speculative.medusa_choices"
            if s.mode == "medusa"
            else "speculative.lookahead_window_size"
        )
    )
    if not 1 <= draft <= DRAFT_LEN_MAX:
        fail(key, f"the draft length {draft} is outside 1..{DRAFT_LEN_MAX}")
    need = spec.max_batch_size * (draft + 1)
    if spec.max_num_tokens < need:
        # trtllm-build would silently raise max_num_tokens (and the plan's activations).
        fail(
            "limits.max_num_tokens",
            f"{spec.max_num_tokens} < max_batch_size x (draft length + 1) = {need}: "
            "a verification step would not fit; raise it",
        )


def plugin_problem(spec: BuildSpec, capability: tuple[int, int]) -> str | None:
    """Why trtllm-build would refuse the spec's GEMM plugins on this GPU (None: it would not)."""
    if capability != SM100:
        return None
    for key, value in (("plugins.gemm", spec.gemm), ("plugins.gemm_swiglu", spec.gemm_swiglu)):
        if value in SM100_REFUSED:
            return f"{key} = {value!r}: trtllm-build refuses it on compute capability 10.0; " + (
                "use plugins.gemm = 'gemm_plugin'"
                if key == "plugins.gemm"
                else "set plugins.gemm_swiglu = 'none'"
            )
    return None


def load_spec(path: Path) -> BuildSpec:
    """Read and validate a spec file; every failure is a one-line :class:`SpecError`."""
    text, data = tomlcheck.read(path, "spec", SpecError)
    spec = parse_spec(text, data, path.resolve())
    check_draft_model(spec)
    return spec


def check_draft_model(spec: BuildSpec) -> None:
    """A draft model must speak the target's tokens: same vocabulary size and special ids in
    config.json, and the same tokenizer.json bytes when both have one."""
    draft = spec.speculative.draft_hf_model_dir
    if spec.speculative.mode != "draft_target" or draft is None:
        return
    where = f"{spec.source}: key 'speculative.draft_hf_model_dir'"
    try:
        target_cfg, draft_cfg = read_config(spec.hf_model_dir), read_config(draft)
    except BuildError as err:
        raise SpecError(f"{where}: {err}") from err
    for name in ("vocab_size", "bos_token_id", "eos_token_ids"):
        a, b = getattr(target_cfg, name), getattr(draft_cfg, name)
        if a != b:
            raise SpecError(
                f"{where}: the draft's {name} {b!r} differs from the target's {a!r}; "
                "a draft model must share the target's tokenizer"
            )
    tok_t, tok_d = spec.hf_model_dir / "tokenizer.json", draft / "tokenizer.json"
    if tok_t.is_file() and tok_d.is_file() and tok_t.read_bytes() != tok_d.read_bytes():
        raise SpecError(
            f"{where}: the draft's tokenizer.json differs from the target's; "
            "a draft model must share the target's tokenizer"
        )
