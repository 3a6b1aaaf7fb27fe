"""KV-cache reuse and decode-speed benchmark of the engine server, on a real checkpoint.

(A) TTFT of a request whose first `--prefix-tokens` tokens (a shared document) were computed by an
    earlier request, against the same request with reuse off. One `appliance engine` process serves
    the checkpoint twice from one repository: model `reuse` (enable_kv_cache_reuse true) and model
    `plain` (false). Each round uses a fresh document: one request on `reuse` computes it, then the
    measured request (document + a different question) goes to `reuse` and `plain`, in alternating
    order. TTFT = first non-empty response - request sent (genai-perf), over gRPC on loopback.
(B) Decode tokens/s of the engine's decoder (its generate loop on the runner's preallocated cache)
    against transformers' `generate` on the same checkpoint, same dtype (float32) and torch
    threads, greedy, alternating. Tokens/s = (tokens - 1) / (last token - first token).
Goals: (A) TTFT >= 5x lower with reuse; (B) >= 2x transformers' tokens/s.

    python -m bench.prefix_reuse [--checkpoint var/smollm2/model] [--threads 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.backends import wire
from appliance.engine.llama import LlamaModel
from appliance.engine.sampling import SamplingParams, generate
from appliance.tools import processes
from bench import record
from bench.common import pct
from engine_build.hf_config import read_config
from engine_build.repo import write_hf_repository

TRITON_MODEL = "tensorrt_llm"


def write_repository(checkpoint: Path, dest: Path) -> Path:
    """The checkpoint's repository, with its model twice: `reuse` and `plain`."""
    repo = write_hf_repository(checkpoint, dest / "repo", guided_decoding=False)
    source = repo / TRITON_MODEL
    for name, reuse in (("reuse", "true"), ("plain", "false")):
        shutil.copytree(source, repo / name)
        config = text_format.Parse((source / "config.pbtxt").read_text(), mc.ModelConfig())
        config.name = name
        config.parameters["enable_kv_cache_reuse"].string_value = reuse
        # engine-build declares return_perf_metrics and kv_cache_reused_blocks on every model.
        (repo / name / "config.pbtxt").write_text(text_format.MessageToString(config))
    shutil.rmtree(source)
    return repo


def infer_request(model: str, ids: list[int], rid: str) -> ts.ModelInferRequest:
    req = ts.ModelInferRequest(model_name=model, id=rid)
    for name, dtype, values in (
        ("input_ids", "INT32", ids),
        ("input_lengths", "INT32", [len(ids)]),
        ("request_output_len", "INT32", [1]),
        ("runtime_top_k", "INT32", [1]),
        ("streaming", "BOOL", [True]),
        ("return_perf_metrics", "BOOL", [True]),
    ):
        req.inputs.add(name=name, datatype=dtype, shape=[1, len(values)])
        req.raw_input_contents.append(wire.encode(dtype, values))
    return req


async def ttft(
    stub: ts_grpc.GRPCInferenceServiceStub, model: str, ids: list[int], rid: str
) -> tuple[float, int]:
    """Seconds to the first response with tokens, and the blocks the engine says it reused."""

    async def one() -> AsyncIterator[ts.ModelInferRequest]:
        yield infer_request(model, ids, rid)

    sent = time.perf_counter()
    first = 0.0
    reused = -1
    async for message in stub.ModelStreamInfer(one(), timeout=600):
        if message.error_message:
            raise RuntimeError(message.error_message)
        response = message.infer_response
        for i, out in enumerate(response.outputs):
            if out.name == "output_ids" and not first:
                first = time.perf_counter()
            if out.name == "kv_cache_reused_blocks":
                reused = int(wire.decode("INT32", response.raw_output_contents[i], 1)[0])
    return first - sent, reused


async def wait_ready(
    stub: ts_grpc.GRPCInferenceServiceStub, engine: subprocess.Popen[bytes]
) -> None:
    while engine.poll() is None:
        try:
            if (await stub.ServerReady(ts.ServerReadyRequest(), timeout=1.0)).ready:
                return
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.2)
    raise RuntimeError(f"the engine server exited with {engine.returncode}")


async def bench_reuse(args: argparse.Namespace, work: Path, vocab: int) -> None:
    repo = write_repository(args.checkpoint, work)
    address = f"127.0.0.1:{processes.free_port()}"
    engine = processes.spawn(
        ["engine", "--repository", str(repo), "--listen", address, "--threads", str(args.threads)],
        work / "engine.log",
    )
    rng = random.Random(7)
    times: dict[str, list[float]] = {"reuse": [], "plain": []}
    reused: list[int] = []
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = ts_grpc.GRPCInferenceServiceStub(channel)
            await wait_ready(stub, engine)
            for r in range(args.rounds):
                document = [rng.randrange(vocab) for _ in range(args.prefix_tokens)]
                earlier = document + [rng.randrange(vocab) for _ in range(args.suffix_tokens)]
                later = document + [rng.randrange(vocab) for _ in range(args.suffix_tokens)]
                await ttft(stub, "reuse", earlier, f"warm-{r}")
                order = ("reuse", "plain") if r % 2 == 0 else ("plain", "reuse")
                for model in order:
                    seconds, blocks = await ttft(stub, model, later, f"{model}-{r}")
                    times[model].append(seconds)
                    if model == "reuse":
                        reused.append(blocks)
    finally:
        processes.stop(engine)
    prompt = args.prefix_tokens + args.suffix_tokens
    print(
        f"(A) TTFT, {args.rounds} rounds: prompt {prompt} tokens, of which {args.prefix_tokens} "
        f"computed by an earlier request; engine threads {args.threads}; reused blocks per "
        f"request {sorted(set(reused))}"
    )
    print("| model | median ms | min ms | max ms |")
    print("|---|---:|---:|---:|")
    for model, values in times.items():
        ms = [v * 1e3 for v in values]
        print(f"| {model} | {statistics.median(ms):.1f} | {min(ms):.1f} | {max(ms):.1f} |")
    ratio = statistics.median(times["plain"]) / statistics.median(times["reuse"])
    print(f"TTFT without reuse / with reuse (medians): {ratio:.1f}x (goal >= 5x)")


class _Clock:
    """A transformers streamer that only notes when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def tokens_per_second(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def weight_floor_ms(model: LlamaModel, repeats: int = 5) -> float:
    """Best time of the matrix-vector products one decode step must do: every weight read once.

    No float32 decoder on this machine decodes faster than this (batch 1 is bound by reading the
    weights); it tells how much of a step is overhead above it.
    """
    x = torch.randn(1, model.config.hidden_size, dtype=model.dtype)
    up = torch.randn(1, model.config.intermediate_size, dtype=model.dtype)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in model.layers:
                for linear in (layer.wqkv, layer.wo, layer.w13):
                    linear(x)
                layer.w2(up)
            torch.nn.functional.linear(x, model.lm_head)
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def bench_decode(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    ours = LlamaModel.load(args.checkpoint)
    theirs = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    rng = random.Random(11)
    prompt = [rng.randrange(ours.config.vocab_size) for _ in range(args.decode_prompt_tokens)]
    n = args.decode_tokens
    cache = ours.new_cache(ours.config.max_position_embeddings)
    results: dict[str, list[float]] = {"engine decoder": [], "transformers generate": []}
    gaps: dict[str, list[float]] = {name: [] for name in results}
    same = True

    def run_ours() -> list[float]:
        stamps: list[float] = []
        tokens.clear()
        for token in generate(ours, prompt, n, None, SamplingParams(top_k=1), cache=cache):
            stamps.append(time.perf_counter())
            tokens.append(token)
        return stamps

    def run_theirs() -> list[float]:
        clock = _Clock()
        with torch.inference_mode():
            out = theirs.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                streamer=clock,
            )
        theirs_tokens[:] = out[0, len(prompt) :].tolist()
        return clock.times

    tokens: list[int] = []
    theirs_tokens: list[int] = []
    runs = {"engine decoder": run_ours, "transformers generate": run_theirs}
    for r in range(args.decode_rounds + 1):  # round 0 warms both up and is not counted
        # Alternating order, so a burst of load on the shared machine hits both alike.
        for name in list(runs) if r % 2 else list(runs)[::-1]:
            stamps = runs[name]()
            if r:
                results[name].append(tokens_per_second(stamps))
                gaps[name] += [b - a for a, b in itertools.pairwise(stamps)]
        same = same and tokens == theirs_tokens
    print(
        f"(B) decode, {args.decode_rounds} rounds: prompt {len(prompt)} tokens, {n} new tokens, "
        f"greedy, float32, torch threads {torch.get_num_threads()}; same tokens: {same}"
    )
    # Step gaps: the engine's greedy steps are chained (each runs before the previous token is
    # yielded), so a request's gaps are two steps, one step each, then ~0 for its last token; the
    # minimum is that ~0, not a step, and P10 is the least disturbed real step of both decoders.
    print("| decoder | median tok/s | min | max | step ms P10 | step ms P50 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, values in results.items():
        steps = [g * 1e3 for g in gaps[name]]
        print(
            f"| {name} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} "
            f"| {pct(steps, 0.1):.1f} | {pct(steps, 0.5):.1f} |"
        )
    best = pct(gaps["transformers generate"], 0.1) / pct(gaps["engine decoder"], 0.1)
    print(f"P10 step, transformers / engine decoder (least disturbed by load): {best:.2f}x")
    ratio = statistics.median(results["engine decoder"]) / statistics.median(
        results["transformers generate"]
    )
    print(f"engine decoder / transformers (medians): {ratio:.2f}x (goal >= 2x)")
    floor = weight_floor_ms(ours)
    print(
        f"weight-read floor (every matrix-vector product of a step, best of 5): {floor:.1f} ms "
        f"= {1e3 / floor:.1f} tok/s at most; engine step {1e3 / statistics.median(results['engine decoder']):.1f} ms, "
        f"transformers step {1e3 / statistics.median(results['transformers generate']):.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("var/smollm2/model"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--decode-rounds", type=int, default=9)
    parser.add_argument("--decode-prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--skip", choices=("reuse", "decode"), default=None)
    record.add_flag(parser)
    args = parser.parse_args()
    with record.recording("prefix_reuse", record.record_dir(args)):
        torch.set_num_threads(args.threads)
        if args.skip != "reuse":
            vocab = read_config(args.checkpoint).vocab_size
            with tempfile.TemporaryDirectory() as tmp:
                asyncio.run(bench_reuse(args, Path(tmp), vocab))
        if args.skip != "decode":
            bench_decode(args)


if __name__ == "__main__":
    main()
