"""Fixtures: generated machine trees with NVML faked at the pynvml boundary."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.host_tuning import hostbuilder


@pytest.fixture
def hgx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> hostbuilder.Machine:
    m = hostbuilder.hgx(tmp_path / "hgx")
    m.nvml.install(monkeypatch)
    return m


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> hostbuilder.Machine:
    m = hostbuilder.workstation(tmp_path / "box")
    m.nvml.install(monkeypatch)
    return m


@pytest.fixture
def write_profile(tmp_path: Path) -> Callable[[str], Path]:
    def write(text: str) -> Path:
        p = tmp_path / "profile.toml"
        p.write_text(text)
        return p

    return write
