"""`appliance demo` ends in one line, not a traceback, when its engine server cannot start."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from appliance.engine.repository import lock_repository
from appliance.tools import demo, instruct_model
from tests.conftest import Tiny


def test_a_repository_already_served_ends_the_demo_in_one_line(
    tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        instruct_model, "ensure_instruct_model", lambda *_, **__: (tiny.model_dir, tiny.repo)
    )
    held = lock_repository(tiny.repo)  # as another engine server serving it would
    try:
        assert demo.run_demo(tmp_path, 1, 4) == 1
    finally:
        os.close(held)
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    last = out.out.strip().splitlines()[-1]
    assert last.startswith("appliance demo: engine server exited with ")
    assert "another engine server is already serving this repository" in last


def test_the_demo_answers_and_cleans_up(
    tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's first command, on the tiny model: the engine server and the gateway start,
    the gateway reaches the engine over its stream socket, every question is answered, and the
    socket's folder is gone afterwards."""
    monkeypatch.setattr(
        instruct_model, "ensure_instruct_model", lambda *_, **__: (tiny.model_dir, tiny.repo)
    )
    made: list[str] = []
    mkdtemp = tempfile.mkdtemp

    def recorded(**kwargs: str) -> str:
        made.append(mkdtemp(**kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recorded)
    assert demo.run_demo(tmp_path, 2, 4) == 0
    out = capsys.readouterr().out
    assert f"and {made[0]}/engine.sock" in out and "Traceback" not in out
    assert not Path(made[0]).exists()
