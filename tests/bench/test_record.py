"""bench/record.py: a run record is written only when asked, never over an earlier one."""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import pytest

from bench import record

NOON = dt.datetime(2026, 11, 27, 12, 0, 0, tzinfo=dt.UTC)


def test_write_record_writes_json_and_markdown(tmp_path: Path) -> None:
    path = record.write_record(
        "streaming",
        {"ttft_p50_us": 11.5},
        "| measure | P50 |\n",
        directory=tmp_path,
        argv=["--requests", "20"],
        now=NOON,
    )
    assert path == tmp_path / "2026-11-27-streaming.json"
    data = json.loads(path.read_text())
    assert data["date"] == "2026-11-27"
    assert data["command"] == "python -m bench.streaming --requests 20"
    assert data["results"] == {"ttft_p50_us": 11.5}
    assert data["machine"]["cpu_count"] >= 1
    assert {"platform", "cpu", "python"} <= data["machine"].keys()
    page = (tmp_path / "2026-11-27-streaming.md").read_text()
    assert "python -m bench.streaming --requests 20" in page
    assert "| measure | P50 |" in page


def test_a_second_run_the_same_day_does_not_overwrite(tmp_path: Path) -> None:
    first = record.write_record("cache", {"run": 1}, "one", directory=tmp_path, now=NOON)
    second = record.write_record("cache", {"run": 2}, "two", directory=tmp_path, now=NOON)
    assert second == tmp_path / "2026-11-27-cache-2.json"
    assert json.loads(first.read_text())["results"] == {"run": 1}
    assert json.loads(second.read_text())["results"] == {"run": 2}


@pytest.mark.parametrize("name", ["", "../x", ".hidden"])
def test_a_name_that_is_not_a_file_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="plain file name"):
        record.write_record(name, {}, "", directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_recording_without_a_directory_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with record.recording("streaming", None) as run:
        print("table")
        run.results["x"] = 1
    assert capsys.readouterr().out == "table\n"
    assert list(tmp_path.iterdir()) == []


def test_recording_keeps_the_printed_output_and_the_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with record.recording("admission", tmp_path, argv=["--seconds", "1"]) as run:
        print("| gateway | load |")
        run.results["levels"] = [1, 2]
    assert capsys.readouterr().out == "| gateway | load |\n"
    (path,) = tmp_path.glob("*-admission.json")
    data = json.loads(path.read_text())
    assert data["results"] == {"output": "| gateway | load |\n", "levels": [1, 2]}
    assert data["command"] == "python -m bench.admission --seconds 1"
    assert "| gateway | load |" in path.with_suffix(".md").read_text()


def test_the_record_names_the_commit_the_run_began_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = ["aaaaaaa"]
    monkeypatch.setattr(record, "_commit", lambda: head[0])
    with record.recording("speculative", tmp_path):
        print("a long run, committed on meanwhile")
        head[0] = "bbbbbbb"
    (path,) = tmp_path.glob("*-speculative.json")
    assert json.loads(path.read_text())["commit"] == "aaaaaaa"


def test_a_run_that_fails_writes_no_record(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), record.recording("guided", tmp_path):
        print("half a table")
        raise RuntimeError("engine died")
    assert list(tmp_path.iterdir()) == []


def test_the_flag_is_off_by_default(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    record.add_flag(parser)
    assert record.record_dir(parser.parse_args([])) is None
    assert record.record_dir(parser.parse_args(["--record"])) == record.RUNS_DIR
    given = parser.parse_args(["--record", "--record-dir", str(tmp_path)])
    assert record.record_dir(given) == tmp_path


def test_a_checkpoint_keeps_what_a_killed_run_measured(tmp_path: Path) -> None:
    """A run killed after a checkpoint (a device call's `timeout`) leaves the record so far,
    marked partial; the run's end writes over it, in the same files."""
    with pytest.raises(RuntimeError), record.recording("matvec_tiles", tmp_path) as run:
        print("| bf16 | 64x128 |")
        run.results["bf16"] = {"best": [64, 128]}
        run.checkpoint()
        print("half of fp8's table")
        raise RuntimeError("killed")
    (path,) = tmp_path.glob("*-matvec_tiles.json")
    data = json.loads(path.read_text())
    assert data["partial"] is True
    assert data["results"] == {"output": "| bf16 | 64x128 |\n", "bf16": {"best": [64, 128]}}
    assert "partial" in path.with_suffix(".md").read_text().splitlines()[0]

    with record.recording("streaming", tmp_path) as run:
        print("level 1")
        run.checkpoint()
        print("level 2")
    (path,) = tmp_path.glob("*-streaming.json")
    data = json.loads(path.read_text())
    assert "partial" not in data and data["results"]["output"] == "level 1\nlevel 2\n"
    assert len(list(tmp_path.glob("*-streaming.*"))) == 2
