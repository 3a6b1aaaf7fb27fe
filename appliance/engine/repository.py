"""Reads a Triton-style model repository for the engine server (layout: docs/MODEL_REPOSITORY.md)."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from google.protobuf import text_format

from appliance.textfile import TextFileError, read_text
from engine_build.kv_blocks import DEFAULT_TOKENS_PER_BLOCK, TOKENS_PER_BLOCK_PARAMETER

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2 as mc

HF_MODEL_DIR = "hf_model_dir"
# Optional: an AWQ checkpoint of the hf_model_dir model whose weights the engine serves.
AWQ_CHECKPOINT = "awq_checkpoint"
FINGERPRINT_FILE = "engine_fingerprint"
# Larger is no config.pbtxt (engine_build writes a few KiB) and no fingerprint (a digest).
MAX_CONFIG_BYTES = 1 << 20
MAX_FINGERPRINT_BYTES = 64 << 10
DEFAULT_KV_CACHE_FREE_MEM_FRACTION = 0.9


class RepositoryError(ValueError):
    """The repository cannot be served; the message names the file and what to change."""


@dataclass(frozen=True)
class KvCacheParams:
    """The KV-cache parameters of a `tensorrt_llm` model, with the backend's defaults filled in.

    Names are the config.pbtxt keys: `max_seq_len` (the engine's limit; the engine server sizes its
    one preallocated cache by it), `tokens_per_block`, `enable_kv_cache_reuse` (true when unset, as
    in the TensorRT-LLM backend), `max_tokens_in_paged_kv_cache` (the pool's size in tokens; None
    when unset) and `kv_cache_free_gpu_mem_fraction` (the pool's share of free device memory).
    """

    max_seq_len: int | None
    tokens_per_block: int
    enable_reuse: bool
    max_tokens: int | None
    free_mem_fraction: float


@dataclass(frozen=True)
class GuidedDecodingParams:
    """The guided-decoding parameters of a `tensorrt_llm` model, read as the tensorrtllm backend
    reads them: guided decoding is on only when both `guided_decoding_backend` and
    `xgrammar_tokenizer_info_path` are set (not empty, not a `${...}` placeholder); the backend
    must then be `xgrammar` and the tokenizer info file must exist (a relative path is taken from
    the model's directory). `tokenizer_dir`, which the backend reads too, is not used for it.
    """

    backend: str
    tokenizer_info_path: Path


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

    def _positive_int(self, key: str) -> int | None:
        raw = self.parameter(key, "")
        if not raw:
            return None
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value <= 0:
            raise RepositoryError(
                f"{self.directory / 'config.pbtxt'}: parameter '{key}' must be a positive "
                f"integer, got {raw!r}"
            )
        return value

    @property
    def kv_cache(self) -> KvCacheParams:
        """The KV-cache parameters; a malformed value is a RepositoryError naming the key."""
        path = self.directory / "config.pbtxt"
        tokens_per_block = (
            self._positive_int(TOKENS_PER_BLOCK_PARAMETER) or DEFAULT_TOKENS_PER_BLOCK
        )
        if tokens_per_block & (tokens_per_block - 1) or tokens_per_block < 2:
            raise RepositoryError(
                f"{path}: parameter 'tokens_per_block' must be a power of two > 1 (as "
                f"TensorRT-LLM requires), got {tokens_per_block}"
            )
        reuse = self.parameter("enable_kv_cache_reuse", "true").lower()
        if reuse not in ("true", "false"):
            raise RepositoryError(
                f"{path}: parameter 'enable_kv_cache_reuse' must be 'true' or 'false', got {reuse!r}"
            )
        raw_fraction = self.parameter(
            "kv_cache_free_gpu_mem_fraction", str(DEFAULT_KV_CACHE_FREE_MEM_FRACTION)
        )
        try:
            fraction = float(raw_fraction)
        except ValueError:
            fraction = -1.0
        if not 0.0 < fraction <= 1.0:
            raise RepositoryError(
                f"{path}: parameter 'kv_cache_free_gpu_mem_fraction' must be in (0, 1], got "
                f"{raw_fraction!r}"
            )
        max_seq_len = self._positive_int("max_seq_len")
        if max_seq_len is not None and max_seq_len < 2:
            raise RepositoryError(
                f"{path}: parameter 'max_seq_len' {max_seq_len} leaves no room for a prompt and a "
                "generated token"
            )
        return KvCacheParams(
            max_seq_len=max_seq_len,
            tokens_per_block=tokens_per_block,
            enable_reuse=reuse == "true",
            max_tokens=self._positive_int("max_tokens_in_paged_kv_cache"),
            free_mem_fraction=fraction,
        )

    @property
    def guided_decoding(self) -> GuidedDecodingParams | None:
        """The guided-decoding parameters, None when guided decoding is off; a RepositoryError
        where the backend fails to load the model."""
        backend = self.parameter("guided_decoding_backend", "")
        raw_path = self.parameter("xgrammar_tokenizer_info_path", "")
        if not backend or not raw_path:
            return None
        config = self.directory / "config.pbtxt"
        if backend != "xgrammar":
            raise RepositoryError(
                f"{config}: parameter 'guided_decoding_backend' is {backend!r}; guided decoding "
                "is supported with the 'xgrammar' backend (or leave it empty to turn it off)"
            )
        path = Path(raw_path)
        if not path.is_absolute():
            path = self.directory / path
        if not path.is_file():
            raise RepositoryError(
                f"{config}: parameter 'xgrammar_tokenizer_info_path': Xgrammar's tokenizer info "
                f"path at {path} does not exist"
            )
        return GuidedDecodingParams(backend, path)

    @property
    def awq_checkpoint(self) -> Path | None:
        """The `awq_checkpoint` parameter's directory (a relative path is taken from the model's
        directory); None when unset."""
        raw = self.parameter(AWQ_CHECKPOINT, "")
        if not raw:
            return None
        path = Path(raw)
        return (path if path.is_absolute() else self.directory / path).resolve()

    @property
    def fingerprint(self) -> str:
        """The repository's engine fingerprint (changes whenever generated tokens could); "" if none."""
        try:
            return read_text(self.directory / FINGERPRINT_FILE, MAX_FINGERPRINT_BYTES).strip()
        except TextFileError:
            return ""


def _load_entry(directory: Path) -> ModelEntry:
    # Imported here, not at the top: the runner and the GPU benchmark take `KvCacheParams` from
    # this module on hosts (a lent GPU's image) that have torch but not tritonclient.
    from tritonclient.grpc import model_config_pb2 as mc

    path = directory / "config.pbtxt"
    try:
        config = text_format.Parse(read_text(path, MAX_CONFIG_BYTES), mc.ModelConfig())
    except TextFileError as exc:
        raise RepositoryError(f"{path}: cannot read: {exc}") from None
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
