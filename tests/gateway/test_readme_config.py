"""The README's configuration sample is a file the gateway loads: an operator copies it. Each line
it shows as a default is the default, and each commented-out line is a key the gateway takes."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance.config import (
    _REDIS_KEYS,
    _SEMANTIC_KEYS,
    ConfigError,
    GatewayConfig,
    ModelConfig,
    load_config,
)
from tests.security.certs import CA

Load = Callable[[str], GatewayConfig]
README = Path(__file__).resolve().parents[2] / "README.md"
# `key = value`, or a commented-out `# key = value`, and the comment after it.
SETTING = re.compile(r"^(?P<off># )?(?P<key>[a-z_0-9]+) = (?P<value>.*?)(?:\s+#(?P<note>.*))?$")
# Lines whose value is an example, not the default: each says so in its comment ("default ...")
# or has no default (required, or absent means off), or is where the files the sample names live.
EXAMPLES = {
    "server.listen",
    "metrics.listen",
    "tls.cert_file",
    "tls.key_file",
    "tls.client_ca_file",
    "auth.keys_file",
    "auth.pepper_file",
    "models.tiny-llama.backend",
    "models.tiny-llama.tokenizer_dir",
    "models.tiny-llama.stream_socket",
    "models.tiny-llama.max_input_tokens",
    "models.tiny-llama.fingerprint_file",
    "models.tiny-llama.max_in_flight",
    "models.tiny-llama.ttft_budget_ms",
    "http.listen",
    "cache.tiers",
    "cache.redis.mac_key_file",
    # "" and no username are the same: no ACL user (the loader keeps the "").
    "cache.redis.username",
    "cache.semantic.namespaces",
    # Relative to the file; the default is relative to the working directory.
    "cache.semantic.embedder_dir",
}


def _sample() -> str:
    section = README.read_text().split("## Configuration (`appliance serve --config FILE`, TOML)")[
        1
    ]
    return section.split("```toml\n", 1)[1].split("```", 1)[0]


def _settings(text: str) -> list[tuple[int, str, re.Match[str]]]:
    """(line index, TABLE.KEY, match) of each setting of the sample, commented-out or not."""
    table, found = "", []
    for n, line in enumerate(text.splitlines()):
        if header := re.match(r"^\[([^\]]+)\]", line):
            table = header.group(1)
        elif setting := SETTING.match(line):
            found.append((n, f"{table}.{setting.group('key')}", setting))
    return found


@pytest.fixture
def load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Load:
    """Loads a text of the sample, its absolute paths moved under tmp_path where its files are."""
    etc, srv, credentials = tmp_path / "etc", tmp_path / "srv", tmp_path / "credentials"
    (etc / "tls").mkdir(parents=True)
    credentials.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    ca = CA(tmp_path, "ca")
    issued = ca.issue("server", "gateway")
    shutil.copy(issued.cert, etc / "tls" / "server.crt")
    shutil.copy(issued.key, etc / "tls" / "server.key")
    shutil.copy(ca.path, etc / "tls" / "client-ca.crt")
    for name in ("api-key-pepper", "cache-mac-key"):
        (credentials / name).write_bytes(b"k" * 32)
    path = tmp_path / "gateway.toml"

    def load(text: str) -> GatewayConfig:
        path.write_text(text.replace("/etc/appliance/", f"{etc}/").replace("/srv/", f"{srv}/"))
        return load_config(path)

    return load


def test_the_readme_configuration_sample_loads(load: Load) -> None:
    config = load(_sample())

    assert list(config.models) == ["tiny-llama"]


def test_a_value_the_sample_shows_is_the_default(load: Load) -> None:
    """Leaving out a line of the sample changes nothing, but for the lines that are examples."""
    lines = _sample().splitlines()
    whole = load("\n".join(lines))
    shown = [(n, key) for n, key, s in _settings("\n".join(lines)) if not s.group("off")]
    assert {key for _, key in shown} >= EXAMPLES
    not_default = []
    for n, key in shown:
        if key in EXAMPLES:
            continue
        if load("\n".join(lines[:n] + lines[n + 1 :])) != whole:
            not_default.append(lines[n])
    assert not_default == []


def test_each_commented_out_line_of_the_sample_is_a_key_the_gateway_takes(load: Load) -> None:
    lines = _sample().splitlines()
    off = [(n, key) for n, key, s in _settings("\n".join(lines)) if s.group("off")]
    assert off
    for n, key in off:
        try:
            load("\n".join([*lines[:n], lines[n].removeprefix("# "), *lines[n + 1 :]]))
        except ConfigError as exc:
            # Read and judged by its value (a fallback names a model this sample lacks).
            assert f"key '{key}': " in str(exc) and "unknown key" not in str(exc), str(exc)


def test_the_sample_shows_every_key_of_a_model_redis_and_the_semantic_tier() -> None:
    shown = {key for _, key, _ in _settings(_sample())}
    taken = {
        *(f"models.tiny-llama.{f}" for f in ModelConfig.__dataclass_fields__ if f != "name"),
        *(f"cache.redis.{k}" for k in _REDIS_KEYS),
        *(f"cache.semantic.{k}" for k in _SEMANTIC_KEYS),
    }
    assert sorted(taken - shown) == []
