"""Reads a Triton-style model repository for the engine server (layout: docs/MODEL_REPOSITORY.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

HF_MODEL_DIR = "hf_model_dir"
FINGERPRINT_FILE = "engine_fingerprint"
# TensorRT-LLM 1.2's build default (PluginConfig.tokens_per_block); a repository that was built with
# another value records it in the `tokens_per_block` parameter.
DEFAULT_TOKENS_PER_BLOCK = 32
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
        tokens_per_block = self._positive_int("tokens_per_block") or DEFAULT_TOKENS_PER_BLOCK
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
        return KvCacheParams(
            max_seq_len=self._positive_int("max_seq_len"),
            tokens_per_block=tokens_per_block,
            enable_reuse=reuse == "true",
            max_tokens=self._positive_int("max_tokens_in_paged_kv_cache"),
            free_mem_fraction=fraction,
        )

    @property
    def fingerprint(self) -> str:
        """The repository's engine fingerprint (changes whenever generated tokens could); "" if none."""
        try:
            return (self.directory / FINGERPRINT_FILE).read_text(encoding="utf-8").strip()
        except OSError:
            return ""


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


def load_repository(root: Path) -> dict[str, ModelEntry]:
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
