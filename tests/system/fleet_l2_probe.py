"""Probes each gateway's L2 writes, until SIGTERM: the gateways take turns; each turn first reads
the gateway's cache counters (CacheAdmin.Stats), then asks it a question nobody asked before, which
the engine answers and the gateway writes to L1 and, in the background, to L2. The counters read at
a gateway's next turn (PAUSE_S and a request later, past the write's time budget) include that
write's outcome. One JSON line per turn on stdout: when the counters were read, the gateway, its
successful L2 writes so far (writes less write_failures) and the question's status.
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

from appliance.client import generate
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc


async def main(addresses: list[str], model: str, pause_s: float) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        n = 0
        while not stop.is_set():
            await asyncio.sleep(pause_s)
            address, channel = addresses[n % len(addresses)], channels[n % len(channels)]
            n += 1
            record: dict[str, object] = {"at": time.time(), "gateway": address}
            try:
                stats = await pb_grpc.CacheAdminStub(channel).Stats(
                    pb.CacheStatsRequest(), timeout=10
                )
                counters = stats.counters
                record["l2_written"] = counters["writes"] - counters["write_failures"]
                # Unrelated words each time: no earlier answer is similar enough for a semantic hit.
                prompt = f"Probe {uuid.uuid4().hex}: {uuid.uuid4().hex}"
                request = pb.GenerateRequest(
                    model=model, prompt=prompt, max_tokens=4, temperature=0.0
                )
                await generate(pb_grpc.InferenceStub(channel), request, timeout=60)
                record["status"] = "OK"
            except grpc.aio.AioRpcError as exc:
                record["status"] = exc.code().name
            print(json.dumps(record), flush=True)
    finally:
        for channel in channels:
            await channel.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("addresses", nargs="+", help="HOST:PORT of each gateway")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--pause-ms", type=float, default=100.0, help="wait between turns")
    args = p.parse_args()
    asyncio.run(main(args.addresses, args.model, args.pause_ms / 1000))
    sys.exit(0)
