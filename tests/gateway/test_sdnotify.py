"""systemd notify protocol: in-process against a datagram socket, and from a real gateway process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance import sdnotify
from appliance.tools import processes
from tests.conftest import Tiny
from tests.support import until


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


class Datagrams:
    """Reads every datagram on the socket in a thread, as systemd does, so no sender ever waits."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received: list[bytes] = []
        self._stop = threading.Event()
        sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.received.append(self.sock.recv(4096))
            except TimeoutError:
                continue
            except OSError:
                return

    def wait_for(self, predicate: Callable[[list[bytes]], bool], timeout_s: float = 60) -> None:
        until(
            lambda: predicate(list(self.received)),
            lambda: f"not received; got {self.received[-5:]}",
            timeout_s,
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def test_a_full_receiver_queue_never_blocks_the_sender(notify_socket: socket.socket) -> None:
    sent = [sdnotify.notify("WATCHDOG=1") for _ in range(200)]  # nobody reads
    assert sent[0] and not all(sent)


def test_gateway_process_ready_watchdog_stopping(
    tiny: Tiny, tmp_path: Path, notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    gateway_addr = f"127.0.0.1:{processes.free_port()}"
    config = processes.write_gateway_config(
        tmp_path / "g.toml", gateway_addr, "tiny", engine_addr, tiny.tokenizer_dir
    )
    notify_path = os.environ["NOTIFY_SOCKET"]
    monkeypatch.delenv("NOTIFY_SOCKET")  # only the gateway talks to this socket
    engine = processes.spawn(
        ["engine", "--repository", str(tiny.repo), "--listen", engine_addr], tmp_path / "e.log"
    )
    log = tmp_path / "g.log"
    gateway = subprocess.Popen(
        [sys.executable, "-m", "appliance", "serve", "--config", str(config)],
        env=dict(os.environ, NOTIFY_SOCKET=notify_path, WATCHDOG_USEC="200000"),
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    datagrams = Datagrams(notify_socket)
    try:
        datagrams.wait_for(lambda got: any(m.startswith(b"READY=1") for m in got))
        processes.wait_serving(gateway_addr, gateway, timeout_s=30)  # READY=1 means serving
        datagrams.wait_for(lambda got: got.count(b"WATCHDOG=1") >= 3)
        gateway.terminate()
        assert gateway.wait(timeout=30) == 0, log.read_text()[-3000:]
        datagrams.wait_for(lambda got: any(m.startswith(b"STOPPING=1") for m in got))
        ready = next(i for i, m in enumerate(datagrams.received) if m.startswith(b"READY=1"))
        assert all(not m.startswith(b"STOPPING") for m in datagrams.received[:ready])
    finally:
        datagrams.close()
        processes.stop(gateway)
        processes.stop(engine)
