"""`appliance.tools.processes`: a server that exits before it serves is reported with its own
last words, not only its exit status."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.tools import processes


def test_a_process_that_exits_before_serving_is_reported_with_its_logs_last_line(
    tmp_path: Path,
) -> None:
    log = tmp_path / "gateway.log"
    proc = processes.spawn(["serve", "--config", str(tmp_path / "missing.toml")], log)
    proc.wait(timeout=60)
    address = f"127.0.0.1:{processes.free_port()}"
    with pytest.raises(RuntimeError) as failure:
        processes.wait_serving(address, proc, timeout_s=10, log=log)
    message = str(failure.value)
    assert f"exited with {proc.returncode}: " in message
    last = log.read_text().strip().splitlines()[-1]
    assert message.endswith(last) and "missing.toml" in last


def test_last_words_of_an_empty_or_missing_log(tmp_path: Path) -> None:
    empty = tmp_path / "empty.log"
    empty.write_text("\n")
    assert processes.last_words(empty) == "no output"
    assert processes.last_words(None) == "see its log"
    assert processes.last_words(tmp_path / "absent.log").startswith("its log ")
