"""The appliance role's gateway.toml, rendered by the pinned Ansible on the controller, is a file
the gateway loads, with the settings its variables set."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from appliance.cache.l2 import RedisSettings
from appliance.config import load_config

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
ANSIBLE_BIN = REPO / ".venv-ansible" / "bin"


def _render(
    tmp_path: Path, variables: dict[str, object], template: str = "gateway.toml.j2"
) -> Path:
    """One of the appliance role's templates, rendered with the role's defaults and vars and
    these variables (profile cpu unless they say otherwise)."""
    out = tmp_path / template.removesuffix(".j2")
    extra = tmp_path / "vars.json"
    extra.write_text(json.dumps({"appliance_profile": "cpu", **variables}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PIP_"))}
    env.update(
        ANSIBLE_CONFIG=str(ANSIBLE / "ansible.cfg"),
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"),
        ANSIBLE_REMOTE_TEMP=str(tmp_path / "tmp"),
        ANSIBLE_NOCOLOR="1",
        HOME=str(tmp_path),
        LC_ALL="C.UTF-8",
    )
    done = subprocess.run(
        [
            str(ANSIBLE_BIN / "ansible"),
            "localhost",
            "-c",
            "local",
            "-i",
            "localhost,",
            "-e",
            f"ansible_python_interpreter={(ANSIBLE_BIN / 'python').resolve()}",
            "-e",
            "@roles/appliance/defaults/main.yml",
            "-e",
            "@roles/appliance/vars/main.yml",
            "-e",
            f"@{extra}",
            "-m",
            "ansible.builtin.template",
            "-a",
            f"src=roles/appliance/templates/{template} dest={out}",
        ],
        cwd=ANSIBLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_a_redis_ca_bundle_reaches_the_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "redis-password").write_text("p" * 32)
    (credentials / "cache-mac-key").write_bytes(b"k" * 32)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    ca = tmp_path / "redis-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")

    plain = load_config(_render(tmp_path, {}))
    rediss = load_config(
        _render(
            tmp_path,
            {
                "appliance_redis_url": "rediss://10.0.0.5:6380/0",
                "appliance_redis_tls_ca_file": str(ca),
            },
        )
    )

    assert plain.cache.redis is not None and plain.cache.redis.tls_ca_file is None
    assert rediss.cache.redis is not None and rediss.cache.redis.tls_ca_file == str(ca)
    assert plain.cache.redis.timeout_ms == RedisSettings.timeout_ms


def test_the_redis_time_budget_reaches_the_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "redis-password").write_text("p" * 32)
    (credentials / "cache-mac-key").write_bytes(b"k" * 32)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    config = load_config(_render(tmp_path, {"appliance_redis_timeout_ms": 150}))
    assert config.cache.redis is not None and config.cache.redis.timeout_ms == 150.0


def test_the_gateway_logs_in_to_the_sentinels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The redis role's Sentinels require a login: the gateways' ACL user with its password (the
    same credential as at the primary)."""
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "redis-password").write_text("p" * 32 + "\n")
    (credentials / "cache-mac-key").write_bytes(b"k" * 32)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))

    config = load_config(
        _render(
            tmp_path,
            {"appliance_redis_sentinels": ["10.0.0.2:26379", "10.0.0.3:26379", "10.0.0.4:26379"]},
        )
    )

    redis = config.cache.redis
    assert redis is not None and len(redis.sentinels) == 3
    assert (redis.username, redis.password) == ("appliance", "p" * 32)
    assert (redis.sentinel_username, redis.sentinel_password) == ("appliance", "p" * 32)
