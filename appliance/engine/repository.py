"""Reads a Triton-style model repository for the engine server (layout: docs/MODEL_REPOSITORY.md)."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

HF_MODEL_DIR = "hf_model_dir"


class RepositoryError(ValueError):
    """The repository cannot be served; the message names the file and what to change."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    directory: Path
    config: mc.ModelConfig
    hf_model_dir: Path

    @property
    def decoupled(self) -> bool:
        return bool(self.config.model_transaction_policy.decoupled)

    def parameter(self, key: str, default: str) -> str:
        if key in self.config.parameters:
            value: str = self.config.parameters[key].string_value
            return value if value and not value.startswith("${") else default
        return default


def _load_entry(directory: Path) -> ModelEntry:
    path = directory / "config.pbtxt"
    try:
        config = text_format.Parse(path.read_text(), mc.ModelConfig())
    except OSError as exc:
        raise RepositoryError(f"{path}: cannot read: {exc.strerror}") from exc
    except text_format.ParseError as exc:
        raise RepositoryError(f"{path}: not a valid ModelConfig: {exc}") from exc
    name = config.name or directory.name
    if config.name and config.name != directory.name:
        raise RepositoryError(
            f"{path}: name '{config.name}' differs from its directory '{directory.name}'"
        )
    if config.max_batch_size > 1:
        raise RepositoryError(
            f"{path}: max_batch_size {config.max_batch_size}: the engine server runs a single "
            "stream; set max_batch_size: 1"
        )
    if HF_MODEL_DIR not in config.parameters or not config.parameters[HF_MODEL_DIR].string_value:
        raise RepositoryError(
            f"{path}: no '{HF_MODEL_DIR}' parameter: the engine server runs a Hugging Face "
            "checkpoint, not a TensorRT engine (see docs/MODEL_REPOSITORY.md)"
        )
    hf_dir = Path(config.parameters[HF_MODEL_DIR].string_value)
    if not hf_dir.is_absolute():
        hf_dir = directory / hf_dir
    config.name = name
    return ModelEntry(name=name, directory=directory, config=config, hf_model_dir=hf_dir.resolve())


def read_repository(root: Path) -> dict[str, ModelEntry]:
    """Every model directory with a config.pbtxt; at least one is required."""
    if not root.is_dir():
        raise RepositoryError(f"{root}: model repository directory not found")
    entries = {}
    for directory in sorted(p for p in root.iterdir() if (p / "config.pbtxt").is_file()):
        entry = _load_entry(directory)
        entries[entry.name] = entry
    if not entries:
        raise RepositoryError(f"{root}: no model directory with a config.pbtxt")
    return entries


def lock_repository(root: Path) -> int:
    """Take the repository for this process; returns the descriptor that holds the lock.

    An exclusive flock on the repository directory itself (opened read-only, so a read-only
    model store works): a second engine server on the same repository is refused at start
    instead of doubling the memory and racing the first. The kernel drops the lock when the
    process exits, however it exits.
    """
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise RepositoryError(f"{root}: cannot open the model repository: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RepositoryError(
            f"{root}: another engine server is already serving this repository; stop it first "
            "(or give this one its own repository)"
        ) from None
    return fd
