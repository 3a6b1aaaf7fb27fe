"""Checks a model repository, whether ``engine-build repo`` wrote it or an operator edited it.

``repo`` runs these same checks on what it is about to publish, so a repository that passes
``verify`` is byte-for-byte the kind ``repo`` produces. Problems are collected, not raised one at
a time, so an operator fixing hand edits sees all of them in one run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from appliance.text.tokenizer import ModelText, TokenizerLoadError
from appliance.textfile import TextFileError, read_bytes
from engine_build import commands, pbtxt, runtime
from engine_build.checkpoint import read_json
from engine_build.errors import BuildError
from engine_build.speculative import (
    DECODING_MODES,
    DRAFT_MODEL_NAME,
    LOOKAHEAD_PARAMETERS,
    lookahead_draft_len,
    parse_choices,
)
from engine_build.tokenizer_info import check_tokenizer_info

# Larger is no config.pbtxt (a built one is a few KiB) and no fingerprint (a digest): a wrong
# path is refused after reading this much.
MAX_PBTXT_BYTES = 1 << 20
MAX_FINGERPRINT_BYTES = 64 << 10
_HEX = re.compile(r"^[0-9a-f]{16,128}$")
_BOOL = ("true", "false")
_INT = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)


def _resolve(model_dir: Path, value: str) -> Path:
    p = Path(value)
    return p if p.is_absolute() else model_dir / p


def _int_param(params: dict[str, str], key: str, problems: list[str]) -> int | None:
    raw = params.get(key)
    if raw is None:
        return None
    # ASCII digits only: Python's int() also reads "1_000" and other scripts' digits, which the
    # backend's std::stoi reads as 1 or refuses (then it uses its default).
    if not _INT.fullmatch(raw):
        problems.append(f"parameter {key} = {raw!r} is not an integer")
        return None
    return int(raw)


def engine_limits(engine_cfg: dict[str, Any]) -> dict[str, Any]:
    """The build-time limits of a TensorRT-LLM engine's config.json (``build_config`` section)."""
    build = engine_cfg.get("build_config")
    if not isinstance(build, dict):
        raise BuildError(
            "engine config.json has no build_config section; not a trtllm-build engine"
        )
    raw_plugin = build.get("plugin_config")
    plugin: dict[str, Any] = raw_plugin if isinstance(raw_plugin, dict) else {}
    pretrained = engine_cfg.get("pretrained_config")
    mapping = pretrained.get("mapping", {}) if isinstance(pretrained, dict) else {}
    eagle_layers = pretrained.get("num_eagle_layers") if isinstance(pretrained, dict) else None
    return {
        "max_draft_len": build.get("max_draft_len") or 0,
        "num_eagle_layers": eagle_layers if isinstance(eagle_layers, int) else 0,
        "max_batch_size": build.get("max_batch_size"),
        "max_input_len": build.get("max_input_len"),
        "max_seq_len": build.get("max_seq_len"),
        "use_paged_context_fmha": plugin.get("use_paged_context_fmha"),
        "world_size": mapping.get("world_size", 1) if isinstance(mapping, dict) else 1,
        "version": engine_cfg.get("version"),
    }


def cross_check_engine(
    cfg: mc.ModelConfig, params: dict[str, str], limits: dict[str, Any]
) -> list[str]:
    """Mismatches between config.pbtxt and what the engine was built for."""
    problems: list[str] = []
    if limits["max_batch_size"] != cfg.max_batch_size:
        problems.append(
            f"max_batch_size {cfg.max_batch_size} != engine max_batch_size "
            f"{limits['max_batch_size']}"
        )
    value = _int_param(params, "max_input_len", problems)
    if value is not None and value != limits["max_input_len"]:
        problems.append(
            f"parameter max_input_len = {value} != engine max_input_len {limits['max_input_len']}"
        )
    # trtllm-build adds the draft length (and EAGLE's layers) to the engine's max_seq_len.
    draft = limits["max_draft_len"] if isinstance(limits["max_draft_len"], int) else 0
    extra = draft + limits["num_eagle_layers"]
    value = _int_param(params, "max_seq_len", problems)
    if value is not None and value + extra != limits["max_seq_len"]:
        problems.append(
            f"parameter max_seq_len = {value} (+ {extra} for speculation) != engine max_seq_len "
            f"{limits['max_seq_len']}"
        )
    declared = _int_param(params, "max_draft_len", problems)
    if (declared or 0) != draft:
        problems.append(
            f"parameter max_draft_len = {declared or 0} != engine max_draft_len {draft} "
            "(rewrite the repository with `engine-build repo` from the spec that built it)"
        )
    window = _int_param(params, "max_attention_window_size", problems)
    engine_seq = limits["max_seq_len"]
    if window is not None and isinstance(engine_seq, int) and window > engine_seq:
        problems.append(
            f"parameter max_attention_window_size = {window} > engine max_seq_len {engine_seq}"
        )
    elif window is not None and isinstance(engine_seq, int) and window < engine_seq:
        # A shorter window turns the KV cache cyclic for the last tokens of a long request
        # (with speculation: the draft tokens written past the request's last token).
        problems.append(
            f"parameter max_attention_window_size = {window} < engine max_seq_len {engine_seq}: "
            "attention would slide over the end of a long sequence (rewrite the repository "
            "with `engine-build repo`)"
        )
    if (
        params.get("enable_kv_cache_reuse") == "true"
        and limits["use_paged_context_fmha"] is not True
    ):
        problems.append(
            "enable_kv_cache_reuse = true but the engine was built without paged context FMHA "
            "(rebuild with kv_cache.enable_reuse = true, or set it false)"
        )
    ids = [i for i in params.get("gpu_device_ids", "").split(",") if i.strip()]
    if ids and len(ids) != limits["world_size"]:
        problems.append(
            f"gpu_device_ids lists {len(ids)} GPUs but the engine has {limits['world_size']} ranks"
        )
    return problems


def _type_name(value: int) -> str:
    """TYPE_INT32 for its number; the number itself when no DataType has it."""
    try:
        return str(mc.DataType.Name(value))
    except ValueError:
        return f"data_type {value}"


def _instance_problems(cfg: mc.ModelConfig) -> list[str]:
    """One model instance: each is an executor that loads the whole engine and takes its own
    KV pool. Triton starts one instance per GPU when instance_group is absent or a GPU group
    lists no GPUs; a count of 0 means 1."""
    if not cfg.instance_group:
        return ["instance_group missing: Triton then starts one instance per GPU"]
    per_gpu = (mc.ModelInstanceGroup.KIND_GPU, mc.ModelInstanceGroup.KIND_AUTO)
    if any(g.kind in per_gpu and not g.gpus for g in cfg.instance_group):
        return [
            "instance_group of kind KIND_GPU/KIND_AUTO without gpus starts one instance per "
            "GPU; write one group {count: 1, kind: KIND_CPU} (the engine's gpu_device_ids "
            "parameter places it)"
        ]
    total = sum((g.count or 1) * max(1, len(g.gpus)) for g in cfg.instance_group)
    if total != 1:
        return [
            f"instance_group declares {total} model instances; the appliance runs one "
            "(each loads the whole engine and takes its own KV pool)"
        ]
    return []


def check_config(cfg: mc.ModelConfig, name: str = pbtxt.MODEL_NAME) -> list[str]:
    """Structural and latency checks that need nothing but the parsed config."""
    problems: list[str] = []
    if cfg.name and cfg.name != name:
        problems.append(f"name is {cfg.name!r}, expected {name!r}")
    if cfg.backend != pbtxt.BACKEND:
        problems.append(f"backend is {cfg.backend!r}, expected {pbtxt.BACKEND!r}")
    if cfg.max_batch_size != 1:
        problems.append(f"max_batch_size is {cfg.max_batch_size}, the appliance serves batch 1")
    if not cfg.model_transaction_policy.decoupled:
        problems.append("model_transaction_policy.decoupled is not true: streaming needs it")
    if cfg.dynamic_batching.max_queue_delay_microseconds != 0:
        problems.append(
            "dynamic_batching.max_queue_delay_microseconds is "
            f"{cfg.dynamic_batching.max_queue_delay_microseconds}, must be 0"
        )
    problems += _instance_problems(cfg)
    inputs = {t.name for t in cfg.input}
    outputs = {t.name for t in cfg.output}
    for name in pbtxt.REQUIRED_INPUTS:
        if name not in inputs:
            problems.append(f"input {name} missing")
    for name in pbtxt.REQUIRED_OUTPUTS:
        if name not in outputs:
            problems.append(f"output {name} missing")
    for kind, tensors in (("input", cfg.input), ("output", cfg.output)):
        for t in tensors:
            expected = pbtxt.TENSOR_SHAPES.get((kind, t.name))
            if expected is None:
                continue
            dtype, dims = expected
            if t.data_type != dtype:
                problems.append(
                    f"{kind} {t.name} is {_type_name(t.data_type)}, expected "
                    f"{_type_name(dtype)} (the type the gateway sends and reads)"
                )
            if tuple(t.dims) != dims:
                problems.append(f"{kind} {t.name} has dims {list(t.dims)}, expected {list(dims)}")
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    for key in pbtxt.BACKEND_REQUIRED_PARAMETERS:
        if key not in params:
            problems.append(
                f"parameter {key} missing: the tensorrtllm backend reads it without a default "
                "and fails the model load (write it, empty when unused)"
            )
    model_type = params.get("gpt_model_type")
    if model_type is not None and model_type not in pbtxt.GPT_MODEL_TYPES:
        problems.append(
            f"parameter gpt_model_type {model_type!r} is not one of "
            f"{', '.join(pbtxt.GPT_MODEL_TYPES)}"
        )
    if params.get("cuda_graph_mode") != "true":
        problems.append(
            f"parameter cuda_graph_mode is {params.get('cuda_graph_mode')!r}, not 'true'"
        )
    reuse = params.get("enable_kv_cache_reuse")
    if reuse not in _BOOL:
        # The backend turns reuse ON when this is unset; say it explicitly.
        problems.append(f"parameter enable_kv_cache_reuse must be 'true' or 'false', got {reuse!r}")
    frac = params.get("kv_cache_free_gpu_mem_fraction")
    try:
        if frac is None or not 0.0 < float(frac) <= 1.0:
            problems.append(f"parameter kv_cache_free_gpu_mem_fraction {frac!r} not in (0, 1]")
    except ValueError:
        problems.append(f"parameter kv_cache_free_gpu_mem_fraction {frac!r} is not a number")
    for key, (low, high) in pbtxt.PARAMETER_RANGES.items():
        value = _int_param(params, key, problems)
        if value is None or not low <= value <= high:
            problems.append(
                f"parameter {key} must be an integer between {low} and {high}, "
                f"got {params.get(key)!r}"
            )
    ids = params.get("gpu_device_ids", "")
    if not re.fullmatch(r"\d+(,\d+)*", ids, re.ASCII):
        problems.append(f"parameter gpu_device_ids {ids!r} is not a comma-separated id list")
    if params.get("exclude_input_in_output") not in _BOOL:
        problems.append("parameter exclude_input_in_output must be 'true' or 'false'")
    problems += _check_guided_decoding(cfg, params)
    problems += check_speculative(params)
    return problems


def check_speculative(params: dict[str, str]) -> list[str]:
    """The speculative parameters, as the backend reads them (model_instance_state.cc)."""
    problems: list[str] = []
    fast = params.get("speculative_decoding_fast_logits")
    if fast is not None and fast not in _BOOL:
        problems.append(f"parameter speculative_decoding_fast_logits {fast!r} is not true/false")
    elif fast == "true":
        problems.append(
            "parameter speculative_decoding_fast_logits is true: the backend keeps it only in "
            "orchestrator mode without spawned processes, which appliance-triton.service does "
            "not run; set it false"
        )
    mode = params.get("decoding_mode", "")
    if mode and mode not in DECODING_MODES:
        # The backend logs a warning and silently falls back to top_k_top_p.
        problems.append(
            f"parameter decoding_mode {mode!r} is not one of {', '.join(DECODING_MODES)}"
        )
    draft = _int_param(params, "max_draft_len", problems)
    if mode == "lookahead":
        sizes = [_int_param(params, key, problems) for key in LOOKAHEAD_PARAMETERS]
        if any(v is None or v < 0 for v in sizes):
            # A missing one fails the model load.
            problems.append(
                "decoding_mode lookahead needs parameters "
                + ", ".join(LOOKAHEAD_PARAMETERS)
                + " as non-negative integers"
            )
        elif draft is not None:
            w, n, g = (v or 0 for v in sizes)
            if lookahead_draft_len(w, n, g) != draft:
                problems.append(
                    f"lookahead ({w}, {n}, {g}) needs max_draft_len {lookahead_draft_len(w, n, g)}, "
                    f"the engine has {draft}"
                )
    for tree_mode in ("medusa", "eagle"):
        key = f"{tree_mode}_choices"
        raw = params.get(key, "")
        if mode == tree_mode and not raw:
            problems.append(
                f"decoding_mode {tree_mode} without parameter {key}: the backend would use its "
                "default 63-path tree, which need not fit the engine's max_draft_len"
            )
        if raw:
            try:
                paths = parse_choices(raw)
            except ValueError as err:
                problems.append(f"parameter {key} {raw!r} does not parse as {{i, j}} groups: {err}")
                continue
            if draft is not None and len(paths) > draft:
                problems.append(f"parameter {key} has {len(paths)} paths > max_draft_len {draft}")
    return problems


def guided_decoding_on(params: dict[str, str]) -> bool:
    """As the backend decides: both guided_decoding_backend and xgrammar_tokenizer_info_path set."""
    return all(
        params.get(key) and not params[key].startswith("${")
        for key in ("guided_decoding_backend", "xgrammar_tokenizer_info_path")
    )


def _check_guided_decoding(cfg: mc.ModelConfig, params: dict[str, str]) -> list[str]:
    backend = params.get("guided_decoding_backend", "")
    info = params.get("xgrammar_tokenizer_info_path", "")
    if not guided_decoding_on(params):
        if bool(backend) != bool(info):
            # The backend silently serves without guided decoding then.
            return [
                "parameters guided_decoding_backend and xgrammar_tokenizer_info_path must be set "
                "together (guided decoding on) or both empty (off); one alone turns it off"
            ]
        return []
    problems: list[str] = []
    if backend != pbtxt.XGRAMMAR:
        problems.append(
            f"parameter guided_decoding_backend is {backend!r}: the backend takes "
            f"{pbtxt.XGRAMMAR!r} (or empty, to turn guided decoding off)"
        )
    if not Path(info).is_absolute():
        problems.append(
            f"parameter xgrammar_tokenizer_info_path {info!r} is relative: the backend opens it "
            "from tritonserver's working directory; write an absolute path"
        )
    inputs = {t.name: t for t in cfg.input}
    for name in pbtxt.GUIDED_DECODING_INPUTS:
        declared = inputs.get(name)
        if declared is None:
            problems.append(
                f"input {name} missing: guided decoding is on, and a request names its guide "
                "with it"
            )
        elif declared.data_type != mc.TYPE_STRING:
            problems.append(f"input {name} must be TYPE_STRING")
    return problems


def _check_draft_model(repo: Path, name: str, target: dict[str, str]) -> list[str]:
    """The draft model of draft-target speculation: a tensorrtllm model on the same GPUs."""
    if name != DRAFT_MODEL_NAME:
        return [f"parameter speculative_draft_model is {name!r}, expected {DRAFT_MODEL_NAME!r}"]
    path = repo / name / "config.pbtxt"
    try:
        cfg = pbtxt.parse(read_bytes(path, MAX_PBTXT_BYTES).decode("utf-8"))
    except TextFileError as err:
        return [f"draft model: cannot read {path}: {err}"]
    except UnicodeDecodeError as err:
        return [f"draft model: {path} is not UTF-8 text: {err.reason}"]
    except text_format.ParseError as err:
        return [f"draft model: {path} does not parse as a ModelConfig: {err}"]
    problems = [f"draft model: {p}" for p in check_config(cfg, name)]
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    if params.get("gpu_device_ids") != target.get("gpu_device_ids"):
        problems.append("draft model: gpu_device_ids differ from the target's")
    cap = _int_param(params, "max_tokens_in_paged_kv_cache", problems)
    if cap is None or cap < 1:
        problems.append(
            "draft model: parameter max_tokens_in_paged_kv_cache must cap its KV pool, else it "
            "takes kv_cache_free_gpu_mem_fraction of what the target left"
        )
    engine = params.get("gpt_model_path", "")
    if not engine:
        problems.append("draft model: parameter gpt_model_path missing")
    elif not Path(engine).is_absolute():
        problems.append(
            f"draft model: parameter gpt_model_path {engine!r} is relative: the tensorrtllm "
            "backend opens it from tritonserver's working directory; write an absolute path"
        )
    else:
        try:
            limits = engine_limits(
                read_json(Path(engine) / "config.json", "draft engine config.json")
            )
        except BuildError as err:
            problems.append(f"draft model: {err}")
        else:
            problems += [f"draft model: {p}" for p in cross_check_engine(cfg, params, limits)]
    if not (repo / name / "1").is_dir():
        problems.append(f"draft model: version directory {repo / name / '1'} missing")
    return problems


def _tokenizer_problems(directory: Path) -> list[str]:
    """What stops a gateway from loading the repository's tokenizer, loaded as a gateway loads
    it (tokenizer.json, tokenizer_config.json, config.json, the chat template)."""
    try:
        ModelText.load(directory)
    except (TokenizerLoadError, ValueError) as err:
        return [f"a gateway cannot load the tokenizer: {err}"]
    return []


def verify_repository(
    repo: Path, triton_root: Path | None = None, published_as: Path | None = None
) -> list[str]:
    """Every problem found in ``repo``; an empty list means it can be served.

    With ``triton_root`` (the Triton root filesystem that will serve it), the engine's
    TensorRT-LLM version must equal the root's. ``published_as`` is where ``repo`` (a staging
    directory) will be renamed to: absolute paths into it are checked in ``repo``.
    """
    model_dir = repo / pbtxt.MODEL_NAME
    config_path = model_dir / "config.pbtxt"
    try:
        text = read_bytes(config_path, MAX_PBTXT_BYTES).decode("utf-8")
    except TextFileError as err:
        return [f"cannot read {config_path}: {err}"]
    except UnicodeDecodeError as err:
        return [f"{config_path} is not UTF-8 text: {err.reason}"]
    problems: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if "${" in line:
            problems.append(
                f"config.pbtxt line {lineno} has an unfilled placeholder: {line.strip()}"
            )
    try:
        cfg = pbtxt.parse(text)
    except text_format.ParseError as err:
        problems.append(f"config.pbtxt does not parse as a ModelConfig: {err}")
        return problems
    problems += check_config(cfg)
    params = {k: v.string_value for k, v in cfg.parameters.items()}

    if not (model_dir / "1").is_dir():
        problems.append(f"version directory {model_dir / '1'} missing")
    if not (model_dir / "tokenizer" / "tokenizer.json").is_file():
        problems.append(f"{model_dir / 'tokenizer' / 'tokenizer.json'} missing")
    else:
        problems += _tokenizer_problems(model_dir / "tokenizer")
    fp_path = model_dir / "engine_fingerprint"
    try:
        fp = read_bytes(fp_path, MAX_FINGERPRINT_BYTES).decode("utf-8").strip()
        if not _HEX.match(fp):
            problems.append(f"{fp_path} is not one line of lowercase hex")
    except UnicodeDecodeError:
        problems.append(f"{fp_path} is not one line of lowercase hex")
    except TextFileError as err:
        problems.append(f"{fp_path}: {err}")

    if guided_decoding_on(params) and Path(params["xgrammar_tokenizer_info_path"]).is_absolute():
        info = Path(params["xgrammar_tokenizer_info_path"])
        if published_as is not None and info.is_relative_to(published_as):
            info = repo / info.relative_to(published_as)
        if info.is_file():
            problems += check_tokenizer_info(info)
        else:
            problems.append(
                f"tokenizer info file {info} missing: guided decoding is on "
                "(xgrammar_tokenizer_info_path); rewrite the repository with `engine-build repo`, "
                "or empty guided_decoding_backend and xgrammar_tokenizer_info_path"
            )

    engine = params.get("gpt_model_path") or params.get("engine_dir")
    gpt_path, engine_param = params.get("gpt_model_path"), params.get("engine_dir")
    if gpt_path and engine_param and gpt_path != engine_param:
        problems.append("parameters gpt_model_path and engine_dir disagree")
    hf = params.get("hf_model_dir")
    if not engine and not hf:
        problems.append(
            "neither gpt_model_path/engine_dir nor hf_model_dir is set: nothing to serve"
        )
    if engine and not Path(engine).is_absolute():
        key = "gpt_model_path" if gpt_path else "engine_dir"
        problems.append(
            f"parameter {key} {engine!r} is relative: the tensorrtllm backend opens it from "
            "tritonserver's working directory; write an absolute path"
        )
    elif engine:
        engine_dir = Path(engine)
        try:
            limits = engine_limits(read_json(engine_dir / "config.json", "engine config.json"))
        except BuildError as err:
            problems.append(str(err))
        else:
            problems += cross_check_engine(cfg, params, limits)
            ranks = limits["world_size"]
            if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
                problems.append(f"engine config.json mapping.world_size {ranks!r} is not a count")
                ranks = 1
            if ranks > 1:
                problems.append(f"engine has {runtime.multi_gpu_refusal(ranks)}")
            supported = ".".join(str(n) for n in commands.TRTLLM_SUPPORTED)
            problems += runtime.version_problems(limits["version"], triton_root, supported)
            for rank in range(ranks):
                if not (engine_dir / f"rank{rank}.engine").is_file():
                    problems.append(f"engine file {engine_dir / f'rank{rank}.engine'} missing")
    draft_name = params.get("speculative_draft_model")
    if draft_name:
        problems += _check_draft_model(repo, draft_name, params)
    if hf:
        hf_dir = _resolve(model_dir, hf)
        try:
            hf_cfg = read_json(hf_dir / "config.json", "hf_model_dir config.json")
        except BuildError as err:
            problems.append(str(err))
        else:
            seq = _int_param(params, "max_seq_len", problems)
            limit = hf_cfg.get("max_position_embeddings")
            if seq is not None and isinstance(limit, int) and seq > limit:
                problems.append(
                    f"parameter max_seq_len = {seq} > max_position_embeddings {limit} of "
                    "hf_model_dir"
                )
    return problems
