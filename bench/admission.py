"""Offered-load sweep: admission with budgets vs the same gateway letting every request through.

One engine server (the tiny model) and two gateways in front of it, run alternately at each load
level: "admission" (one slot, a short waiting line, a TTFT budget) and "no admission" (64 slots, a
64-deep line, no budget: every request reaches the engine, which queues them, as before admission
existed). Closed loop with 1, 2, 4, 8, 16 clients, then an open-loop Poisson rate. A refused client
waits the gateway's `grpc-retry-pushback-ms` hint before its next request (what gRPC's retry policy
does). Reported per level: admitted TTFT P50/P99, refusal rate, time-to-refuse P99, goodput
(requests that completed with TTFT within the budget, per second). A bare grpc.aio echo round trip
is measured in the same run: time-to-refuse P99 is compared with its P99.

    python -m bench.admission [--seconds 4] [--budget-ms 300] [--output-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import uvloop

from appliance.tools import processes
from appliance.tools.tiny_model import ensure_tiny_model
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from bench import record
from bench.echo_server import METHOD

MODEL = "tiny"


@dataclass
class Level:
    ttft_s: list[float] = field(default_factory=list)  # admitted, completed
    refuse_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    met_budget: int = 0
    seconds: float = 0.0

    @property
    def sent(self) -> int:
        return len(self.ttft_s) + len(self.refuse_s) + sum(self.errors.values())


def _config(
    path: Path, listen: str, engine: str, tok: Path, admission: bool, budget_ms: int
) -> Path:
    keys = (
        f"max_in_flight = 1\nmax_queue = 4\nttft_budget_ms = {budget_ms}\n"
        if admission
        else "max_in_flight = 64\nmax_queue = 64\n"
    )
    path.write_text(
        f'[server]\nlisten = "{listen}"\n\n[models.{MODEL}]\nbackend = "{engine}"\n'
        f'tokenizer_dir = "{tok}"\nmax_output_tokens = 256\n{keys}\n[cache]\nenabled = false\n'
    )
    return path


async def one(
    stub: pb_grpc.InferenceStub, request: pb.GenerateRequest, level: Level, budget_s: float
) -> float:
    """One request; returns how long to wait before the next (the pushback hint on a refusal)."""
    sent = time.perf_counter()
    first = 0.0
    try:
        async for message in stub.Generate(request, timeout=30):
            if not first and message.token_ids:
                first = time.perf_counter() - sent
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            level.refuse_s.append(time.perf_counter() - sent)
            hint = dict(exc.trailing_metadata() or ()).get("grpc-retry-pushback-ms", "0")
            return min(int(hint), 1000) / 1000
        level.errors[exc.code().name] = level.errors.get(exc.code().name, 0) + 1
        return 0.0
    level.ttft_s.append(first)
    level.met_budget += first <= budget_s
    return 0.0


async def closed_loop(
    stub: pb_grpc.InferenceStub,
    request: pb.GenerateRequest,
    clients: int,
    seconds: float,
    budget_s: float,
) -> Level:
    level = Level()
    end = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < end:
            pause = await one(stub, request, level, budget_s)
            if pause:
                await asyncio.sleep(pause)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    level.seconds = time.perf_counter() - started
    return level


async def open_loop(
    stub: pb_grpc.InferenceStub,
    request: pb.GenerateRequest,
    rate: float,
    seconds: float,
    budget_s: float,
    seed: int,
) -> Level:
    level = Level()
    rng = random.Random(seed)
    tasks = []
    started = time.perf_counter()
    t = 0.0
    while t < seconds:
        t += rng.expovariate(rate)
        delay = started + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(stub, request, level, budget_s)))
    await asyncio.gather(*tasks)
    level.seconds = time.perf_counter() - started
    return level


def ms(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q) * 1000:8.1f}" if values else "       -"


def row(name: str, load: str, level: Level) -> str:
    refused = len(level.refuse_s) / level.sent if level.sent else 0.0
    errors = ",".join(f"{k}:{v}" for k, v in level.errors.items()) or "0"
    return (
        f"| {name} | {load} | {level.sent} | {ms(level.ttft_s, 50)} | {ms(level.ttft_s, 99)} | "
        f"{refused:6.1%} | {ms(level.refuse_s, 99)} | {level.met_budget / level.seconds:6.1f} | {errors} |"
    )


async def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    _, repo = ensure_tiny_model(Path(args.model_root).resolve())
    tok = repo / "tensorrt_llm" / "tokenizer"
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    addrs = {m: f"127.0.0.1:{processes.free_port()}" for m in ("admission", "no admission")}
    echo_port = processes.free_port()
    engine = processes.spawn(
        ["engine", "--repository", str(repo), "--listen", engine_addr], work / "engine.log"
    )
    gateways = {
        m: processes.spawn(
            [
                "serve",
                "--config",
                str(
                    _config(
                        work / f"{i}.toml", a, engine_addr, tok, m == "admission", args.budget_ms
                    )
                ),
            ],
            work / f"gateway{i}.log",
        )
        for i, (m, a) in enumerate(addrs.items())
    }
    echo = subprocess.Popen([sys.executable, "-m", "bench.echo_server", "--port", str(echo_port)])
    budget_s = args.budget_ms / 1000
    request = pb.GenerateRequest(
        model=MODEL,
        prompt="Tell me about the appliance",
        max_tokens=args.output_tokens,
        temperature=0,
        cache_policy=pb.CACHE_POLICY_BYPASS,
    )
    rows: list[str] = []
    try:
        for m, a in addrs.items():
            processes.wait_serving(a, gateways[m])
        channels = {m: grpc.aio.insecure_channel(a) for m, a in addrs.items()}
        stubs = {m: pb_grpc.InferenceStub(c) for m, c in channels.items()}
        for stub in stubs.values():  # warm up, and let admission learn the engine's speed
            for _ in range(5):
                await one(stub, request, Level(), budget_s)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{echo_port}") as ech:
            echo_call = ech.unary_unary(METHOD)
            payload = request.SerializeToString()
            await echo_call(payload, wait_for_ready=True)
            echo_s = []
            for _ in range(300):
                t0 = time.perf_counter()
                await echo_call(payload)
                echo_s.append(time.perf_counter() - t0)
        single = Level()
        for _ in range(10):
            await one(stubs["no admission"], request, single, budget_s)
        for clients in (1, 2, 4, 8, 16):
            for m, stub in stubs.items():
                rows.append(
                    row(
                        m,
                        f"{clients} clients",
                        await closed_loop(stub, request, clients, args.seconds, budget_s),
                    )
                )
        rate = args.rate or 1.5 / max(np.median(single.ttft_s) * 4, 1e-3)
        for m, stub in stubs.items():
            rows.append(
                row(
                    m,
                    f"Poisson {rate:.0f}/s",
                    await open_loop(stub, request, rate, args.seconds, budget_s, seed=7),
                )
            )
        for c in channels.values():
            await c.close()
    finally:
        for g in gateways.values():
            processes.stop(g)
        processes.stop(engine)
        echo.terminate()
        echo.wait()
    print(
        f"\nadmission sweep: tiny model, {args.output_tokens} output tokens, TTFT budget {args.budget_ms} ms, "
        f"{args.seconds:g} s a level; unloaded TTFT P50 {np.median(single.ttft_s) * 1000:.1f} ms; "
        f"bare echo P50 {np.median(echo_s) * 1e6:.0f} µs, P99 {np.percentile(echo_s, 99) * 1e6:.0f} µs"
    )
    print(
        "| gateway | load | requests | admitted TTFT P50 ms | P99 ms | refused | time-to-refuse P99 ms | goodput/s | errors |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(r)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--budget-ms", type=int, default=300)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument(
        "--rate", type=float, default=0.0, help="Poisson rate; default: 1.5× one client's"
    )
    parser.add_argument("--model-root", default="var/tiny")
    record.add_flag(parser)
    args = parser.parse_args()
    with record.recording("admission", record.record_dir(args)):
        uvloop.run(run(args))


if __name__ == "__main__":
    main()
