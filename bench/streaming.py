"""Streaming-path benchmark: what the gateway adds on top of the engine server, against a bare gRPC hop.

In one run, with the engine server and the gateway as real processes:
  (a) N streamed requests through the gateway (public API),
  (b) the same token ids straight to the engine server with the gateway's own Triton-protocol client,
  (c) a bare grpc.aio unary echo (separate process) of a payload the size of the request, as the floor,
  (d) the same echo through a bare grpc.aio relay (another process that only forwards the call): what
      any Python gRPC gateway adds, (d) - (c), before it does any work of its own,
  (e) the requests of (a) through a second gateway that sends them to the engine's stream socket
      (appliance/backends/stream_socket.py) instead of over gRPC.
(a) to (e) alternate request by request so drift on the machine hits all alike. Client-side TTFT and
inter-token latency use genai-perf's definitions (TTFT = first non-empty response - request sent;
inter-token = (latency - TTFT) / (tokens - 1) per request); "gap" is vLLM's pooled ITL.
Targets: added TTFT P99 <= echo P99; added inter-token P50 <= 50 µs.

    python -m bench.streaming [--requests 200] [--prompt-tokens 128] [--output-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import grpc
import uvloop

from appliance.backends.base import GREEDY, GenerationRequest
from appliance.backends.triton import TritonBackend
from appliance.client import generate, inter_token_latency
from appliance.tools import processes
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from bench import record
from bench.common import MODEL, pct, prompt_of, tiny_stack, workload_args
from bench.echo_server import METHOD


async def direct(
    backend: TritonBackend, ids: list[int], n_out: int, rid: str
) -> tuple[float, float, list[float], int]:
    sent = time.perf_counter()
    first = 0.0
    last = 0.0
    gaps: list[float] = []
    count = 0
    async for tokens in backend.stream(
        GenerationRequest(rid, ids, n_out, None, None, GREEDY, 60.0)
    ):
        now = time.perf_counter()
        if not first:
            first = now
        else:
            gaps.append(now - last)
        last = now
        count += len(tokens)
    end = time.perf_counter()
    ttft = first - sent
    itl = inter_token_latency(end - sent, ttft, count) or 0.0
    return ttft, itl, gaps, count


async def run(args: argparse.Namespace, engine_args: tuple[str, ...] = ()) -> dict[str, float]:
    """Runs the comparison and prints its table; returns P50/P99/mean of each row in µs.

    `engine_args` are extra `appliance engine` options (bench/gpu_decode.py adds --device cuda).
    """
    echo_port = processes.free_port()
    relay_port = processes.free_port()
    command = [sys.executable, "-m", "bench.echo_server", "--port"]
    echo = subprocess.Popen([*command, str(echo_port)])
    relay = subprocess.Popen([*command, str(relay_port), "--relay-to", str(echo_port)])
    try:
        with tiny_stack(args.model_root, engine_args=engine_args, stream_socket=True) as stack:
            assert stack.socket_gateway_addr is not None
            prompt = prompt_of(stack.text, args.prompt_tokens)
            ids = stack.text.encode_prompt(prompt)
            request = pb.GenerateRequest(
                model=MODEL,
                prompt=prompt,
                max_tokens=args.output_tokens,
                temperature=0,
                cache_policy=pb.CACHE_POLICY_BYPASS,
            )
            payload = request.SerializeToString()
            backend = TritonBackend(stack.engine_addr, "tensorrt_llm")
            await backend.wait_ready(30)
            async with (
                grpc.aio.insecure_channel(stack.gateway_addr) as gch,
                grpc.aio.insecure_channel(stack.socket_gateway_addr) as sch,
                grpc.aio.insecure_channel(f"127.0.0.1:{echo_port}") as ech,
                grpc.aio.insecure_channel(f"127.0.0.1:{relay_port}") as rch,
            ):
                stub = pb_grpc.InferenceStub(gch)
                socket_stub = pb_grpc.InferenceStub(sch)
                echo_call = ech.unary_unary(METHOD)
                relay_call = rch.unary_unary(METHOD)
                for _ in range(args.warmup):
                    await generate(stub, request)
                    await generate(socket_stub, request)
                    await direct(backend, ids, args.output_tokens, "warm")
                    await echo_call(payload, wait_for_ready=True)
                    await relay_call(payload, wait_for_ready=True)
                relayed_s: list[float] = []
                a_ttft, a_itl, a_gaps, b_ttft, b_itl, b_gaps, echo_s = [], [], [], [], [], [], []
                a_queue, a_server_ttft = [], []
                e_ttft, e_itl, e_queue, e_server_ttft = [], [], [], []
                lengths = set()
                for i in range(args.requests):
                    r = await generate(stub, request)
                    lengths.add(len(r.token_ids))
                    a_ttft.append(r.ttft_s)
                    a_itl.append(r.inter_token_s)
                    a_gaps.extend(r.gaps_s)
                    a_queue.append(r.final.timings.queue_us / 1e6)
                    a_server_ttft.append(r.final.timings.ttft_us / 1e6)
                    r = await generate(socket_stub, request)
                    lengths.add(len(r.token_ids))
                    e_ttft.append(r.ttft_s)
                    e_itl.append(r.inter_token_s)
                    e_queue.append(r.final.timings.queue_us / 1e6)
                    e_server_ttft.append(r.final.timings.ttft_us / 1e6)
                    ttft, itl, gaps, count = await direct(backend, ids, args.output_tokens, f"b{i}")
                    lengths.add(count)
                    b_ttft.append(ttft)
                    b_itl.append(itl)
                    b_gaps.extend(gaps)
                    t0 = time.perf_counter()
                    await echo_call(payload)
                    echo_s.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    await relay_call(payload)
                    relayed_s.append(time.perf_counter() - t0)
            await backend.close()
    finally:
        for server in (relay, echo):
            server.terminate()
            server.wait()

    us = 1e6
    results: dict[str, float] = {}

    def row(name: str, values: list[float]) -> str:
        p50, p99, mean = (
            pct(values, 0.5) * us,
            pct(values, 0.99) * us,
            statistics.fmean(values) * us,
        )
        results.update({f"{name} P50": p50, f"{name} P99": p99, f"{name} mean": mean})
        return f"| {name} | {p50:9.1f} | {p99:9.1f} | {mean:9.1f} |"

    print(
        f"\nstreaming path: {args.requests} requests, prompt {len(ids)} tokens, output {sorted(lengths)} tokens, payload {len(payload)} B"
    )
    print("| measure (µs) | P50 | P99 | mean |\n|---|---:|---:|---:|")
    print(row("(a) TTFT via gateway", a_ttft))
    print(row("(b) TTFT direct to engine", b_ttft))
    print(row("(e) TTFT via gateway, stream socket", e_ttft))
    print(row("(a) inter-token via gateway", a_itl))
    print(row("(b) inter-token direct", b_itl))
    print(row("(e) inter-token via gateway, stream socket", e_itl))
    print(row("(a) chunk gap via gateway (pooled)", a_gaps))
    print(row("(b) chunk gap direct (pooled)", b_gaps))
    print(row("(c) bare grpc.aio unary echo", echo_s))
    print(row("(d) the echo through a bare grpc.aio relay", relayed_s))
    print(row("(a) gateway-side: arrival → engine request sent", a_queue))
    print(row("(a) gateway-side: arrival → first token sent", a_server_ttft))
    print(row("(e) gateway-side: arrival → engine request sent", e_queue))
    print(row("(e) gateway-side: arrival → first token sent", e_server_ttft))
    added_ttft_p99 = (pct(a_ttft, 0.99) - pct(b_ttft, 0.99)) * us
    added_itl_p50 = (pct(a_itl, 0.5) - pct(b_itl, 0.5)) * us
    echo_p99 = pct(echo_s, 0.99) * us
    relay_added_p99 = (pct(relayed_s, 0.99) - pct(echo_s, 0.99)) * us
    results["relay added P99"] = relay_added_p99
    print(
        f"\nadded TTFT P99 (a-b): {added_ttft_p99:.1f} µs vs echo P99 {echo_p99:.1f} µs "
        f"-> ratio {added_ttft_p99 / echo_p99:.2f} (target <= 1.00)"
    )
    print(
        f"a bare relay adds at P99 (d-c): {relay_added_p99:.1f} µs "
        f"({relay_added_p99 / echo_p99:.2f} × the echo's P99); the gateway adds "
        f"{added_ttft_p99 - relay_added_p99:.1f} µs more"
    )
    print(f"added inter-token P50 (a-b): {added_itl_p50:.1f} µs (target <= 50 µs)")
    socket_ttft_p99 = (pct(e_ttft, 0.99) - pct(b_ttft, 0.99)) * us
    socket_itl_p50 = (pct(e_itl, 0.5) - pct(b_itl, 0.5)) * us
    results["socket added TTFT P99"] = socket_ttft_p99
    results["socket added inter-token P50"] = socket_itl_p50
    print(
        f"over the stream socket: added TTFT P99 (e-b) {socket_ttft_p99:.1f} µs -> ratio "
        f"{socket_ttft_p99 / echo_p99:.2f}; added inter-token P50 (e-b) {socket_itl_p50:.1f} µs"
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    workload_args(parser, requests=200)
    record.add_flag(parser)
    args = parser.parse_args()
    with record.recording("streaming", record.record_dir(args)):
        uvloop.run(run(args))


if __name__ == "__main__":
    main()
