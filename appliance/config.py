"""The gateway's TOML configuration: one file, every key checked, errors that name the line and key.

The README's "Configuration" section documents each key; keep the two in step.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file, line and key."""


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "127.0.0.1:50051"
    # Seconds in-flight requests get to finish after SIGTERM before they are cancelled.
    drain_seconds: float = 10.0
    log_level: str = "info"


@dataclass(frozen=True)
class ModelConfig:
    name: str
    backend: str
    tokenizer_dir: Path
    triton_model: str = "tensorrt_llm"
    # None: derived from the model's config.json (max_position_embeddings) at start-up.
    max_input_tokens: int | None = None
    max_output_tokens: int = 1024
    default_max_tokens: int = 256
    ready_timeout_s: float = 60.0


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig
    models: dict[str, ModelConfig] = field(default_factory=dict)


_LOG_LEVELS = ("debug", "info", "warning", "error")


def _line_of(text: str, table: str, key: str | None) -> int:
    """Best-effort line number of `key` inside `[table]` (or of the table header) for messages."""
    lines = text.splitlines()
    header = re.compile(r"^\s*\[+\s*([^\]]+?)\s*\]+\s*(#.*)?$")
    in_table = table == ""
    table_line = 0
    for number, line in enumerate(lines, start=1):
        m = header.match(line)
        if m:
            name = m.group(1).replace('"', "").replace("'", "").replace(" ", "")
            in_table = name == table
            if in_table:
                table_line = number
            continue
        if (
            in_table
            and key is not None
            and re.match(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=", line)
        ):
            return number
    return table_line


class _Reader:
    """Pulls typed values out of one TOML table and complains precisely."""

    def __init__(self, path: Path, text: str, table: str, data: dict[str, Any], known: set[str]):
        self.path, self.text, self.table, self.data = path, text, table, data
        unknown = sorted(set(data) - known)
        if unknown:
            self.fail(unknown[0], f"unknown key; known keys are {', '.join(sorted(known))}")

    def fail(self, key: str | None, message: str) -> None:
        line = _line_of(self.text, self.table, key)
        where = f"{self.table}.{key}" if key and self.table else (key or self.table)
        raise ConfigError(f"{self.path}:{line}: key '{where}': {message}")

    def get(self, key: str, kind: type, default: Any) -> Any:
        if key not in self.data:
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.fail(key, f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        return value

    def positive(self, key: str, kind: type, default: Any) -> Any:
        value = self.get(key, kind, default)
        if value is not None and value <= 0:
            self.fail(key, f"must be greater than 0, got {value!r}")
        return value

    def require(self, key: str) -> str:
        if key not in self.data:
            self.fail(None, f"missing required key '{key}'")
        value = self.get(key, str, "")
        if not value:
            self.fail(key, "must not be empty")
        return str(value)


def _address(reader: _Reader, key: str, default: str) -> str:
    value = str(reader.get(key, str, default))
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        reader.fail(key, f"expected HOST:PORT, got {value!r}")
    return value


def load_config(path: Path) -> GatewayConfig:
    """Reads and validates the gateway configuration; raises ConfigError with file:line: key."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read configuration: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc

    top = _Reader(path, text, "", data, {"server", "models"})
    server_data = top.get("server", dict, {})
    srv = _Reader(path, text, "server", server_data, {"listen", "drain_seconds", "log_level"})
    log_level = srv.get("log_level", str, "info")
    if log_level not in _LOG_LEVELS:
        srv.fail("log_level", f"expected one of {', '.join(_LOG_LEVELS)}, got {log_level!r}")
    server = ServerConfig(
        listen=_address(srv, "listen", ServerConfig.listen),
        drain_seconds=srv.get("drain_seconds", float, ServerConfig.drain_seconds),
        log_level=log_level,
    )
    if server.drain_seconds < 0:
        srv.fail("drain_seconds", "must be 0 or more")

    models_data = top.get("models", dict, {})
    if not models_data:
        top.fail("models", "at least one [models.NAME] table is required")
    models: dict[str, ModelConfig] = {}
    known = {f for f in ModelConfig.__dataclass_fields__ if f != "name"}
    for name, table in models_data.items():
        table_name = f"models.{name}"
        if not isinstance(table, dict):
            top.fail(table_name, "must be a table: [models.NAME]")
        r = _Reader(path, text, table_name, table, known)
        tokenizer_dir = Path(r.require("tokenizer_dir")).expanduser()
        if not tokenizer_dir.is_absolute():
            tokenizer_dir = path.parent / tokenizer_dir
        model = ModelConfig(
            name=name,
            backend=_address(r, "backend", "") if "backend" in table else r.require("backend"),
            tokenizer_dir=tokenizer_dir,
            triton_model=r.get("triton_model", str, ModelConfig.triton_model),
            max_input_tokens=r.positive("max_input_tokens", int, None),
            max_output_tokens=r.positive("max_output_tokens", int, ModelConfig.max_output_tokens),
            default_max_tokens=r.positive(
                "default_max_tokens", int, ModelConfig.default_max_tokens
            ),
            ready_timeout_s=r.positive("ready_timeout_s", float, ModelConfig.ready_timeout_s),
        )
        if model.default_max_tokens > model.max_output_tokens:
            r.fail(
                "default_max_tokens",
                f"{model.default_max_tokens} exceeds max_output_tokens {model.max_output_tokens}",
            )
        models[name] = model
    return GatewayConfig(server=server, models=models)
