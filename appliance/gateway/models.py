"""The models a gateway serves: text side (tokenizer, template), limits, backend and identity.

Loaded once at start-up. The identity is what the cache keys on, so a rebuilt engine, another tokenizer
or another chat template never gets an answer computed by the old one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from appliance.backends.base import Backend, BackendError, backend_kind
from appliance.cache.keys import ModelIdentity
from appliance.config import GatewayConfig, ModelConfig
from appliance.gateway.breaker import CircuitBreaker
from appliance.gateway.health import ModelHealth
from appliance.gateway.request import Limits
from appliance.text.tokenizer import ModelText, TokenizerLoadError
from appliance.textfile import TextFileError, read_text

# An engine fingerprint is a digest: a larger file is a wrong path, refused after this much.
MAX_FINGERPRINT_BYTES = 64 << 10


class StartupError(Exception):
    """The gateway cannot start; the message is the one line an operator reads.

    `exit_status` follows the CLIs' convention: 2 when an input file is wrong (tokenizer, engine
    fingerprint, limits: fix it and rerun), 1 when something failed at run time (the inference
    server not ready, the port taken)."""

    def __init__(self, message: str, exit_status: int = 1) -> None:
        super().__init__(message)
        self.exit_status = exit_status


@dataclass(frozen=True)
class ModelPolicy:
    """How long a request of this model may take, and who answers when its engine cannot."""

    default_deadline_s: float
    ttft_budget_s: float | None
    fallback: str | None


@dataclass
class ServedModel:
    """One model of the public API, as the gateway serves it."""

    name: str
    text: ModelText
    limits: Limits
    backend: Backend
    identity: ModelIdentity
    policy: ModelPolicy
    health: ModelHealth


def _served(cfg: ModelConfig, text: ModelText, backend: Backend, cached: bool) -> ServedModel:
    return ServedModel(
        name=cfg.name,
        text=text,
        limits=model_limits(cfg, text),
        backend=backend,
        identity=model_identity(cfg, text, need_fingerprint=cached),
        policy=ModelPolicy(
            default_deadline_s=cfg.default_deadline_s,
            ttft_budget_s=None if cfg.ttft_budget_ms is None else cfg.ttft_budget_ms / 1000,
            fallback=cfg.fallback,
        ),
        health=ModelHealth(CircuitBreaker(cfg.breaker_failures, cfg.breaker_reset_s)),
    )


def _file_digest(*paths: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for path in paths:
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def model_identity(cfg: ModelConfig, text: ModelText, need_fingerprint: bool) -> ModelIdentity:
    engine = ""
    if need_fingerprint:
        try:
            engine = read_text(cfg.fingerprint_path, MAX_FINGERPRINT_BYTES).strip()
        except TextFileError as exc:
            raise StartupError(
                f"model '{cfg.name}': engine fingerprint {cfg.fingerprint_path} unreadable "
                f"({exc}); cache keys need it so a rebuilt engine never serves old "
                "answers (set fingerprint_file, or [cache] enabled = false)"
            ) from exc
        if not engine:
            raise StartupError(
                f"model '{cfg.name}': engine fingerprint {cfg.fingerprint_path} is empty",
                exit_status=2,
            )
    return ModelIdentity(
        name=cfg.name,
        engine_fingerprint=engine,
        tokenizer_fingerprint=_file_digest(
            cfg.tokenizer_dir / "tokenizer.json", cfg.tokenizer_dir / "tokenizer_config.json"
        ),
        template_version=text.template_version,
    )


def model_limits(cfg: ModelConfig, text: ModelText) -> Limits:
    context = text.context_length or (cfg.max_input_tokens or 0) + cfg.max_output_tokens
    max_input = cfg.max_input_tokens or max(1, context - 1)
    if max_input >= context:
        raise StartupError(
            f"model '{cfg.name}': max_input_tokens {max_input} must be below the model's "
            f"context of {context} tokens",
            exit_status=2,
        )
    longest_token = max((len(piece) for piece in text.table.pieces), default=1)
    return Limits(
        max_input_tokens=max_input,
        max_output_tokens=cfg.max_output_tokens,
        default_max_tokens=cfg.default_max_tokens,
        context_length=context,
        # No token spans more bytes than the longest one, and a character is at least a byte:
        # text with more characters than this cannot tokenize into max_input tokens or fewer.
        max_input_chars=2 * max(longest_token, 1) * max_input,
    )


async def load_models(config: GatewayConfig) -> dict[str, ServedModel]:
    """Loads every tokenizer and waits for every backend; StartupError says which failed and why."""
    models: dict[str, ServedModel] = {}
    try:
        for name, cfg in config.models.items():
            try:
                text = ModelText.load(cfg.tokenizer_dir)
            except (TokenizerLoadError, ValueError) as exc:
                raise StartupError(f"model '{name}': {exc}", exit_status=2) from exc
            kind = backend_kind(cfg.backend_kind)
            try:
                backend = kind.from_config(cfg)
            except Exception as exc:  # a plugin's own code: one line to read, not a traceback
                why = str(exc).splitlines()[0] if str(exc) else ""
                raise StartupError(
                    f"model '{name}': backend kind {cfg.backend_kind!r}: from_config failed: "
                    f"{type(exc).__name__}{': ' if why else ''}{why[:300]}",
                    exit_status=2,
                ) from exc
            models[name] = _served(cfg, text, backend, cached=config.cache.enabled)
            try:
                await backend.wait_ready(cfg.ready_timeout_s)
            except BackendError as exc:
                raise StartupError(f"model '{name}': {exc.message}") from exc
    except BaseException:
        for m in models.values():
            await m.backend.close()
        raise
    return models
