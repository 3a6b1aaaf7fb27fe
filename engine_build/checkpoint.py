"""Reading a Hugging Face checkpoint: its shape (for the planner) and its fingerprint (for skips).

Only dense Llama-family decoders are accepted because the planner's parameter count and the
engine server both assume that layer layout (q/k/v/o + gated MLP, RMSNorm, no biases); any other
architecture is refused here rather than mis-planned later.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_build.errors import BuildError
from engine_build.spec import BuildSpec

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class ModelShape:
    """The config.json numbers the fit arithmetic needs."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool


def _int(cfg: dict[str, Any], key: str, where: Path) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BuildError(f"{where}: '{key}' must be a positive integer, got {value!r}")
    return value


def shape_from_config(cfg: dict[str, Any], where: Path) -> ModelShape:
    """Validate a decoded config.json and extract the shape; ``where`` names it in errors."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise BuildError(f"{where}: no 'architectures' list; is this a Hugging Face checkpoint?")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise BuildError(
            f"{where}: unsupported architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = cfg.get("num_key_value_heads", heads)
    if (
        not isinstance(kv_heads, int)
        or isinstance(kv_heads, bool)
        or kv_heads < 1
        or heads % kv_heads
    ):
        raise BuildError(f"{where}: num_key_value_heads {kv_heads!r} must divide {heads}")
    head_dim = cfg.get("head_dim") or hidden // heads
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        raise BuildError(f"{where}: head_dim must be an integer, got {head_dim!r}")
    return ModelShape(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", where),
        num_hidden_layers=_int(cfg, "num_hidden_layers", where),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_int(cfg, "vocab_size", where),
        max_position_embeddings=_int(cfg, "max_position_embeddings", where),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Load a JSON object or raise a one-line error naming ``what`` it was supposed to be."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise BuildError(f"{what} missing: {path}") from err
    except OSError as err:
        raise BuildError(f"cannot read {what} {path}: {err.strerror or err}") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BuildError(f"{what} {path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise BuildError(f"{what} {path} is not a JSON object")
    return data


def read_shape(hf_model_dir: Path) -> ModelShape:
    """Read ``config.json`` of a checkpoint directory (missing dir and file are distinct errors)."""
    if not hf_model_dir.is_dir():
        raise BuildError(f"checkpoint directory missing or not a directory: {hf_model_dir}")
    return shape_from_config(
        read_json(hf_model_dir / "config.json", "checkpoint config.json"),
        hf_model_dir / "config.json",
    )


def read_shape_for(spec: BuildSpec) -> ModelShape:
    """The checkpoint's shape, refused when the spec asks for what it cannot do."""
    shape = read_shape(spec.hf_model_dir)
    if spec.max_seq_len > shape.max_position_embeddings:
        raise BuildError(
            f"limits.max_seq_len {spec.max_seq_len} > max_position_embeddings "
            f"{shape.max_position_embeddings} of {spec.hf_model_dir}"
        )
    for key in ("num_attention_heads", "intermediate_size"):
        value = getattr(shape, key)
        if value % spec.tp_size:
            # TensorRT-LLM splits attention heads and the MLP evenly across ranks.
            raise BuildError(
                f"parallel.tp_size {spec.tp_size} does not divide {key} {value} of "
                f"{spec.hf_model_dir}"
            )
    return shape


def fingerprint_tree(root: Path) -> str:
    """Cheap identity of a directory: relative path, size and mtime of every file.

    Hashing the contents of 16-140 GB of safetensors on every ``build`` would cost minutes;
    a copied or re-downloaded checkpoint changes size or mtime, which is what must trigger a
    rebuild. config.json is small and decisive, so its bytes are hashed too.
    """
    h = hashlib.sha256()
    try:
        files = sorted(p for p in root.rglob("*") if p.is_file())
        for p in files:
            st = p.stat()
            h.update(f"{p.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        cfg = root / "config.json"
        if cfg.is_file():
            h.update(cfg.read_bytes())
    except OSError as err:
        raise BuildError(f"cannot read {root}: {err.strerror or err}") from err
    return h.hexdigest()
