"""bench/chat_tokens.py: a table row per turn, both ways timed on the same conversation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.chat_tokens import main
from tests.conftest import Tiny


def test_it_prints_a_row_per_turn(tiny: Tiny, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--tokenizer", str(tiny.tokenizer_dir), "--turns", "3", "--words", "20", "--reps", "2"]
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| turn | prompt tokens | whole P50 µs | cached P50 µs")
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["1", "2", "3"]


def test_a_tokenizer_without_a_cache_is_refused_in_one_line(tiny: Tiny, tmp_path: Path) -> None:
    plain = tmp_path / "tokenizer"
    plain.mkdir()
    shutil.copy(tiny.tokenizer_dir / "tokenizer.json", plain / "tokenizer.json")  # no template
    with pytest.raises(SystemExit, match="gets no segment cache"):
        main(["--tokenizer", str(plain), "--turns", "1", "--reps", "1"])
