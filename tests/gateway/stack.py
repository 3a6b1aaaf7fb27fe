"""The engine server and the gateway as real processes for a test module, torn down with a check
that both exited cleanly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from appliance.tools import processes
from tests.conftest import Tiny

MODEL = "tiny"


@dataclass(frozen=True)
class Stack:
    address: str  # the gateway's
    config: Path
    log: Path  # the gateway's output
    gateway_pid: int = 0

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()


@contextmanager
def engine_and_gateway(
    tiny: Tiny, work: Path, edit_config: Callable[[str], str] = lambda text: text
) -> Iterator[Stack]:
    """`edit_config` rewrites the gateway's TOML (processes.write_gateway_config's) first."""
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    gateway_addr = f"127.0.0.1:{processes.free_port()}"
    config = processes.write_gateway_config(
        work / "gateway.toml", gateway_addr, MODEL, engine_addr, tiny.tokenizer_dir
    )
    config.write_text(edit_config(config.read_text()))
    engine = processes.spawn(
        ["engine", "--repository", str(tiny.repo), "--listen", engine_addr], work / "engine.log"
    )
    gateway = processes.spawn(["serve", "--config", str(config)], work / "gateway.log")
    try:
        processes.wait_serving(gateway_addr, gateway)
        yield Stack(gateway_addr, config, work / "gateway.log", gateway.pid)
    finally:
        codes = processes.stop(gateway), processes.stop(engine)
        assert codes == (0, 0), "\n".join(
            (
                f"exit statuses (gateway, engine): {codes}",
                (work / "gateway.log").read_text(errors="replace")[-2000:],
                "engine:",
                (work / "engine.log").read_text(errors="replace")[-2000:],
            )
        )
