"""systemd notify protocol: in-process against a datagram socket, and from a real gateway process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance import processes, sdnotify
from tests.conftest import Tiny


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(60)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def test_notify_sends_one_datagram(notify_socket: socket.socket) -> None:
    assert sdnotify.notify("READY=1", "STATUS=ok")
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=ok"


def test_abstract_socket_names(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"appliance-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("WATCHDOG=1")
        assert sock.recv(64) == b"WATCHDOG=1"


def test_no_systemd_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not sdnotify.notify("READY=1")


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert sdnotify.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert sdnotify.watchdog_interval() is None


def test_gateway_process_ready_watchdog_stopping(
    tiny: Tiny, tmp_path: Path, notify_socket: socket.socket
) -> None:
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    gateway_addr = f"127.0.0.1:{processes.free_port()}"
    config = processes.write_gateway_config(
        tmp_path / "g.toml", gateway_addr, "tiny", engine_addr, tiny.tokenizer_dir
    )
    engine = processes.spawn(
        ["engine", "--repository", str(tiny.repo), "--listen", engine_addr], tmp_path / "e.log"
    )
    env = dict(os.environ, WATCHDOG_USEC="200000")
    log = tmp_path / "g.log"
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "appliance",
            "--log-level",
            "debug",
            "serve",
            "--config",
            str(config),
        ],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        messages = []
        while not any(m.startswith(b"READY=1") for m in messages):
            messages.append(notify_socket.recv(4096))
        processes.wait_serving(gateway_addr, gateway, timeout_s=30)  # READY=1 means serving
        pings = 0
        while pings < 3:
            pings += notify_socket.recv(4096) == b"WATCHDOG=1"
        gateway.terminate()
        while (message := notify_socket.recv(4096)) == b"WATCHDOG=1":
            pass
        assert message.startswith(b"STOPPING=1")
        assert gateway.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        processes.stop(gateway)
        processes.stop(engine)
