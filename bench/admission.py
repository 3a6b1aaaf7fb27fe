"""Offered-load sweep: admission with budgets vs the same gateway letting every request through.

One engine server (the tiny model) and two gateways in front of it, run alternately at each load
level: "admission" (one slot, a short waiting line, a TTFT budget) and "no admission" (64 slots, a
64-deep line, no budget: every request reaches the engine, which queues them, as before admission
existed). Closed loop with 1, 2, 4, 8, 16 clients, then an open-loop Poisson rate. A refused client
waits the gateway's `grpc-retry-pushback-ms` hint before its next request (what gRPC's retry policy
does). Reported per level: admitted TTFT P50/P99; the requests refused at arrival (a full line,
or a wait estimated past the budget) and their time-to-refuse P99; the requests refused after
waiting in the line (the estimate let them in, then their budget passed: what a good estimate
keeps rare); goodput (requests that completed with TTFT within the budget, per second).

A refusal's time under load is compared with a baseline under the same load: while each level
runs, a probe in the same client process makes a bare grpc.aio echo round trip every 5 ms and,
against the admission gateway, right after it a request that can only be refused by the estimate
(a 1 ms TTFT budget, one token). The clients' own refusals come in bursts (refused clients retry
together after their hints), so their P99 holds the queueing of the burst too; the probe's
refusal against the probe's echo is the gateway's refusal path against a bare round trip. The
admission gateway's own time for its refusals (its access log) is printed at the end.

    python -m bench.admission [--seconds 4] [--budget-ms 300] [--output-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

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
    refuse_s: list[float] = field(default_factory=list)  # at arrival: line full, or by estimate
    refuse_in_line_s: list[float] = field(default_factory=list)  # waited, then its budget passed
    errors: dict[str, int] = field(default_factory=dict)
    # Bare echo round trips from the same client process while the level runs: the baseline a
    # refusal's time is compared with under the same load (client, gateway and engine share cores).
    echo_s: list[float] = field(default_factory=list)
    # A request the gateway can only refuse (a 1 ms TTFT budget while the engine is busy), sent by
    # the same probe after each echo: a refusal by estimate, at the probe's pace, not in a burst.
    probe_refuse_s: list[float] = field(default_factory=list)
    met_budget: int = 0
    seconds: float = 0.0

    @property
    def sent(self) -> int:
        refused = len(self.refuse_s) + len(self.refuse_in_line_s)
        return len(self.ttft_s) + refused + sum(self.errors.values())


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
            # A waiter the line let go says how long it "waited"; a refusal at arrival does not.
            in_line = "waited" in (exc.details() or "")
            (level.refuse_in_line_s if in_line else level.refuse_s).append(
                time.perf_counter() - sent
            )
            hint = dict(exc.trailing_metadata() or ()).get("grpc-retry-pushback-ms", "0")
            return min(int(hint), 1000) / 1000
        level.errors[exc.code().name] = level.errors.get(exc.code().name, 0) + 1
        return 0.0
    level.ttft_s.append(first)
    level.met_budget += first <= budget_s
    return 0.0


Echo: TypeAlias = grpc.aio.UnaryUnaryMultiCallable


class Probe:
    """One echo round trip every 5 ms and, where the gateway refuses by estimate, a request that
    can only be refused right after it; their times go to the level."""

    def __init__(self, echo: Echo, payload: bytes, refused: pb_grpc.InferenceStub | None) -> None:
        self.echo, self.payload, self.refused = echo, payload, refused

    async def run(self, request: pb.GenerateRequest, level: Level, stop: asyncio.Event) -> None:
        doomed = pb.GenerateRequest()
        doomed.CopyFrom(request)
        doomed.max_tokens, doomed.ttft_budget_ms = 1, 1
        while not stop.is_set():
            t0 = time.perf_counter()
            await self.echo(self.payload)
            level.echo_s.append(time.perf_counter() - t0)
            if self.refused is not None:
                t0 = time.perf_counter()
                try:
                    await self.refused.Complete(doomed, timeout=30)
                except grpc.aio.AioRpcError as exc:
                    at_once = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    if at_once and "waited" not in (exc.details() or ""):
                        level.probe_refuse_s.append(time.perf_counter() - t0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.005)


async def probed(
    probe: Probe, request: pb.GenerateRequest, level: Level, load: Awaitable[object]
) -> Level:
    """`load` run with the probe beside it; the level with its time and the probe's samples."""
    stop = asyncio.Event()
    task = asyncio.ensure_future(probe.run(request, level, stop))
    started = time.perf_counter()
    try:
        await load
    finally:
        level.seconds = time.perf_counter() - started
        stop.set()
        await task
    return level


async def closed_loop(
    stub: pb_grpc.InferenceStub,
    request: pb.GenerateRequest,
    clients: int,
    seconds: float,
    budget_s: float,
    probe: Probe,
) -> Level:
    level = Level()
    end = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < end:
            pause = await one(stub, request, level, budget_s)
            if pause:
                await asyncio.sleep(pause)

    load = asyncio.gather(*(client() for _ in range(clients)))
    return await probed(probe, request, level, load)


async def open_loop(
    stub: pb_grpc.InferenceStub,
    request: pb.GenerateRequest,
    rate: float,
    seconds: float,
    budget_s: float,
    seed: int,
    probe: Probe,
) -> Level:
    level = Level()
    rng = random.Random(seed)

    async def arrivals() -> None:
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

    return await probed(probe, request, level, arrivals())


def refusal_ms(log: Path) -> list[float]:
    """total_ms of each RESOURCE_EXHAUSTED access line in a gateway's log: its own time for a
    refusal, from the request's arrival to its answer."""
    found = re.finditer(r"status=RESOURCE_EXHAUSTED .*total_ms=([0-9.]+)", log.read_text())
    return [float(m.group(1)) for m in found]


def ms(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q) * 1000:8.1f}" if values else "       -"


def row(name: str, load: str, level: Level) -> str:
    sent = max(level.sent, 1)
    at_arrival, in_line = len(level.refuse_s) / sent, len(level.refuse_in_line_s) / sent
    errors = ",".join(f"{k}:{v}" for k, v in level.errors.items()) or "0"
    return (
        f"| {name} | {load} | {level.sent} | {ms(level.ttft_s, 50)} | {ms(level.ttft_s, 99)} | "
        f"{at_arrival:6.1%} | {ms(level.refuse_s, 99)} | {ms(level.probe_refuse_s, 99)} | "
        f"{ms(level.echo_s, 99)} | {in_line:6.1%} | "
        f"{level.met_budget / level.seconds:6.1f} | {errors} |"
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
        echo_channel = grpc.aio.insecure_channel(f"127.0.0.1:{echo_port}")
        echo_call = echo_channel.unary_unary(METHOD)
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
        probes = {
            m: Probe(echo_call, payload, stub if m == "admission" else None)
            for m, stub in stubs.items()
        }
        for clients in (1, 2, 4, 8, 16):
            for m, stub in stubs.items():
                level = await closed_loop(stub, request, clients, args.seconds, budget_s, probes[m])
                rows.append(row(m, f"{clients} clients", level))
        rate = args.rate or 1.5 / max(np.median(single.ttft_s) * 4, 1e-3)
        for m, stub in stubs.items():
            level = await open_loop(
                stub, request, rate, args.seconds, budget_s, seed=7, probe=probes[m]
            )
            rows.append(row(m, f"Poisson {rate:.0f}/s", level))
        await echo_channel.close()
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
        "| gateway | load | requests | admitted TTFT P50 ms | P99 ms | refused at arrival "
        "| its time-to-refuse P99 ms | probe's refusal P99 ms | probe's echo P99 ms "
        "| refused after waiting | goodput/s | errors |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(r)
    own = refusal_ms(work / "gateway0.log")
    if own:
        print(
            f"the admission gateway's own time for its {len(own)} refusals (access log total_ms, "
            f"every level): P50 {np.percentile(own, 50):.2f} ms, P99 {np.percentile(own, 99):.2f} ms"
        )


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
