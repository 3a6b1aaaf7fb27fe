"""Helpers shared by the benchmarks."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from appliance.text.tokenizer import ModelText
from appliance.tools import processes
from appliance.tools.tiny_model import ensure_tiny_model
from tests.cache.redis_server import RedisServer


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of values, numpy's linear interpolation; NaN when there are none."""
    return float(np.percentile(values, q * 100)) if len(values) else float("nan")


def workload_args(parser: argparse.ArgumentParser, requests: int) -> None:
    """The options of the benchmarks that stream one fixed request through the gateway."""
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--model-root", default="var/tiny")


MODEL = "tiny"


def prompt_of(text: ModelText, n: int) -> str:
    """A prompt of exactly n tokens (BOS included) for this tokenizer."""
    words = [
        "the",
        "gateway",
        "streams",
        "tokens",
        "from",
        "the",
        "engine",
        "server",
        "over",
        "grpc",
    ]
    out: list[str] = []
    while len(text.encode_prompt(" ".join(out))) < n:
        out.append(words[len(out) % len(words)])
    while len(text.encode_prompt(" ".join(out))) > n:
        out.pop()
    return " ".join(out)


@dataclass
class TinyStack:
    """An engine server and a gateway serving the tiny model, as real processes."""

    work: Path
    repo: Path
    text: ModelText
    engine_addr: str
    gateway_addr: str
    http_addr: str | None
    gateway: subprocess.Popen[bytes]
    # A second gateway on the same engine that sends its generations to the engine's stream
    # socket (tiny_stack's `stream_socket`).
    socket_gateway_addr: str | None = None


def _no_access_log(config: Path) -> None:
    config.write_text(config.read_text().replace("[server]\n", "[server]\naccess_log = false\n"))


@contextmanager
def tiny_stack(
    model_root: str,
    *,
    http: bool = False,
    access_log: bool = True,
    engine_args: Sequence[str] = (),
    stream_socket: bool = False,
) -> Iterator[TinyStack]:
    """Starts both processes, waits until the gateway serves, and stops both on the way out (their
    logs stay in the temporary `work` directory). With `stream_socket` the engine also serves
    its stream socket, and a second gateway sends its generations there."""
    work = Path(tempfile.mkdtemp(prefix="bench-"))
    _, repo = ensure_tiny_model(Path(model_root))
    tok_dir = (repo / "tensorrt_llm" / "tokenizer").resolve()
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    gateway_addr = f"127.0.0.1:{processes.free_port()}"
    http_addr = f"127.0.0.1:{processes.free_port()}" if http else None
    config = processes.write_gateway_config(
        work / "g.toml", gateway_addr, MODEL, engine_addr, tok_dir, http_listen=http_addr
    )
    if not access_log:
        _no_access_log(config)
    socket = work / "engine.sock"
    socket_args = ["--stream-socket", str(socket)] if stream_socket else []
    with ExitStack() as stack:
        engine = processes.spawn(
            [
                "engine",
                "--repository",
                str(repo),
                "--listen",
                engine_addr,
                *socket_args,
                *engine_args,
            ],
            work / "engine.log",
        )
        stack.callback(processes.stop, engine)
        gateway = processes.spawn(["serve", "--config", str(config)], work / "gateway.log")
        stack.callback(processes.stop, gateway)
        socket_gateway_addr = None
        if stream_socket:
            socket_gateway_addr = f"127.0.0.1:{processes.free_port()}"
            socket_config = processes.write_gateway_config(
                work / "g-socket.toml",
                socket_gateway_addr,
                MODEL,
                engine_addr,
                tok_dir,
                stream_socket=socket,
            )
            if not access_log:
                _no_access_log(socket_config)
            socket_gateway = processes.spawn(
                ["serve", "--config", str(socket_config)], work / "gateway-socket.log"
            )
            stack.callback(processes.stop, socket_gateway)
            processes.wait_serving(
                socket_gateway_addr, socket_gateway, log=work / "gateway-socket.log"
            )
        processes.wait_serving(gateway_addr, gateway, log=work / "gateway.log")
        yield TinyStack(
            work,
            repo,
            ModelText.load(tok_dir),
            engine_addr,
            gateway_addr,
            http_addr,
            gateway,
            socket_gateway_addr,
        )


@contextmanager
def run_dir(name: str) -> Iterator[Path]:
    """A run's working directory (configs, process logs): removed when the run succeeds, kept and
    named when it fails, so the processes' logs can be read."""
    work = Path(tempfile.mkdtemp(prefix=name.replace(".", "-").replace("_", "-") + "-"))
    try:
        yield work
    except BaseException:
        print(f"{name} failed; process logs in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)


@dataclass
class SharedBackends:
    """A redis-server and the engine server, both real processes, for benches that start their
    own gateways on them."""

    redis: RedisServer
    redis_pid: int
    engine_addr: str
    engine: subprocess.Popen[bytes]


def start_redis_and_engine(stack: ExitStack, work: Path, repo: Path) -> SharedBackends:
    """Starts both with their logs in `work`; `stack` stops the engine and kills Redis."""
    redis_server = RedisServer(work)
    stack.callback(redis_server.kill)
    redis_server.start()
    assert redis_server.proc is not None
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    engine = processes.spawn(
        ["engine", "--repository", str(repo), "--listen", engine_addr], work / "engine.log"
    )
    stack.callback(processes.stop, engine)
    return SharedBackends(redis_server, redis_server.proc.pid, engine_addr, engine)
