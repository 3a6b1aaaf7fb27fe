"""The engine server and the gateway as real processes for a test module, torn down with a check
that both exited cleanly."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from appliance.tools import processes
from tests.conftest import Tiny
from tests.support import until

MODEL = "tiny"


@dataclass
class Stack:
    address: str  # the gateway's
    config: Path
    log: Path  # the gateway's output
    gateway: subprocess.Popen[bytes] = field(repr=False)
    terminated: bool = False  # the test sent SIGTERM: teardown waits instead of sending another

    @property
    def gateway_pid(self) -> int:
        return self.gateway.pid

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def log_through(self, request_id: str) -> list[str]:
        """The gateway's log once it holds the access line of `request_id`. A writer thread
        writes the lines in the order they were logged, so every line before it is there too."""

        def written() -> list[str] | None:
            lines = self.log_lines()
            return lines if any(f"request_id={request_id!r}" in line for line in lines) else None

        return until(written, f"no access line for request {request_id!r} in {self.log}")

    def terminate(self) -> None:
        """SIGTERM to the gateway, once. A second SIGTERM that lands after the gateway's loop
        has closed, while the interpreter exits, ends it by the signal's default action."""
        self.terminated = True
        self.gateway.send_signal(signal.SIGTERM)


@contextmanager
def engine_and_gateway(
    tiny: Tiny,
    work: Path,
    edit_config: Callable[[str], str] = lambda text: text,
    stream_socket: bool = False,
) -> Iterator[Stack]:
    """`edit_config` rewrites the gateway's TOML (processes.write_gateway_config's) first. With
    `stream_socket` the gateway sends its generations to the engine's stream socket."""
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    gateway_addr = f"127.0.0.1:{processes.free_port()}"
    socket = work / "engine.sock" if stream_socket else None
    config = processes.write_gateway_config(
        work / "gateway.toml",
        gateway_addr,
        MODEL,
        engine_addr,
        tiny.tokenizer_dir,
        stream_socket=socket,
    )
    config.write_text(edit_config(config.read_text()))
    socket_args = [] if socket is None else ["--stream-socket", str(socket)]
    engine = processes.spawn(
        ["engine", "--repository", str(tiny.repo), "--listen", engine_addr, *socket_args],
        work / "engine.log",
    )
    gateway = processes.spawn(["serve", "--config", str(config)], work / "gateway.log")
    stack = Stack(gateway_addr, config, work / "gateway.log", gateway)
    try:
        processes.wait_serving(gateway_addr, gateway)
        yield stack
    finally:
        codes = processes.stop(gateway, signalled=stack.terminated), processes.stop(engine)
        assert codes == (0, 0), "\n".join(
            (
                f"exit statuses (gateway, engine): {codes}",
                (work / "gateway.log").read_text(errors="replace")[-2000:],
                "engine:",
                (work / "engine.log").read_text(errors="replace")[-2000:],
            )
        )
