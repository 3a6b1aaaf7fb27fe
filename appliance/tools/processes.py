"""Starting and stopping the engine server and the gateway as real processes (demo, bench, tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from appliance.client import ClientCredentials


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Runs `python -m appliance ARGS` with its output in log_path."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = log_path.open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "appliance", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )


def write_gateway_config(
    path: Path,
    listen: str,
    model: str,
    backend: str,
    tokenizer_dir: Path,
    ready_timeout_s: float = 60.0,
    http_listen: str | None = None,
    stream_socket: Path | None = None,
) -> Path:
    http = f'\n[http]\nlisten = "{http_listen}"\n' if http_listen else ""
    socket = f'stream_socket = "{stream_socket}"\n' if stream_socket else ""
    path.write_text(
        f"""# Written by the appliance for a local run.
[server]
listen = "{listen}"
drain_seconds = 5.0
{http}
[models.{model}]
backend = "{backend}"
tokenizer_dir = "{tokenizer_dir}"
max_output_tokens = 512
default_max_tokens = 64
ready_timeout_s = {ready_timeout_s}
{socket}"""
    )
    return path


def last_words(log: Path | None) -> str:
    """The last non-empty line of a process's log (its error, when it failed)."""
    if log is None:
        return "see its log"
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError as exc:
        return f"its log {log} unreadable: {exc.strerror}"
    return lines[-1] if lines else "no output"


def wait_serving(
    address: str,
    proc: subprocess.Popen[bytes] | None = None,
    timeout_s: float = 90.0,
    service: str = "",
    log: Path | None = None,
    credentials: ClientCredentials | None = None,
) -> None:
    """Waits until the gRPC health service says SERVING for `service` ("": the whole server);
    fails early if `proc` exits, with the last line of its `log`. RuntimeError says what was
    last seen. `credentials`: how to connect (None: plaintext, no key)."""
    deadline = time.monotonic() + timeout_s
    seen = "no answer"
    metadata = credentials.metadata if credentials is not None else ()
    if credentials is None or credentials.tls is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, credentials.tls, options=credentials.options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:  # at least one check, even with no time to wait
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"process {proc.args!r} exited with {proc.returncode}: {last_words(log)}"
                )
            try:
                reply = stub.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=1.0, metadata=metadata
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                seen = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                seen = f"{exc.code().name}: {exc.details()}"
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    raise RuntimeError(f"{address} not serving after {timeout_s:g} s (last: {seen})")


def wait_engine(
    address: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 300.0
) -> float:
    """Polls Triton's ModelReady until the engine server is ready; returns the seconds it took.
    Fails with the engine's own last words if it exits."""
    from tritonclient.grpc import service_pb2 as ts
    from tritonclient.grpc import service_pb2_grpc as ts_grpc

    started = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        stub = ts_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() - started < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"engine server exited with {proc.returncode}: {last_words(log)}"
                )
            try:
                if stub.ModelReady(ts.ModelReadyRequest(name="tensorrt_llm"), timeout=1.0).ready:
                    return time.monotonic() - started
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"engine server at {address} not ready after {timeout_s:g} s (log: {log})")


def wait_for_line(
    log: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0
) -> str:
    """The first line of a process's log that contains `text`, once written; fails with the
    process's last words if it exits first."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        for line in log.read_text(errors="replace").splitlines():
            if text in line:
                return line
        if proc.poll() is not None:
            raise RuntimeError(
                f"exited with {proc.returncode} before logging {text!r}: {last_words(log)}"
            )
        time.sleep(0.05)
    raise RuntimeError(f"no line with {text!r} in {log} after {timeout_s:g} s")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 15.0, signalled: bool = False) -> int:
    """SIGTERM (unless `signalled`: it was sent already), then SIGKILL after timeout_s; returns
    the exit status."""
    if proc.poll() is None:
        if not signalled:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
