"""The one reader of a Hugging Face checkpoint's ``config.json``, shared by the planner and the engine.

It lives in ``engine_build`` because this package owns what a checkpoint is (it plans, builds and
lays out repositories from one); it imports neither torch nor anything of the appliance, so the
engine server (``appliance.engine.llama``), ``engine-build`` and the model makers all read the
same numbers with the same checks and the same error type. What a particular consumer cannot
handle (the torch decoder runs only ``LlamaForCausalLM``) is refused by that consumer, not here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_build.errors import BuildError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "Llama3RopeScaling",
    "LlamaConfig",
    "parse_config",
    "read_config",
    "read_json",
]

# Dense Llama-layout decoders (q/k/v/o + gated MLP, RMSNorm, RoPE): the planner's parameter count
# and the engine server's decoder both assume exactly this layer layout.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


class CheckpointError(BuildError):
    """A checkpoint that cannot be planned or served; the message names the file and the fix.

    A ``BuildError`` so ``engine-build`` prints it as its one-line refusal like any other.
    """


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1-style RoPE frequency scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaConfig:
    """The subset of HF's LlamaConfig that determines the computation and the memory plan."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # "default" or the scaling type config.json names; only "llama3" carries rope_scaling.
    rope_type: str = "default"
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    hidden_act: str = "silu"
    has_bias: bool = False


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Load a JSON object or raise a one-line error naming ``what`` it was supposed to be."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise CheckpointError(f"{what} missing: {path}") from err
    except OSError as err:
        raise CheckpointError(f"cannot read {what} {path}: {err.strerror or err}") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{what} {path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path} is not a JSON object")
    return data


def _int(raw: Mapping[str, Any], key: str, where: Path, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise CheckpointError(f"{where}: no {key!r}; add it (see the HF LlamaConfig)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{where}: {key!r} must be a positive integer, got {value!r}")
    return value


def _float(raw: Mapping[str, Any], key: str, where: Path, default: float) -> float:
    """A finite positive JSON number (an integer too large for a float is refused too)."""
    value = raw.get(key)
    if value is None:
        return default
    number = None
    if not isinstance(value, bool) and isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:
            number = None
    if number is None or not math.isfinite(number) or number <= 0:
        raise CheckpointError(f"{where}: {key!r} must be a positive number, got {value!r}")
    return number


def _token_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    return ()


def _rope(raw: Mapping[str, Any], where: Path) -> tuple[float, str, Llama3RopeScaling | None]:
    """rope_theta, the scaling type and llama3 parameters.

    transformers >= 5 nests theta and scaling under ``rope_parameters``; older checkpoints write
    ``rope_theta`` and ``rope_scaling`` at the top level.
    """
    params = raw.get("rope_parameters")
    theta_default = 10000.0
    if isinstance(params, Mapping):
        theta_default = _float(params, "rope_theta", where, theta_default)
    theta = _float(raw, "rope_theta", where, theta_default)
    scaling = raw.get("rope_scaling")
    if scaling is None:
        scaling = params
    if scaling is None:
        return theta, "default", None
    if not isinstance(scaling, Mapping):
        raise CheckpointError(f"{where}: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if kind != "llama3":
        return theta, str(kind), None
    names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [name for name in names if scaling.get(name) is None]
    if missing:
        raise CheckpointError(
            f"{where}: llama3 rope_scaling needs numeric factor, low_freq_factor, "
            f"high_freq_factor and original_max_position_embeddings; missing {', '.join(missing)}"
        )
    llama3 = Llama3RopeScaling(
        factor=_float(scaling, "factor", where, 0.0),
        low_freq_factor=_float(scaling, "low_freq_factor", where, 0.0),
        high_freq_factor=_float(scaling, "high_freq_factor", where, 0.0),
        original_max_position_embeddings=_int(scaling, "original_max_position_embeddings", where),
    )
    if llama3.high_freq_factor <= llama3.low_freq_factor:
        # The frequencies between the two wavelengths are blended by 1 / (high - low).
        raise CheckpointError(
            f"{where}: llama3 rope_scaling high_freq_factor {llama3.high_freq_factor:g} must "
            f"exceed low_freq_factor {llama3.low_freq_factor:g}"
        )
    return theta, kind, llama3


def parse_config(raw: Mapping[str, Any], where: Path) -> LlamaConfig:
    """Validate a decoded config.json; ``where`` names it in errors."""
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise CheckpointError(
            f"{where}: no 'architectures' list; is this a Hugging Face checkpoint?"
        )
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{where}: unsupported architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = _int(raw, "hidden_size", where)
    heads = _int(raw, "num_attention_heads", where)
    kv_heads = raw.get("num_key_value_heads", heads)
    if (
        not isinstance(kv_heads, int)
        or isinstance(kv_heads, bool)
        or kv_heads < 1
        or heads % kv_heads
    ):
        raise CheckpointError(f"{where}: num_key_value_heads {kv_heads!r} must divide {heads}")
    if raw.get("head_dim") is not None:
        head_dim = _int(raw, "head_dim", where)
    elif hidden % heads:
        raise CheckpointError(
            f"{where}: hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) "
            "and there is no head_dim; add head_dim"
        )
    else:
        head_dim = hidden // heads
    if head_dim % 2:
        raise CheckpointError(f"{where}: head_dim must be even for RoPE, got {head_dim}")
    theta, rope_type, llama3 = _rope(raw, where)
    bos = _token_ids(raw.get("bos_token_id"))
    return LlamaConfig(
        vocab_size=_int(raw, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", where),
        num_hidden_layers=_int(raw, "num_hidden_layers", where),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=_int(raw, "max_position_embeddings", where),
        rms_norm_eps=_float(raw, "rms_norm_eps", where, 1e-6),
        rope_theta=theta,
        rope_type=rope_type,
        rope_scaling=llama3,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
        architecture=arch,
        hidden_act=str(raw.get("hidden_act", "silu")),
        has_bias=bool(raw.get("attention_bias") or raw.get("mlp_bias")),
    )


def read_config(model_dir: Path) -> LlamaConfig:
    """Read ``model_dir/config.json`` (a missing directory and a missing file are distinct errors)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(
            f"checkpoint directory missing or not a directory: {model_dir} (it must be a "
            "Hugging Face checkpoint directory with config.json and *.safetensors)"
        )
    path = model_dir / "config.json"
    return parse_config(read_json(path, "checkpoint config.json"), path)
