"""What the OpenAI-compatible HTTP API adds over the gRPC API, for the same requests in the same run.

The engine server and the gateway (gRPC and HTTP listeners) run as real processes. One client process
sends the same completion request through both front ends, alternating request by request so drift
on a shared machine hits both alike:
  gRPC  Inference/Generate (grpc.aio), the text of each message
  HTTP  POST /v1/completions with stream=true and include_usage (aiohttp), each SSE event decoded
Two workloads: "miss" (cache_policy bypass: the engine generates every answer) and "hit" (the same
deterministic request: the L1 cache answers, so the front end's own cost is most of the TTFT).
Client side, genai-perf's definitions: TTFT = first non-empty text - request sent; per token =
(latency - TTFT) / (tokens - 1). Then, per front end in turn, the gateway process's CPU time per
request (psutil; waiting for a core on a busy machine is not counted).
Goal: HTTP TTFT P50 <= 1.3 x gRPC's.

    python -m bench.http [--requests 300] [--prompt-tokens 128] [--output-tokens 64]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Awaitable, Callable

import aiohttp
import grpc
import psutil
import uvloop

from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from bench import record
from bench.common import MODEL, pct, prompt_of, tiny_stack, workload_args

# (TTFT s, per-token s, completion tokens)
Sample = tuple[float, float, int]


async def via_grpc(stub: pb_grpc.InferenceStub, request: pb.GenerateRequest) -> Sample:
    sent = time.perf_counter()
    first = 0.0
    tokens = 0
    async for message in stub.Generate(request, timeout=60):
        if message.text and not first:
            first = time.perf_counter()
        if message.HasField("final"):
            tokens = message.final.usage.completion_tokens
    end = time.perf_counter()
    return first - sent, (end - first) / max(1, tokens - 1), tokens


async def via_http(session: aiohttp.ClientSession, url: str, body: bytes) -> Sample:
    sent = time.perf_counter()
    first = 0.0
    tokens = 0
    headers = {"Content-Type": "application/json"}
    async with session.post(url, data=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0]["text"] and not first:
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    return first - sent, (end - first) / max(1, tokens - 1), tokens


def bodies(prompt: str, output_tokens: int, hit: bool) -> tuple[pb.GenerateRequest, bytes]:
    policy = "default" if hit else "bypass"
    request = pb.GenerateRequest(
        model=MODEL,
        prompt=prompt,
        max_tokens=output_tokens,
        temperature=0,
        cache_policy=pb.CACHE_POLICY_DEFAULT if hit else pb.CACHE_POLICY_BYPASS,
    )
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "appliance": {"cache_policy": policy},
    }
    return request, json.dumps(body).encode()


async def run(args: argparse.Namespace) -> None:
    results: dict[str, dict[str, list[Sample]]] = {}
    cpu_us: dict[str, dict[str, float]] = {}
    # The access log is formatted per request; it is the same for both front ends, so it is off.
    with tiny_stack(args.model_root, http=True, access_log=False) as stack:
        url = f"http://{stack.http_addr}/v1/completions"
        prompt = prompt_of(stack.text, args.prompt_tokens)
        proc = psutil.Process(stack.gateway.pid)
        async with (
            grpc.aio.insecure_channel(stack.gateway_addr) as channel,
            aiohttp.ClientSession() as session,
        ):
            stub = pb_grpc.InferenceStub(channel)
            for workload in ("miss", "hit"):
                request, body = bodies(prompt, args.output_tokens, workload == "hit")
                front: dict[str, Callable[[], Awaitable[Sample]]] = {
                    "gRPC": functools.partial(via_grpc, stub, request),
                    "HTTP": functools.partial(via_http, session, url, body),
                }
                for _ in range(args.warmup):
                    for call in front.values():
                        await call()
                samples: dict[str, list[Sample]] = {name: [] for name in front}
                for _ in range(args.requests):
                    for name, call in front.items():
                        samples[name].append(await call())
                results[workload] = samples
                cpu_us[workload] = {}
                for name, call in front.items():
                    before = proc.cpu_times()
                    for _ in range(args.requests):
                        await call()
                    after = proc.cpu_times()
                    spent = (after.user + after.system) - (before.user + before.system)
                    cpu_us[workload][name] = spent / args.requests * 1e6
    report(args, results, cpu_us)


def report(
    args: argparse.Namespace,
    results: dict[str, dict[str, list[Sample]]],
    cpu_us: dict[str, dict[str, float]],
) -> None:
    print(
        f"\nHTTP vs gRPC: {args.requests} requests per front end and workload, prompt "
        f"{args.prompt_tokens} tokens, up to {args.output_tokens} output tokens"
    )
    print(
        "| workload | front end | TTFT P50 | TTFT P99 | per token P50 | per token mean | tokens "
        "| gateway CPU/request |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for workload, samples in results.items():
        for name, s in samples.items():
            ttft = [x[0] * 1e6 for x in s]
            per = [x[1] * 1e6 for x in s if x[2] > 1]
            tokens = sorted({x[2] for x in s})
            print(
                f"| {workload} | {name} | {pct(ttft, 0.5):.0f} µs | {pct(ttft, 0.99):.0f} µs | "
                f"{pct(per, 0.5):.1f} µs | {statistics.fmean(per) if per else 0:.1f} µs | "
                f"{tokens} | {cpu_us[workload][name]:.0f} µs |"
            )
    print()
    for workload, samples in results.items():
        g = pct([x[0] for x in samples["gRPC"]], 0.5)
        h = pct([x[0] for x in samples["HTTP"]], 0.5)
        g_tok = pct([x[1] for x in samples["gRPC"] if x[2] > 1], 0.5)
        h_tok = pct([x[1] for x in samples["HTTP"] if x[2] > 1], 0.5)
        print(
            f"{workload}: HTTP/gRPC TTFT P50 = {h / g:.2f} (goal <= 1.30); added TTFT P50 "
            f"{(h - g) * 1e6:.0f} µs; added per-token P50 {(h_tok - g_tok) * 1e6:.1f} µs; "
            f"gateway CPU per request HTTP - gRPC "
            f"{cpu_us[workload]['HTTP'] - cpu_us[workload]['gRPC']:.0f} µs"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    workload_args(parser, requests=300)
    record.add_flag(parser)
    args = parser.parse_args()
    with record.recording("http", record.record_dir(args)):
        uvloop.run(run(args))


if __name__ == "__main__":
    main()
