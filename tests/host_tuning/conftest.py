"""Fixtures: generated machine trees with NVML faked at the pynvml boundary.

Read-only tests share one HGX tree per session; tests that apply settings get a fresh tree of
their own (``hgx_rw``, ``box``). Trees live in /dev/shm when it is writable: on overlay or
virtual disks the ~2000 small files cost ten times as long.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.host_tuning import hostbuilder


def _scratch() -> Path | None:
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return Path(tempfile.mkdtemp(prefix="host-tune-test-", dir="/dev/shm"))
    return None


@pytest.fixture
def fast_tmp(tmp_path: Path) -> Iterator[Path]:
    d = _scratch()
    yield d or tmp_path
    if d is not None:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def _hgx_shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[hostbuilder.Machine]:
    d = _scratch()
    yield hostbuilder.hgx((d or tmp_path_factory.mktemp("hgx-shared")) / "root")
    if d is not None:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def hgx(_hgx_shared: hostbuilder.Machine, monkeypatch: pytest.MonkeyPatch) -> hostbuilder.Machine:
    """The shared HGX tree: do not write to it."""
    _hgx_shared.nvml.calls.clear()
    _hgx_shared.nvml.install(monkeypatch)
    return _hgx_shared


@pytest.fixture
def hgx_rw(fast_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> hostbuilder.Machine:
    m = hostbuilder.hgx(fast_tmp / "hgx")
    m.nvml.install(monkeypatch)
    return m


@pytest.fixture
def box(fast_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> hostbuilder.Machine:
    m = hostbuilder.workstation(fast_tmp / "box")
    m.nvml.install(monkeypatch)
    return m


@pytest.fixture
def write_profile(tmp_path: Path) -> Callable[[str], Path]:
    def write(text: str) -> Path:
        p = tmp_path / "profile.toml"
        p.write_text(text)
        return p

    return write
