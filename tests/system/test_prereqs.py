"""The machine's prerequisites: .ci/debian-packages stays true, and a missing program stops the run with the
install command instead of skipping tests or erroring in a fixture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import prereqs
from tests.prereqs import EXIT_MISSING, PACKAGES_FILE, REPO, programs


def test_every_listed_test_path_exists() -> None:
    listed = programs(PACKAGES_FILE.read_text())
    assert {p.program for p in listed} >= {"redis-server", "systemd-nspawn", "debootstrap"}
    for p in listed:
        for test in p.tests:
            assert (REPO / test).is_file(), (
                f"{PACKAGES_FILE.name}: {p.package}: {test} does not exist"
            )


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_missing_program_fails_with_the_install_command(tmp_path: Path, workers: list[str]) -> None:
    # A PATH that has this Python but no redis-server.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = {**os.environ, "PATH": str(bin_dir)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            *workers,
            "tests/cache/test_cache_e2e.py",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == EXIT_MISSING, out
    assert (
        "redis-server not found on PATH: install with "
        "`sudo apt-get install -y --no-install-recommends redis-server`"
    ) in out
    assert "passed" not in out and "skipped" not in out and "error" not in out, out


def test_a_missing_library_is_reported_with_its_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    listing = tmp_path / "debian-packages"
    listing.write_text(
        "libnothing-0  lib:libnothing-appliance.so.0  tests/engine/test_perf_analyzer.py\n"
        "libb64-0d     lib:libb64.so.0d               tests/engine/test_perf_analyzer.py\n"
    )
    monkeypatch.setattr(prereqs, "PACKAGES_FILE", listing)
    problems = prereqs.missing({"tests/engine/test_perf_analyzer.py"})
    assert problems == [
        "libnothing-appliance.so.0 not found by the dynamic linker: install with "
        "`sudo apt-get install -y --no-install-recommends libnothing-0` "
        "(`make test` as root installs it)"
    ]
