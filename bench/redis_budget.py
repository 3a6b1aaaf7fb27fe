"""What time budget a healthy local Redis meets on the request path: the `[cache.redis] timeout_ms`
default comes from this measurement.

One run starts a real redis-server on 127.0.0.1, writes cached answers through the gateway's own
RedisTier, then looks them up through RedisTier.get (the call the gateway makes per request: pool,
GET, hiredis parse, entry decode, inside the tier's time budget) at an open-loop rate, in phases:

  idle    nothing else runs in this process or on the machine beyond what already does;
  loaded  the event loop also serves simulated streams (each builds protobuf messages every few ms,
          as the gateway does for token deltas) while N busy processes compete with redis-server
          and this process for the cores (one phase per N in --busy; N = the CPU count
          oversubscribes the machine: Redis waits for a core).

The measuring tier's budget is far above any candidate (10 s), so every lookup completes and its
latency is known; a lookup slower than a budget is the one that budget would have turned into a
miss. Per phase it prints P50/P99/P99.9/max and, for each candidate budget, that count.

    python -m bench.redis_budget [--rate 500] [--seconds 20] [--busy 1,2] [--budgets 5,10,20,50]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
import uvloop

from appliance.cache.entry import CachedAnswer
from appliance.cache.l2 import RedisSettings, RedisTier
from appliance.v1 import inference_pb2 as pb
from bench import record
from tests.cache.redis_server import RedisServer

KEYS = 2000
MEASURING_BUDGET_MS = 10_000.0


def _burn() -> None:
    """A process that keeps one core busy until it is terminated."""
    x = 0
    while True:
        x = (x * 31 + 7) % 1_000_003


@contextmanager
def busy_cores(n: int) -> Iterator[list[int]]:
    procs = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield [p.pid for p in procs if p.pid is not None]
    finally:
        for p in procs:
            p.terminate()
            p.join()


class Elsewhere:
    """Cores the rest of the machine kept busy (other work on a shared host), from the CPU time
    of the whole machine minus that of this benchmark's processes."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = [psutil.Process(pid) for pid in pids]
        self.started = time.monotonic()
        self.machine = self._machine()
        self.ours = self._ours()

    @staticmethod
    def _machine() -> float:
        t = psutil.cpu_times()
        return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))

    def _ours(self) -> float:
        return sum(sum(p.cpu_times()[:4]) for p in self.procs)

    def cores(self) -> float:
        seconds = time.monotonic() - self.started
        busy = (self._machine() - self.machine) - (self._ours() - self.ours)
        return max(0.0, busy / seconds)


async def stream(stop: asyncio.Event, every_s: float) -> None:
    """A token stream's share of the loop: one delta message built and serialized per step."""
    ids = list(range(8))
    while not stop.is_set():
        message = pb.GenerateResponse(request_id="r" * 32, text="token " * 4, token_ids=ids)
        message.SerializeToString()
        await asyncio.sleep(every_s)


async def lookups(tier: RedisTier, rate: float, seconds: float, seed: int) -> np.ndarray:
    """Lookups as Poisson arrivals at `rate` per second; returns each one's latency in ms."""
    rng = random.Random(seed)
    latencies: list[float] = []
    tasks: set[asyncio.Task[None]] = set()

    async def one(key: bytes) -> None:
        started = time.perf_counter_ns()
        hit = await tier.get("bench", "tiny", key)
        # A miss (a fault: every key is there) counts as a lookup that never answered.
        latencies.append((time.perf_counter_ns() - started) / 1e6 if hit else math.inf)

    loop = asyncio.get_running_loop()
    start = due = loop.time()
    while due < start + seconds:
        # Arrivals keep their schedule when the loop lags: late ones start at once.
        await asyncio.sleep(max(0.0, due - loop.time()))
        task = loop.create_task(one(_key(rng.randrange(KEYS))))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        due += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return np.array(latencies)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def report(name: str, ms: np.ndarray, budgets: list[float], elsewhere: float) -> None:
    p50, p99, p999 = np.percentile(ms, [50, 99, 99.9])  # a miss is inf: it is in every count
    print(
        f"| {name} | {elsewhere:.2f} | {len(ms)} | {p50:.3f} | {p99:.3f} | {p999:.3f} | "
        f"{ms.max():.3f} | " + " | ".join(str(int((ms > b).sum())) for b in budgets) + " |"
    )


async def run(args: argparse.Namespace, redis_pid: int, url: str, budgets: list[float]) -> None:
    tier = RedisTier(
        RedisSettings(
            url=url,
            timeout_ms=MEASURING_BUDGET_MS,
            key_prefix="bench",
            mac_key=b"bench-mac-key" * 3,
        )
    )
    answer = CachedAnswer(
        text="word " * 64, token_ids=tuple(range(64)), finish_reason="length",
        prompt_tokens=20, completion_tokens=64,
    )  # fmt: skip
    for i in range(KEYS):
        assert await tier.put("bench", "tiny", _key(i), answer)
    await lookups(tier, args.rate, 1.0, seed=0)  # warm the pool
    print(
        "| phase | cores busy elsewhere | lookups | P50 ms | P99 ms | P99.9 ms | max ms | "
        + " | ".join(f"> {b:g} ms" for b in budgets)
        + " |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(budgets))
    ours = [os.getpid(), redis_pid]
    elsewhere = Elsewhere(ours)
    idle = await lookups(tier, args.rate, args.seconds, seed=1)
    report("idle", idle, budgets, elsewhere.cores())
    for n, busy in enumerate(int(b) for b in args.busy.split(",")):
        stop = asyncio.Event()
        streams = [asyncio.create_task(stream(stop, 0.005)) for _ in range(args.streams)]
        with busy_cores(busy) as burners:
            elsewhere = Elsewhere(ours + burners)
            loaded = await lookups(tier, args.rate, args.seconds, seed=2 + n)
            outside = elsewhere.cores()
        stop.set()
        await asyncio.gather(*streams)
        report(f"loaded: {args.streams} streams, {busy} busy processes", loaded, budgets, outside)
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {' '.join(f.read().split()[:3])}")
    await tier.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=500.0, help="lookups per second (open loop)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds per phase")
    p.add_argument("--streams", type=int, default=32, help="simulated streams while loaded")
    p.add_argument("--busy", default="1,2", help="busy processes in each loaded phase")
    p.add_argument("--budgets", default="5,10,20,50", help="candidate budgets, ms")
    record.add_flag(p)
    args = p.parse_args()
    with record.recording("redis_budget", record.record_dir(args)):
        budgets = [float(b) for b in args.budgets.split(",")]
        with tempfile.TemporaryDirectory() as work:
            redis_server = RedisServer(Path(work))
            redis_server.start()
            try:
                print(
                    f"redis budget: {args.rate:g} lookups/s for {args.seconds:g} s per phase, "
                    f"{KEYS} keys, {os.cpu_count()} CPUs"
                )
                assert redis_server.proc is not None
                uvloop.run(run(args, redis_server.proc.pid, redis_server.url, budgets))
            finally:
                redis_server.kill()


if __name__ == "__main__":
    main()
