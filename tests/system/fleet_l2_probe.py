"""Probes the L2 that a fleet's gateways share, until SIGTERM: each probe asks one gateway a
question nobody asked before (the engine answers it; the gateway stores it in L1 and L2), then the
other gateway the same question, which only L2 can answer from the cache. The gateways take turns.
One JSON line per probe on stdout: when the second request was sent, its cache tier and status.
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
            record: dict[str, object] = {}
            try:
                await generate(writer, request, timeout=60)
                record["sent"] = time.time()
                result = await generate(reader, request, timeout=60)
                record.update(status="OK", tier=pb.CacheTier.Name(result.final.cache_tier))
            except grpc.aio.AioRpcError as exc:
                record.update(sent=record.get("sent", time.time()), status=exc.code().name)
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
