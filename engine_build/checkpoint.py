"""A Hugging Face checkpoint as the build sees it: its shape against the spec, and its fingerprint.

config.json itself is read by engine_build.hf_config (shared with the engine server), which
accepts only dense Llama-family decoders: the planner's parameter count assumes that layout.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine_build.errors import BuildError
from engine_build.hf_config import (
    SUPPORTED_ARCHITECTURES,
    LlamaConfig,
    parse_config,
    read_config,
    read_json,
)
from engine_build.spec import BuildSpec

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelShape",
    "content_fingerprint",
    "fingerprint_tree",
    "read_json",
    "read_shape",
    "read_shape_for",
    "shape_from_config",
]

# The planner's name for the config.json numbers; the reader is engine_build.hf_config.
ModelShape = LlamaConfig
shape_from_config = parse_config
read_shape = read_config


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


def content_fingerprint(root: Path) -> str:
    """Identity of a directory's contents: relative path, size and SHA-256 of every file.

    Unlike `fingerprint_tree` it is the same on every host that holds the same bytes, however
    and whenever they were copied there, so gateways on different hosts share cache entries for
    the same checkpoint. Reading every byte costs about a second per GB; it is computed when a
    repository is written, never per request.
    """
    h = hashlib.sha256()
    try:
        for p in sorted(p for p in root.rglob("*") if p.is_file()):
            with p.open("rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            h.update(f"{p.relative_to(root).as_posix()}\0{p.stat().st_size}\0{digest}\n".encode())
    except OSError as err:
        raise BuildError(f"cannot read {root}: {err.strerror or err}") from err
    return h.hexdigest()


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
