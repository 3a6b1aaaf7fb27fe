"""Upgrading one host of two under load: failed requests with and without draining first, for a
client that balances on health (connect_fleet) and for a plain round_robin client (the baseline).

Two hosts, each an engine server (the tiny model) and a gateway, as processes on loopback. Two
closed-loop clients send sampled requests (always the engine, 16 tokens) through one channel to
both gateways. In each phase host a is upgraded once while the load runs. "restart" is what the
role's handlers did before the drain step: the engine server restarts (stop, start, ready), then
the gateway (SIGTERM drains it, start, warm-up, SERVING). "drain, restart" is what they do now:
SIGUSR1 to the gateway and wait for its `drained` line, stop the gateway, restart the engine
server, start the gateway. Reported per phase: requests, failures by status, TTFT P50/P99.

    python -m bench.fleet_restart [--settle-s 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from appliance.client import connect_fleet, fleet_target, generate
from appliance.tools import processes
from appliance.tools.tiny_model import ensure_tiny_model
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from bench import record

MODEL = "tiny"


@dataclass
class Phase:
    ttft_s: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)


def plain_channel(addresses: list[str]) -> tuple[grpc.aio.Channel, pb_grpc.InferenceStub]:
    """round_robin with no health checking and no retries: the baseline client."""
    config = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
    channel = grpc.aio.insecure_channel(
        fleet_target(addresses),
        options=[("grpc.service_config", config), ("grpc.enable_retries", 0)],
    )
    return channel, pb_grpc.InferenceStub(channel)


async def load(stub: pb_grpc.InferenceStub, stop: asyncio.Event, phase: Phase) -> None:
    while not stop.is_set():
        request = pb.GenerateRequest(model=MODEL, prompt="Tell me", max_tokens=16, temperature=1)
        try:
            result = await generate(stub, request, timeout=30)
            phase.ttft_s.append(result.ttft_s)
        except grpc.aio.AioRpcError as exc:
            phase.failures[exc.code().name] += 1
        await asyncio.sleep(0.01)


class Host:
    """An engine server and its gateway, each restartable (logs numbered by start)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        _, self.repo = ensure_tiny_model(work / "tiny")
        self.engine_address = f"127.0.0.1:{processes.free_port()}"
        self.address = f"127.0.0.1:{processes.free_port()}"
        self.config = processes.write_gateway_config(
            work / "gateway.toml",
            self.address,
            MODEL,
            self.engine_address,
            self.repo / "tensorrt_llm" / "tokenizer",
        )
        self.starts = 0
        self.engine = self.start_engine()
        self.gateway = self.start_gateway()

    def start_engine(self) -> subprocess.Popen[bytes]:
        self.starts += 1
        log = self.work / f"engine-{self.starts}.log"
        argv = ["engine", "--repository", str(self.repo), "--listen", self.engine_address]
        proc = processes.spawn(argv, log)
        processes.wait_engine(self.engine_address, proc, log)
        return proc

    def start_gateway(self) -> subprocess.Popen[bytes]:
        self.log = self.work / f"gateway-{self.starts}.log"
        proc = processes.spawn(["serve", "--config", str(self.config)], self.log)
        processes.wait_serving(self.address, proc)
        return proc

    def upgrade(self, drain_first: bool) -> None:
        if not drain_first:  # the handlers before the drain step: engine, then gateway
            processes.stop(self.engine)
            self.engine = self.start_engine()
            assert processes.stop(self.gateway) == 0
            self.gateway = self.start_gateway()
            return
        os.kill(self.gateway.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while " drained: " not in self.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes.stop(self.gateway) == 0
        processes.stop(self.engine)
        self.engine = self.start_engine()
        self.gateway = self.start_gateway()

    def stop(self) -> None:
        processes.stop(self.gateway)
        processes.stop(self.engine)


async def phase(hosts: list[Host], fleet_client: bool, drain_first: bool, settle_s: float) -> Phase:
    addresses = [h.address for h in hosts]
    channel, stub = connect_fleet(addresses) if fleet_client else plain_channel(addresses)
    result = Phase()
    stop = asyncio.Event()
    async with channel:
        workers = [asyncio.ensure_future(load(stub, stop, result)) for _ in range(2)]
        await asyncio.sleep(settle_s)
        await asyncio.to_thread(hosts[0].upgrade, drain_first)
        await asyncio.sleep(settle_s)
        stop.set()
        await asyncio.gather(*workers)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settle-s", type=float, default=3.0, help="load before and after the restart")
    record.add_flag(p)
    args = p.parse_args()
    with record.recording("fleet_restart", record.record_dir(args)):
        work = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
        hosts: list[Host] = []
        try:
            for n in range(2):
                (work / f"host-{n}").mkdir()
                hosts.append(Host(work / f"host-{n}"))
            print(
                "| client | upgrade of one host | requests | failed | TTFT P50 ms | TTFT P99 ms |"
            )
            print("|---|---|---:|---|---:|---:|")
            for fleet_client in (False, True):
                for drain_first in (False, True):
                    r = asyncio.run(phase(hosts, fleet_client, drain_first, args.settle_s))
                    ttft = np.percentile(np.array(r.ttft_s) * 1000, [50, 99])
                    failed = ", ".join(f"{n} {code}" for code, n in r.failures.items()) or "0"
                    print(
                        f"| {'connect_fleet (health, retry)' if fleet_client else 'round_robin'}"
                        f" | {'drain, restart' if drain_first else 'restart'}"
                        f" | {len(r.ttft_s) + r.failures.total()} | {failed}"
                        f" | {ttft[0]:.1f} | {ttft[1]:.1f} |",
                        flush=True,
                    )
        finally:
            for h in hosts:
                h.stop()


if __name__ == "__main__":
    main()
