"""Probes the L2 that a fleet's gateways share, until SIGTERM: each probe asks one gateway a
question nobody asked before (the engine answers it; the gateway then writes it to L1 and, in the
background, to L2), then asks the other gateway the same question with cache_policy ONLY, which only
its L2 can answer, until it does or READ_WITHIN_S has passed (the write is not awaited by the first
answer). The gateways take turns. One JSON line per probe on stdout: when the first answer came,
the outcome of the last read (its cache tier, or NOT_FOUND) and how long the reads took.
Run inside the test's client network namespace."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
import uuid

import grpc

from appliance.client import connect, generate
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc

# Longer than a background write takes on a loaded host; during a Redis outage every probe ends
# here (its write failed too).
READ_WITHIN_S = 1.0


async def read_back(
    stub: pb_grpc.InferenceStub, request: pb.GenerateRequest, answered: float
) -> dict[str, object]:
    while True:
        try:
            result = await generate(stub, request, timeout=60)
            tier = pb.CacheTier.Name(result.final.cache_tier)
            return {
                "sent": answered,
                "status": "OK",
                "tier": tier,
                "read_s": time.time() - answered,
            }
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND or time.time() - answered > READ_WITHIN_S:
                return {
                    "sent": answered,
                    "status": exc.code().name,
                    "read_s": time.time() - answered,
                }
        await asyncio.sleep(0.02)


async def main(first: str, second: str, model: str, pause_s: float) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    (c1, s1), (c2, s2) = connect(first), connect(second)
    async with c1, c2:
        stubs = [s1, s2]
        n = 0
        while not stop.is_set():
            await asyncio.sleep(pause_s)
            writer, reader = stubs[n % 2], stubs[(n + 1) % 2]
            n += 1
            # Unrelated words each time: no earlier answer is similar enough for a semantic hit.
            prompt = f"Probe {uuid.uuid4().hex}: {uuid.uuid4().hex}"
            request = pb.GenerateRequest(model=model, prompt=prompt, max_tokens=4, temperature=0.0)
            try:
                await generate(writer, request, timeout=60)
            except grpc.aio.AioRpcError as exc:
                print(json.dumps({"sent": time.time(), "status": exc.code().name}), flush=True)
                continue
            answered = time.time()
            request.cache_policy = pb.CACHE_POLICY_ONLY
            record = await read_back(reader, request, answered)
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("first")
    p.add_argument("second")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--pause-ms", type=float, default=100.0, help="wait between probes")
    args = p.parse_args()
    asyncio.run(main(args.first, args.second, args.model, args.pause_ms / 1000))
    sys.exit(0)
