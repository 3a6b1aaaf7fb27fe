"""Client load on a fleet through one `connect_fleet` channel, until SIGTERM: deterministic (repeated
questions, so cache hits too) and sampled requests from `--workers` closed-loop workers. Each
request is one JSON line on stdout: when it was sent (seconds since the epoch), TTFT, its kind and
its status (OK or the gRPC code); run inside the test's client network namespace."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

import grpc

from appliance.client import connect_fleet, generate
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc

QUESTIONS = [f"Question number {n}: what happens next?" for n in range(24)]


async def worker(
    n: int, stub: pb_grpc.InferenceStub, stop: asyncio.Event, model: str, pause_s: float
) -> None:
    k = n
    while not stop.is_set():
        await asyncio.sleep(
            pause_s
        )  # a client's think time: the hosts share two cores with the roll
        k += 2
        sampled = k % 3 == 0
        request = pb.GenerateRequest(
            model=model,
            prompt="Tell me a story" if sampled else QUESTIONS[k % len(QUESTIONS)],
            max_tokens=8,
            temperature=1.0 if sampled else 0.0,
        )
        sent = time.time()
        record: dict[str, object] = {"sent": sent, "kind": "sampled" if sampled else "greedy"}
        try:
            result = await generate(stub, request, timeout=60)
            record.update(status="OK", ttft=result.ttft_s, tier=result.final.cache_tier)
        except grpc.aio.AioRpcError as exc:
            record.update(status=exc.code().name, details=exc.details())
        print(json.dumps(record), flush=True)


async def main(addresses: str, workers: int, model: str, pause_s: float) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    channel, stub = connect_fleet(addresses)
    async with channel:
        await asyncio.gather(*(worker(n, stub, stop, model, pause_s) for n in range(workers)))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("addresses")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument(
        "--pause-ms", type=float, default=25.0, help="each worker's wait between requests"
    )
    args = p.parse_args()
    asyncio.run(main(args.addresses, args.workers, args.model, args.pause_ms / 1000))
    sys.exit(0)
