"""A gateway whose stderr nobody reads (a journal that has stalled) keeps answering: its access
lines wait in memory, and every one of them comes out once stderr is read again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc

from appliance.tools import processes
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Tiny

MODEL = "tiny"
# Each answer logs an access line of about 300 bytes: this many fill a 64 KiB pipe several times.
REQUESTS = 600


def test_a_gateway_whose_stderr_is_not_read_keeps_answering(tiny: Tiny, tmp_path: Path) -> None:
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    gateway_addr = f"127.0.0.1:{processes.free_port()}"
    config = processes.write_gateway_config(
        tmp_path / "gateway.toml", gateway_addr, MODEL, engine_addr, tiny.tokenizer_dir
    )
    engine = processes.spawn(
        ["engine", "--repository", str(tiny.repo), "--listen", engine_addr],
        tmp_path / "engine.log",
    )
    gateway = subprocess.Popen(
        [sys.executable, "-m", "appliance", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    stderr = gateway.stderr
    assert stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(stderr.read().decode().splitlines()))
    try:
        processes.wait_serving(gateway_addr, gateway)
        with grpc.insecure_channel(gateway_addr) as channel:
            stub = pb_grpc.InferenceStub(channel)
            for n in range(REQUESTS):
                request = pb.GenerateRequest(model=MODEL, prompt=f"question {n % 5}", max_tokens=1)
                stub.Complete(request, timeout=10)
        reader.start()  # the journal catches up
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(timeout=30) == 0
        reader.join(30)
    finally:
        if gateway.poll() is None:
            gateway.kill()
        processes.stop(engine)
    access = [line for line in lines if " appliance.access " in line]
    assert len(access) == REQUESTS
    assert "gateway stopped" in lines[-1]
