"""ansible-lint with the production profile, and a syntax check of site.yml against the example inventory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
VENV = REPO / ".venv-ansible" / "bin"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PIP_"))}
    env["PATH"] = f"{VENV}:{env.get('PATH', '/usr/bin:/bin')}"
    env["ANSIBLE_CONFIG"] = str(ANSIBLE / "ansible.cfg")
    env.setdefault("LC_ALL", "C.UTF-8")
    return env


def test_ansible_lint_production_profile() -> None:
    result = subprocess.run(
        [str(VENV / "ansible-lint"), "--profile", "production", "--offline", "--nocolor"],
        cwd=ANSIBLE,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Profile 'production' was required, and it passed" in result.stdout + result.stderr


def test_site_syntax() -> None:
    result = subprocess.run(
        [
            str(VENV / "ansible-playbook"),
            "--syntax-check",
            "-i",
            "inventory/example/hosts.yml",
            "site.yml",
        ],
        cwd=ANSIBLE,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "role", ["appliance", "redis", "nvidia_prereqs", "host_tuning", "triton", "engine_build"]
)
def test_role_layout(role: str) -> None:
    """linux-system-roles conventions: defaults, handlers, argument specs, galaxy metadata."""
    base = ANSIBLE / "roles" / role
    for path in (
        "defaults/main.yml",
        "handlers/main.yml",
        "meta/main.yml",
        "meta/argument_specs.yml",
    ):
        assert (base / path).is_file(), f"{role}: {path} missing"
