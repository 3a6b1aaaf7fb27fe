"""What the tests need from the machine, checked once before any test runs (a pytest plugin, see
pyproject's addopts).

When a collected test needs a program that is missing, the run stops before the first test with one
line per missing thing and the command that provides it — never a skip (a green run that tested
nothing) and never an error deep in a fixture. The programs, their Debian packages and the tests that
run them are listed once, in .ci/debian-packages, which `make test` (.ci/system-deps) installs from.
"""

from __future__ import annotations

import ctypes
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


LIBRARY = "lib:"


def _present(program: str) -> bool:
    """A program on PATH, or (``lib:NAME``) a shared library the dynamic linker loads."""
    if program.startswith(LIBRARY):
        try:
            ctypes.CDLL(program.removeprefix(LIBRARY))
        except OSError:
            return False
        return True
    return shutil.which(program) is not None


def _install_hint(absent: list[Program]) -> str:
    packages = " ".join(sorted({p.package for p in absent}))
    return (
        f"install with `sudo apt-get install -y --no-install-recommends {packages}` "
        "(`make test` as root installs it)"
    )


def missing(tests: set[str]) -> list[str]:
    """One message per missing prerequisite of these tests (paths relative to the repository)."""
    absent = [
        p
        for p in programs(PACKAGES_FILE.read_text())
        if tests.intersection(p.tests) and not _present(p.program)
    ]
    problems = []
    commands = [p for p in absent if not p.program.startswith(LIBRARY)]
    libraries = [p for p in absent if p.program.startswith(LIBRARY)]
    if commands:
        problems.append(
            f"{', '.join(p.program for p in commands)} not found on PATH: "
            + _install_hint(commands)
        )
    if libraries:
        names = ", ".join(p.program.removeprefix(LIBRARY) for p in libraries)
        problems.append(f"{names} not found by the dynamic linker: " + _install_hint(libraries))
    if tests.intersection(NEEDS_ROOT) and os.geteuid() != 0:
        needing = ", ".join(sorted(tests.intersection(NEEDS_ROOT)))
        problems.append(f"not root: {needing} need root (network namespaces, systemd-nspawn)")
    if tests.intersection(NEEDS_ANSIBLE) and not (ANSIBLE_BIN / "ansible-playbook").exists():
        problems.append(f"no {ANSIBLE_BIN.parent.name}: run `make ansible-venv` (`make test` does)")
    return problems


def _stop_if_missing(tests: set[str]) -> None:
    problems = missing(tests)
    if problems:
        pytest.exit("; ".join(problems), returncode=EXIT_MISSING)


def pytest_collection_finish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: its controller checks
        return
    tests = set()
    for item in session.items:
        try:
            tests.add(item.path.resolve().relative_to(REPO).as_posix())
        except ValueError:
            continue
    _stop_if_missing(tests)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """Under xdist the controller collects nothing itself: it checks what a worker collected
    (test ids are paths relative to the repository, where pytest runs)."""
    _stop_if_missing({nodeid.split("::", 1)[0] for nodeid in ids})
