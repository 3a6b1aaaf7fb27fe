"""verify --textfile: the result as a node_exporter textfile-collector file, replaced whole."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from host_tuning import actions
from host_tuning.cli import main
from tests.host_tuning.hostbuilder import Machine

SWAPPINESS = "proc/sys/vm/swappiness"


@pytest.fixture
def collector_dir(tmp_path: Path) -> Path:
    """A textfile-collector directory of its own (the profile lives in tmp_path)."""
    d = tmp_path / "node-exporter"
    d.mkdir()
    return d


def samples(path: Path) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def verify_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main(["verify", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def applied(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> tuple[str, str]:
    """The box with a profile applied: verify exits 3 (its kernel command line waits for a boot)."""
    prof = str(write_profile("[kernel]\nisolate = false\n[memory]\nhugepages = 0\n"))
    root = str(box.root)
    assert main(["apply", "--root", root, "--profile", prof]) == 0
    capsys.readouterr()
    return root, prof


def test_drift_is_counted_per_plugin_and_status_as_verify_reports_it(
    box: Machine,
    applied: tuple[str, str],
    collector_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, prof = applied
    (box.root / SWAPPINESS).write_text("60\n")
    prom = collector_dir / "appliance-host-tune.prom"
    before = time.time()
    code, data = verify_json(capsys, "--root", root, "--profile", prof, "--textfile", str(prom))
    after = time.time()
    assert code == actions.EXIT_FAILED == data["exit_code"]  # exit code as without --textfile
    assert stat.S_IMODE(prom.stat().st_mode) == 0o644
    assert os.listdir(collector_dir) == [prom.name]  # no temporary file left beside it
    got = samples(prom)
    settings = {
        (labels["plugin"], labels["status"]): int(value)
        for labels, value in got["appliance_host_tune_settings"]
    }
    assert settings == Counter((r["plugin"], r["status"]) for r in data["results"])
    assert settings[("sysctl", actions.DRIFT)] == 1
    by_status: Counter[str] = Counter()
    for (_, status), n in settings.items():
        by_status[status] += n
    assert by_status == data["counts"]
    assert got["appliance_host_tune_verify_exit_code"] == [({}, float(actions.EXIT_FAILED))]
    ((_, stamp),) = got["appliance_host_tune_verify_timestamp_seconds"]
    assert before <= stamp <= after
    check = subprocess.run(
        ["promtool", "check", "metrics"],
        input=prom.read_text(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_pending_reboot_keeps_exit_3_and_its_stderr_line(
    box: Machine, applied: tuple[str, str], collector_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, prof = applied
    prom = collector_dir / "host.prom"
    assert main(["verify", "--root", root, "--profile", prof, "--textfile", str(prom)]) == 3
    out, err = capsys.readouterr()
    assert "verify: " in out and err.startswith("host-tune: verify: ")
    got = samples(prom)
    assert got["appliance_host_tune_verify_exit_code"] == [({}, float(actions.EXIT_REBOOT))]
    statuses = {labels["status"] for labels, _ in got["appliance_host_tune_settings"]}
    assert actions.REBOOT in statuses and actions.DRIFT not in statuses


def test_the_file_is_replaced_never_rewritten_in_place(
    box: Machine, applied: tuple[str, str], collector_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """node_exporter may be reading the old file: it reads it whole, never half of a new one."""
    root, prof = applied
    prom = collector_dir / "host.prom"
    prom.write_text("old\n")
    with prom.open() as reader:
        main(["verify", "--root", root, "--profile", prof, "--textfile", str(prom)])
        assert reader.read() == "old\n"
    assert "appliance_host_tune_verify_timestamp_seconds" in prom.read_text()


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("host.txt", "node_exporter's textfile collector reads only files ending in .prom"),
        ("absent/host.prom", "no directory "),
    ],
    ids=["not-prom", "no-directory"],
)
def test_a_textfile_path_that_cannot_work_is_refused_before_verify(
    box: Machine,
    write_profile: Callable[[str], Path],
    collector_dir: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    reason: str,
) -> None:
    prof = str(write_profile(""))
    path = collector_dir / name
    argv = ["verify", "--root", str(box.root), "--profile", prof, "--textfile", str(path)]
    assert main([*argv, "--json"]) == actions.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"host-tune: --textfile {path}: ") and reason in err
    assert not path.exists()


def test_a_write_that_fails_prints_one_line_no_json_and_leaves_no_temporary_file(
    box: Machine,
    write_profile: Callable[[str], Path],
    collector_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prof = str(write_profile(""))
    path = collector_dir / "taken.prom"
    path.mkdir()  # a directory where the file goes: the rename fails
    argv = ["verify", "--root", str(box.root), "--profile", prof, "--textfile", str(path)]
    assert main([*argv, "--json"]) == actions.EXIT_FAILED
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"host-tune: {path}")
    assert os.listdir(collector_dir) == [path.name]
