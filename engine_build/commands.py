"""The exact TensorRT-LLM 1.2 command lines for a spec.

Argument names and choices were read from NVIDIA/TensorRT-LLM sources (no code copied):
``tensorrt_llm/commands/build.py`` @ 65f1d1536e18aea3380e6e270e00895a709333eb (trtllm-build's
own arguments), ``tensorrt_llm/plugin/plugin.py`` @ c20322ffd3dc0740ca530c9fad989b22e64f6e06
(``cli_plugin_args`` and the pydantic ``PluginConfig`` literals: the plugin/feature flags) and
``examples/quantization/quantize.py`` @ 059c97c10c12e948e91676c8db3c9f137b0a2389. The same lists
are recorded in tests/engine_build/data/trtllm_1_2_cli.json and the tests parse every argv built
here against them.

Every plugin/feature flag that applies to a dense decoder is passed explicitly, because their
defaults moved between releases (e.g. ``tokens_per_block`` 128 -> 32, ``use_paged_context_fmha``
off -> on); an engine must not change behaviour when the TensorRT-LLM patch release does.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from engine_build.spec import BuildSpec
from engine_build.speculative import BUILD_MODE

# The pinned line. 1.3 removed trtllm-build and the tensorrtllm Triton backend.
TRTLLM_SUPPORTED = (1, 2)

# Prints ``TRTLLM_VERSION=`` with an empty value when the package is absent, so "missing" is
# told apart from "the interpreter itself failed".
VERSION_PROBE = (
    "import importlib.metadata as m; "
    "d = {(x.metadata['Name'] or '').lower().replace('-', '_'): x.version "
    "for x in m.distributions()}; "
    "print('TRTLLM_VERSION=' + d.get('tensorrt_llm', ''))"
)


def _python(spec: BuildSpec) -> list[str]:
    t = spec.trtllm
    if t.venv is not None:
        return [str(t.venv / "bin" / "python")]
    return [*t.container, "python3"]


def _tool(spec: BuildSpec, name: str) -> list[str]:
    t = spec.trtllm
    if t.venv is not None:
        return [str(t.venv / "bin" / name)]
    return [*t.container, name]


def version_command(spec: BuildSpec) -> list[str]:
    """Ask the installation for its version without importing tensorrt_llm (that needs a GPU
    and takes seconds); package metadata is enough and works the same in a container."""
    return [*_python(spec), "-c", VERSION_PROBE]


def _enable(flag: bool) -> str:
    return "enable" if flag else "disable"


def quantize_args(spec: BuildSpec, output_dir: Path) -> list[str]:
    """Arguments of quantize.py that turn the HF checkpoint into a TensorRT-LLM checkpoint.

    ``--qformat full_prec`` exports an unquantized checkpoint, so one stage covers bf16 too; the
    weight-only formats (``int8_wo``, ``int4_wo``) export ``dtype`` weights marked W8A16/W4A16
    that trtllm-build quantizes, so they calibrate only for a quantized KV cache. AWQ formats pass
    their group size (``--awq_block_size``).
    """
    fmt = spec.weight_format
    args = [
        "--model_dir",
        str(spec.hf_model_dir),
        "--dtype",
        spec.dtype,
        "--qformat",
        fmt.qformat,
    ]
    if spec.kv_cache_dtype != "auto":
        args += ["--kv_cache_dtype", spec.kv_cache_dtype]
    if spec.is_awq:
        args += ["--awq_block_size", str(spec.awq_block_size)]
    if fmt.calibrated or spec.kv_cache_dtype != "auto":
        args += ["--calib_size", str(spec.effective_calib_size)]
        args += ["--batch_size", str(spec.calib_batch_size)]
        args += ["--calib_max_seq_length", str(spec.calib_max_seq_length)]
        if spec.calib_dataset is not None:
            args += ["--calib_dataset", spec.calib_dataset]
    args += ["--tp_size", str(spec.tp_size), "--output_dir", str(output_dir)]
    return args


def quantize_command(spec: BuildSpec, output_dir: Path) -> list[str]:
    return [*_python(spec), spec.trtllm.quantize_script, *quantize_args(spec, output_dir)]


def draft_quantize_args(spec: BuildSpec, output_dir: Path) -> list[str]:
    """quantize.py for the draft model of draft-target speculation: the target's precision."""
    draft = spec.speculative.draft_hf_model_dir
    assert draft is not None
    args = quantize_args(spec, output_dir)
    args[args.index("--model_dir") + 1] = str(draft)
    return args


def convert_script(spec: BuildSpec, mode: str) -> str:
    """examples/<mode>/convert_checkpoint.py of the same source tree as quantize_script."""
    examples = Path(spec.trtllm.quantize_script).parent.parent
    return str(examples / mode / "convert_checkpoint.py")


def convert_args(spec: BuildSpec, output_dir: Path) -> list[str]:
    """The Medusa or EAGLE checkpoint: the base model with its heads or drafter, in ``dtype``."""
    s = spec.speculative
    args = ["--model_dir", str(spec.hf_model_dir), "--dtype", spec.dtype]
    if s.mode == "medusa":
        args += [
            "--medusa_model_dir",
            str(s.medusa_model_dir),
            "--num_medusa_heads",
            str(s.num_medusa_heads),
            "--num_medusa_layers",
            str(s.num_medusa_layers),
            "--max_medusa_token_len",
            str(s.draft_len),
        ]
    else:
        args += [
            "--eagle_model_dir",
            str(s.eagle_model_dir),
            "--max_draft_len",
            str(s.draft_len),
            "--num_eagle_layers",
            str(s.num_eagle_layers),
            "--max_non_leaves_per_layer",
            str(s.max_non_leaves_per_layer),
        ]
    return [*args, "--tp_size", str(spec.tp_size), "--output_dir", str(output_dir)]


def checkpoint_command(spec: BuildSpec, output_dir: Path) -> list[str]:
    """The target's checkpoint stage: quantize.py, or the mode's convert_checkpoint.py."""
    mode = spec.speculative.mode
    if mode in ("medusa", "eagle"):
        return [*_python(spec), convert_script(spec, mode), *convert_args(spec, output_dir)]
    return quantize_command(spec, output_dir)


def draft_quantize_command(spec: BuildSpec, output_dir: Path) -> list[str]:
    return [*_python(spec), spec.trtllm.quantize_script, *draft_quantize_args(spec, output_dir)]


def speculative_build_args(spec: BuildSpec) -> list[str]:
    """The target engine's speculative flags (none without speculation)."""
    s = spec.speculative
    if not s.on:
        return []
    return [
        "--speculative_decoding_mode",
        BUILD_MODE[s.mode],
        "--max_draft_len",
        str(s.draft_len),
    ]


def draft_build_args(spec: BuildSpec, checkpoint_dir: Path, output_dir: Path) -> list[str]:
    """The draft engine: the target's recipe without speculative flags; it returns its
    generation logits when the target accepts by logits."""
    args = _engine_args(spec, checkpoint_dir, output_dir)
    if spec.speculative.use_draft_logits:
        args.append("--gather_generation_logits")
    return args


def draft_build_command(spec: BuildSpec, checkpoint_dir: Path, output_dir: Path) -> list[str]:
    return [*_tool(spec, "trtllm-build"), *draft_build_args(spec, checkpoint_dir, output_dir)]


def build_args(spec: BuildSpec, checkpoint_dir: Path, output_dir: Path) -> list[str]:
    """The target engine: `_engine_args` and the speculative flags of the spec's mode."""
    return [*_engine_args(spec, checkpoint_dir, output_dir), *speculative_build_args(spec)]


def _engine_args(spec: BuildSpec, checkpoint_dir: Path, output_dir: Path) -> list[str]:
    """trtllm-build arguments: the low-latency batch-1 recipe with every plugin flag explicit.

    Only FP8 weights take the FP8 GEMM plugins; every other format passes ``--gemm_plugin`` in
    ``dtype`` for the layers it leaves unquantized, and trtllm-build turns on the weight-only
    (group-wise) and SmoothQuant plugins itself from the checkpoint's ``quant_algo`` (they have
    no command-line flag in 1.2).
    """
    fp8 = spec.weights_fp8
    low_latency = spec.gemm == "low_latency_gemm_plugin"
    multi_gpu = spec.tp_size > 1
    args = [
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--output_dir",
        str(output_dir),
        "--max_batch_size",
        str(spec.max_batch_size),
        "--max_input_len",
        str(spec.max_input_len),
        "--max_seq_len",
        str(spec.max_seq_len),
        "--max_num_tokens",
        str(spec.max_num_tokens),
        "--max_beam_width",
        "1",
    ]
    if spec.opt_num_tokens is not None:
        args += ["--opt_num_tokens", str(spec.opt_num_tokens)]
    args += [
        "--kv_cache_type",
        "paged",
        "--workers",
        str(spec.tp_size),
        # Plugins
        "--gpt_attention_plugin",
        spec.dtype,
        "--gemm_plugin",
        ("disable" if low_latency else "fp8") if fp8 else spec.dtype,
        "--low_latency_gemm_plugin",
        "fp8" if low_latency else "disable",
        # Both fused plugins need --use_fused_mlp enable (always passed below).
        "--gemm_swiglu_plugin",
        "fp8" if spec.gemm_swiglu == "gemm_swiglu_plugin" else "disable",
        "--low_latency_gemm_swiglu_plugin",
        "fp8" if spec.gemm_swiglu == "low_latency_gemm_swiglu_plugin" else "disable",
        "--fp8_rowwise_gemm_plugin",
        "disable",
        "--lora_plugin",
        "disable",
        "--nccl_plugin",
        spec.dtype if multi_gpu else "disable",
        # Features
        "--context_fmha",
        "enable",
        "--remove_input_padding",
        "enable",
        "--use_paged_context_fmha",
        _enable(spec.use_paged_context_fmha),
        "--tokens_per_block",
        str(spec.tokens_per_block),
        "--use_fp8_context_fmha",
        _enable(fp8 and spec.kv_fp8),
        "--multiple_profiles",
        _enable(spec.multiple_profiles),
        "--use_fused_mlp",
        "enable",
        "--reduce_fusion",
        _enable(multi_gpu),
        "--user_buffer",
        "disable",
        "--norm_quant_fusion",
        "disable",
    ]
    return args


def build_command(spec: BuildSpec, checkpoint_dir: Path, output_dir: Path) -> list[str]:
    return [*_tool(spec, "trtllm-build"), *build_args(spec, checkpoint_dir, output_dir)]


def render(argv: list[str]) -> str:
    """A copy-pasteable shell line."""
    return shlex.join(argv)
