"""The semantic tier's embedder, exported once per session by `appliance semantic-setup` itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def semantic_setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The exported directory and the command's run (its output is checked by a test)."""
    dest = tmp_path_factory.mktemp("embedder")
    run = subprocess.run(
        [sys.executable, "-m", "appliance", "semantic-setup", "--dest", str(dest)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    return dest, run


@pytest.fixture(scope="session")
def embedder_dir(semantic_setup: tuple[Path, subprocess.CompletedProcess[str]]) -> Path:
    return semantic_setup[0]
