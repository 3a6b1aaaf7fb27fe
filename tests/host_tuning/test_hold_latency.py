"""hold-latency keeps its PM QoS file open (a write that is closed again does nothing)."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from host_tuning import holdlatency
from host_tuning.cli import main
from tests.support import until


def holders(path: Path, pid: int) -> int:
    """How many of ``pid``'s descriptors point at ``path``."""
    fd_dir = Path(f"/proc/{pid}/fd")
    count = 0
    for fd in fd_dir.iterdir():
        try:
            if os.readlink(fd) == str(path):
                count += 1
        except OSError:
            continue
    return count


def test_encode_is_native_s32() -> None:
    assert holdlatency.encode(5) == struct.pack("i", 5)
    with pytest.raises(ValueError):
        holdlatency.encode(-1)


def test_hold_keeps_fd_open_until_stopped(tmp_path: Path) -> None:
    dev = tmp_path / "cpu_dma_latency"
    dev.write_bytes(b"")
    stop = threading.Event()
    t = threading.Thread(target=holdlatency.hold, args=(3, str(dev), stop))
    t.start()
    try:
        until(lambda: dev.read_bytes() == struct.pack("i", 3), timeout=10.0)
        assert holders(dev, os.getpid()) == 1
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive() and holders(dev, os.getpid()) == 0


def test_cli_process_holds_and_exits_on_sigterm(tmp_path: Path) -> None:
    dev = tmp_path / "cpu_dma_latency"
    dev.write_bytes(b"")
    code = (
        "import sys; from host_tuning.cli import main; "
        f"sys.exit(main(['hold-latency', '--us', '7', '--path', {str(dev)!r}]))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        until(
            lambda: dev.read_bytes() == struct.pack("i", 7) and holders(dev, proc.pid) == 1,
            timeout=10.0,
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_refuses_a_bad_value_before_opening(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "cpu_dma_latency"
    target.write_bytes(b"")
    assert main(["hold-latency", "--us", "-5", "--path", str(target)]) == 2
    err = capsys.readouterr().err
    assert "hold-latency --us -5" in err and err.count("\n") == 1
    assert target.read_bytes() == b""
    assert main(["hold-latency", "--us", "5", "--path", str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err.startswith("host-tune: cannot open")
