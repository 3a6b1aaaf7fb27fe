"""What the tests need from the machine, checked once before any test runs (a pytest plugin, see
pyproject's addopts).

When a collected test needs a program that is missing, the run stops before the first test with one
line per missing thing and the command that provides it — never a skip (a green run that tested
nothing) and never an error deep in a fixture. The programs, their Debian packages and the tests that
run them are listed once, in .ci/debian-packages, which `make test` (.ci/system-deps) installs from.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES_FILE = REPO / ".ci" / "debian-packages"
ANSIBLE_BIN = REPO / ".venv-ansible" / "bin"
# Exit status of a run stopped for a missing prerequisite (pytest's "usage error").
EXIT_MISSING = pytest.ExitCode.USAGE_ERROR

# What is not a Debian package: the tests that need root, and those that run the pinned Ansible.
NEEDS_ROOT = (
    "tests/system/test_e2e.py",
    "tests/system/test_fleet.py",
    "tests/host_tuning/test_nic_netns.py",
)
NEEDS_ANSIBLE = (
    "tests/system/test_e2e.py",
    "tests/system/test_fleet.py",
    "tests/system/test_ansible_lint.py",
    "tests/system/test_ansible_guards.py",
)


@dataclass(frozen=True)
class Program:
    package: str
    program: str
    tests: tuple[str, ...]


def programs(text: str) -> list[Program]:
    """The lines of .ci/debian-packages that name a program the tests run."""
    found = []
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and fields[1] != "-":
            found.append(Program(fields[0], fields[1], tuple(f for f in fields[2:] if f != "-")))
    return found


def missing(tests: set[str]) -> list[str]:
    """One message per missing prerequisite of these tests (paths relative to the repository)."""
    absent = [
        p
        for p in programs(PACKAGES_FILE.read_text())
        if tests.intersection(p.tests) and shutil.which(p.program) is None
    ]
    problems = []
    if absent:
        packages = " ".join(sorted({p.package for p in absent}))
        problems.append(
            f"{', '.join(p.program for p in absent)} not found on PATH: install with "
            f"`sudo apt-get install -y --no-install-recommends {packages}` "
            "(`make test` as root installs it)"
        )
    if tests.intersection(NEEDS_ROOT) and os.geteuid() != 0:
        needing = ", ".join(sorted(tests.intersection(NEEDS_ROOT)))
        problems.append(f"not root: {needing} need root (network namespaces, systemd-nspawn)")
    if tests.intersection(NEEDS_ANSIBLE) and not (ANSIBLE_BIN / "ansible-playbook").exists():
        problems.append(f"no {ANSIBLE_BIN.parent.name}: run `make ansible-venv` (`make test` does)")
    return problems


def pytest_collection_finish(session: pytest.Session) -> None:
    tests = set()
    for item in session.items:
        try:
            tests.add(item.path.resolve().relative_to(REPO).as_posix())
        except ValueError:
            continue
    problems = missing(tests)
    if problems:
        pytest.exit("; ".join(problems), returncode=EXIT_MISSING)
