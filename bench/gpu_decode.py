"""The engine server on a GPU, measured in one run against the memory-bandwidth floor.

What it measures (docs/PERFORMANCE.md, "GPU"), for one shape of seeded random weights drawn on the
device (`--shape llama-3.1-8b`: 32 layers, 4096 hidden, 14336 intermediate, 32/8 heads, vocab
128256; nothing downloaded):

- the floor: a device-to-device copy's bandwidth (bytes read + bytes written over time, best of
  several) measured in this run, and per variant the weight bytes a batch-1 decode step must read
  divided by it: no decoder can step faster than that;
- per variant (bf16, FP8, or INT8/INT4 group-128 weights; eager or CUDA-graph decode; the
  captured step on eager torch kernels, on the fused Triton kernels (`--kernels triton`), or
  torch.compile'd as an anchor):
  decode latency per token at batch 1, P50/P99 over `--tokens` tokens (256 by default) after a
  warm-up; the captured step's device time from replays enqueued back to back between two CUDA
  events (no host loop in the timing); kernels per decode step (torch.profiler; on a CPU, aten
  operators per step); TTFT of 64-, 128- and 2,048-token prompts, and of a 2,048-token prompt
  whose first 2,000 tokens an earlier request left in the reuse pool (1,984 reused, 64 computed);
  the dense matrix products of a 2,048-token prefill alone (every linear layer on 2,048 rows), so
  TTFT 2,048 / that and TTFT(reuse) - TTFT(64) read off one run; peak device memory; graph
  capture time (decode spans and prefill buckets); start-up (weights drawn + runner ready);
  the verify step of speculative decoding for k = 1, 2, 4 and 8 drafts over the single-token step
  at the same position, as ratios: captured graphs replayed back to back between CUDA events for a
  graph variant (`appliance.engine.verify`), else the same static bodies run back to back
  (on a CPU, timed by the host clock), with the verify step's first row checked against the
  single-token step's logits; per token, greedy steps driven by the host one by one and chained
  (the next step queued before a token is read). The variants run through the engine's own Runner
  (prefix reuse, chunked prefill, the decode step), timed at the runner's emissions, so gRPC is
  not in these numbers. A failure is one line in the table; one that leaves the CUDA context
  unusable hands the variants after it to a fresh process;
- the whole path, on the host's cores: client -> gateway -> engine server vs client -> engine
  server vs a bare gRPC echo (bench/streaming.py), with the engine on this device.

Prints one table; writes everything as JSON to `--out` (default $OUT, else var/bench).

    python -m bench.gpu_decode                                 # on a GPU host: the 8B shape
    python -m bench.gpu_decode --device cpu --shape tiny --tokens 16 --skip-path   # CPU check
"""

from __future__ import annotations

import argparse
import bisect
import gc
import importlib.metadata
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from appliance.engine import fused, kernels
from appliance.engine.decode import (
    Capture,
    DecodeStep,
    GraphDecode,
    cuda_graph_capture,
    decode_and_choose,
    decode_spans,
)
from appliance.engine.device import enter_device
from appliance.engine.kernels import PdlMode, triton_problem
from appliance.engine.linear import WeightQuant
from appliance.engine.llama import LlamaModel
from appliance.engine.quantized import GroupQuant
from appliance.engine.random_weights import random_config, random_model
from appliance.engine.repository import KvCacheParams
from appliance.engine.runner import Emission, Job, Runner, build_runner
from appliance.engine.sampling import SamplingParams
from appliance.engine.verify import GraphVerify
from appliance.heap import freeze_heap
from bench import record

GREEDY = SamplingParams(top_k=1)
# The long prompt, and the prefix of it an earlier request leaves in the reuse pool: 62 full
# blocks of 32 (1,984 tokens) are reused and 64 tokens computed, the same count as the short prompt.
PREFILL_TOKENS = 2048
REUSED_PREFIX = 2000


@dataclass(frozen=True)
class Variant:
    """One way of running the decode step: weights (`fp8`: the model dtype when None, else FP8
    with that scaling or INT8/INT4 group-wise), graph capture, and the captured step's body
    (`kernels` "torch" or "triton"; `compiled`: torch.compile of the eager torch step, an anchor;
    `dense`: who multiplies the model-dtype weights in the fused step, `fused.DENSE_PRODUCTS`;
    `folded`: the fused step with its norms and RoPE inside the products, `fused.FOLDED`; `pdl`:
    its kernels launched with programmatic dependent launch, `kernels.PDL`, "early-read" also
    reading each product's first weights before it waits)."""

    name: str
    fp8: WeightQuant | None
    graph: bool
    kernels: Literal["torch", "triton"] = "torch"
    compiled: bool = False
    dense: Literal["triton", "torch"] = "triton"
    folded: bool = False
    pdl: PdlMode = "off"


VARIANTS = (  # in the order run: what a short time budget must not miss first, compile last
    # The formats on the fused step: each also times its prefill against the torch step's.
    Variant("bf16 graph triton", None, True, "triton"),
    Variant("fp8 graph triton", "channel", True, "triton"),
    # The same steps with six launches a block instead of nine (`fused.FOLDED`), then also each
    # launch overlapping the kernel before it (`kernels.PDL`): what is faster decides the defaults.
    Variant("fp8 graph triton folded", "channel", True, "triton", folded=True),
    Variant(
        "fp8 graph triton folded pdl", "channel", True, "triton", folded=True, pdl="early-read"
    ),
    Variant("bf16 graph triton folded pdl", None, True, "triton", folded=True, pdl="early-read"),
    # bf16's early read holds twice FP8's tile across the wait: twice the registers.
    Variant("bf16 graph triton folded pdl-wait", None, True, "triton", folded=True, pdl="wait"),
    Variant("bf16 graph triton folded", None, True, "triton", folded=True),
    # Weight-only INT4 (group 128): the fused step's kernels dequantise in registers; the floor
    # counts the packed weights with their scales and zero points.
    Variant("int4 graph triton", GroupQuant(4, 128), True, "triton"),
    # The same fused step with cuBLAS products (33 launches more a token on the 8B shape: SiLU * up
    # in each block, the logits' float32 copy; more where cuBLAS splits a product).
    Variant("bf16 graph triton cublas", None, True, "triton", dense="torch"),
    Variant("bf16 graph", None, True),
    Variant("int8 graph triton", GroupQuant(8, 128), True, "triton"),
    Variant("fp8 graph", "channel", True),
    Variant("fp8-tensor graph", "tensor", True),
    Variant("bf16 eager", None, False),
    Variant("fp8 eager", "channel", False),
    Variant("bf16 graph compile", None, True, compiled=True),
    Variant("fp8-tensor graph compile", "tensor", True, compiled=True),
)
# Decode steps profiled for the kernel count, and graph replays timed back to back.
PROFILED_STEPS = 4
BACK_TO_BACK_STEPS = 200
# Back-to-back runs of each timed step on a CPU, where each is a whole forward pass on the host.
CPU_BACK_TO_BACK_STEPS = 10
# Prompt lengths whose fixed-shape prefill is timed on the fused kernels and the torch step.
PREFILL_ROWS = (64, 128)
# Draft counts whose verify step is timed against the single-token step, at this position.
VERIFY_DRAFTS = (1, 2, 4, 8)
VERIFY_POS = 128
# A recorded failure's message is cut to this many characters (one line of the table).
ERROR_CHARS = 300
# Bytes the copy-bandwidth measure of a fresh process moves (the first process measured it).
FRESH_PROCESS_COPY_BYTES = 1 << 20
# With --budget-s, the process stops itself this long after the budget (a hung variant).
OVERRUN_GRACE_S = 60.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, runs: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written (best run)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


@dataclass
class Timed:
    """Emission times of one job, in perf_counter seconds."""

    submitted: float
    times: list[float] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    perf: Any = None
    error: str | None = None


def run_job(runner: Runner, prompt: list[int], new_tokens: int) -> Timed:
    """One streamed greedy job on the runner; returns when its final emission arrived."""
    timed = Timed(time.perf_counter())

    def emit(e: Emission) -> None:
        if e.tokens:
            timed.times.append(time.perf_counter())
        if e.perf is not None:
            timed.perf = e.perf
        timed.error = e.error or timed.error
        if e.final:
            timed.done.set()

    job = Job("bench", prompt, new_tokens, None, GREEDY, True, emit, return_perf=True)
    timed.submitted = time.perf_counter()
    runner.submit(job)
    if not timed.done.wait(600):
        raise TimeoutError("a benchmark job did not finish in 600 s")
    if timed.error or not timed.times:
        raise RuntimeError(f"a benchmark job failed: {timed.error or 'no tokens'}")
    return timed


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def measure_variant(
    args: argparse.Namespace,
    variant: Variant,
    device: torch.device,
    rng: random.Random,
    result: dict[str, Any],
) -> None:
    """Measure `variant` into `result` as each figure is taken, so a failure part-way leaves the
    figures before it there."""
    config = random_config(args.shape)
    vocab = config.vocab_size
    max_seq_len = min(args.max_seq_len, config.max_position_embeddings)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    model = random_model(config, device, torch.bfloat16, variant.fp8, seed=args.seed)
    model.kernels = variant.kernels
    if variant.compiled:
        # Compiled once per span (each is its own static shape), inside the warm-up runs that
        # precede each graph capture, so the capture records the compiled kernels.
        model.decode_static = torch.compile(model.decode_static, dynamic=False)  # type: ignore[method-assign]
    _sync(device)
    weights_ready = time.perf_counter()
    params = KvCacheParams(
        max_seq_len=max_seq_len,
        tokens_per_block=32,
        enable_reuse=True,
        max_tokens=max_seq_len + 4096,  # a pool of 4,096 tokens beside the working cache
        free_mem_fraction=0.9,
    )
    capture = cuda_graph_capture(device) if variant.graph else None
    runner = build_runner(model, params, f"bench {args.shape}", capture)
    _sync(device)
    ready = time.perf_counter()
    freeze_heap()  # as the engine server does once serving; undone below
    result.update(
        weight_bytes_per_step=model.weight_bytes,
        weights_s=weights_ready - started,
        startup_s=ready - started,
        graph_capture_s=getattr(runner.decode, "capture_seconds", None),
        graph_spans=getattr(runner.decode, "spans", None),
    )
    try:
        run_job(runner, prompt(128), 8)  # warm-up: kernels, cuBLAS handles, allocator
        decode = run_job(runner, prompt(128), args.tokens + args.warmup_tokens)
        gaps = np.diff(decode.times[args.warmup_tokens :]).tolist()
        result["decode_ms_p50"] = pct(gaps, 50) * 1e3
        result["decode_ms_p99"] = pct(gaps, 99) * 1e3
        result["decode_tokens"] = len(gaps) + 1
        for n in (64, 128, PREFILL_TOKENS):
            ttfts = [
                (t.times[0] - t.submitted) * 1e3
                for t in (run_job(runner, prompt(n), 1) for _ in range(args.ttft_runs))
            ]
            result[f"ttft_{n}_ms_p50"] = statistics.median(ttfts)
            result[f"ttft_{n}_ms_all"] = ttfts
        prefix = prompt(REUSED_PREFIX)
        run_job(
            runner, prefix + prompt(PREFILL_TOKENS - REUSED_PREFIX), 1
        )  # computes and pools the prefix's blocks
        reused = [
            run_job(runner, prefix + prompt(PREFILL_TOKENS - REUSED_PREFIX), 1)
            for _ in range(args.ttft_runs)
        ]
        result["ttft_reuse_ms_p50"] = statistics.median(
            (t.times[0] - t.submitted) * 1e3 for t in reused
        )
        result["reused_tokens"] = [t.perf.kv.reused_tokens for t in reused]
        result["ttft_reuse_minus_ttft_64_ms"] = (
            result["ttft_reuse_ms_p50"] - result["ttft_64_ms_p50"]
        )
        result["matmul_2048_ms"] = dense_matmul_ms(model, PREFILL_TOKENS, device)
        result["ttft_2048_over_matmul"] = result["ttft_2048_ms_p50"] / result["matmul_2048_ms"]
        result.update(step_profile(model, runner.cache, device))
        if variant.kernels == "triton":
            result["triton_vs_torch_logits_rel_err"] = kernel_agreement(model, runner.cache)
            if isinstance(runner.decode, GraphDecode):
                result["graph_vs_torch_logits_rel_err"] = graph_agreement(
                    runner.decode, model, runner.cache
                )
        if isinstance(runner.decode, GraphDecode):
            result["graph_step_ms_back_to_back"] = graph_step_ms(runner.decode, 128)
        steps = BACK_TO_BACK_STEPS if device.type == "cuda" else CPU_BACK_TO_BACK_STEPS
        result.update(host_loop_ms(runner.decode, 128, steps))
        result.update(verify_step_ratios(model, runner, capture, device))
        if variant.kernels == "triton":
            result.update(prefill_comparison(model, runner.cache, capture, device))
        if device.type == "cuda":
            result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    finally:
        runner.close()
        del runner, model
        gc.unfreeze()  # frozen cycles are never collected: the model's memory would stay
        gc.collect()


def dense_matmul_ms(model: LlamaModel, tokens: int, device: torch.device, runs: int = 3) -> float:
    """Device time of a prefill's dense matrix products alone: every block's linear layers (as
    the model holds them: bf16, FP8, INT8 or INT4) applied to `tokens` rows, best of `runs`. The
    compute a prefill of that many tokens cannot avoid, measured in the same run as its TTFT."""
    c = model.config
    gen = torch.Generator(device=device).manual_seed(0)

    def rows(width: int) -> torch.Tensor:
        return torch.randn(tokens, width, generator=gen, device=device).to(model.dtype)

    x, attn, inner = (
        rows(c.hidden_size),
        rows(c.num_attention_heads * c.head_dim),
        rows(c.intermediate_size),
    )

    def products() -> None:
        for layer in model.layers:
            layer.wqkv(x)
            layer.wo(attn)
            layer.w13(x)
            layer.w2(inner)

    best = float("inf")
    with torch.inference_mode():
        products()  # warm: cuBLAS handles and heuristics
        for _ in range(runs):
            _sync(device)
            t0 = time.perf_counter()
            products()
            _sync(device)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def profiled(run: Callable[[], None], device: torch.device, calls: int) -> dict[str, float]:
    """Kernels and their device ms (on CUDA) or aten operators (on a CPU) per call of `run`,
    from torch.profiler over `calls` calls after one warm call (nothing compiles inside)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        run()
        _sync(device)
        with profile(activities=activities) as prof:
            for _ in range(calls):
                run()
            _sync(device)
    events = prof.events()
    if device.type == "cuda":
        cuda = torch.autograd.DeviceType.CUDA  # type: ignore[attr-defined]  # not re-exported
        found = [e for e in events if e.device_type == cuda]
        return {
            "kernels": len(found) / calls,
            "kernel_ms": sum(e.device_time_total for e in found) / calls / 1e3,
        }
    return {"cpu_ops": len([e for e in events if e.name.startswith("aten::")]) / calls}


def step_profile(model: LlamaModel, cache: Any, device: torch.device) -> dict[str, Any]:
    """Kernels (on CUDA) or operators (on a CPU) per decode step, from torch.profiler over
    PROFILED_STEPS runs of the step body the graph captures (kernels in a replayed graph are the
    same launches), at position 128 over the smallest span; each run chains the next position."""
    step_in = torch.tensor((5, 128), dtype=torch.long, device=device)
    logits = torch.empty(model.config.vocab_size, dtype=torch.float32, device=device)
    span = min(256, cache.max_seq_len)
    run = partial(decode_and_choose, model, step_in, cache, span, logits)
    return {f"{k}_per_step": v for k, v in profiled(run, device, PROFILED_STEPS).items()}


def prefill_comparison(
    model: LlamaModel, cache: Any, capture: Capture | None, device: torch.device
) -> dict[str, Any]:
    """The fixed-shape prefill of PREFILL_ROWS tokens from position 0 on the fused kernels
    (`fused.static_rows`) against the torch step, in the same process on the same cache: device
    ms per prefill (captured graphs replayed back to back when `capture`, else the bodies),
    kernels per prefill (CUDA) and the relative L2 distance of their logits."""
    vocab = model.config.vocab_size
    spans = decode_spans(cache.max_seq_len)
    result: dict[str, Any] = {}
    fused_rows = fused.FUSED_ROWS
    for rows in PREFILL_ROWS:
        span = spans[bisect.bisect_left(spans, rows)]
        ids = torch.arange(5, 5 + rows, dtype=torch.long, device=device)
        meta = torch.tensor((0, rows), dtype=torch.long, device=device)
        logits: dict[str, torch.Tensor] = {}
        for body in ("fused", "torch"):
            out = torch.empty(vocab, dtype=torch.float32, device=device)
            run: Callable[[], None] = partial(model.prefill_static, ids, meta, cache, span, out)
            fused.FUSED_ROWS = fused_rows if body == "fused" else 0
            try:
                counted = profiled(run, device, 2)
                if capture is not None:
                    with torch.inference_mode():
                        run = capture(run)
                result[f"prefill_{rows}_{body}_ms"] = back_to_back_ms(run, device)
            finally:
                fused.FUSED_ROWS = fused_rows
            result.update({f"prefill_{rows}_{body}_{k}": v for k, v in counted.items()})
            logits[body] = out.clone()
        got, ref = logits["fused"], logits["torch"]
        result[f"prefill_{rows}_fused_vs_torch_rel_err"] = float((got - ref).norm() / ref.norm())
    return result


def kernel_agreement(model: LlamaModel, cache: Any) -> float:
    """Relative L2 distance of the fused step's logits from the eager torch step's, same input."""
    step_in = torch.tensor((5, 128), dtype=torch.long, device=model.device)
    span = min(256, cache.max_seq_len)
    got = torch.empty(model.config.vocab_size, dtype=torch.float32, device=model.device)
    ref = torch.empty_like(got)
    kernels = model.kernels
    with torch.inference_mode():
        model.decode_static(step_in, cache, span, got)
        model.kernels = "torch"
        try:
            model.decode_static(step_in, cache, span, ref)
        finally:
            model.kernels = kernels
    return float((got - ref).norm() / ref.norm())


def graph_agreement(step: GraphDecode, model: LlamaModel, cache: Any) -> float:
    """The largest relative L2 distance, over four positions in a row, of the captured step's
    logits (its graph replayed, where launches overlap as they do when timed) from the eager
    torch step's at the same token, position and cache."""
    worst = 0.0
    kernels_before = model.kernels
    for pos in range(120, 124):
        got = step(5, pos).clone()
        ref = torch.empty_like(got)
        step_in = torch.tensor((5, pos), dtype=torch.long, device=model.device)
        span = step.spans[bisect.bisect_right(step.spans, pos)]
        model.kernels = "torch"
        try:
            with torch.inference_mode():
                model.decode_static(step_in, cache, span, ref)
        finally:
            model.kernels = kernels_before
        worst = max(worst, float((got - ref).norm() / ref.norm()))
    return worst


def graph_step_ms(step: GraphDecode, pos: int) -> float:
    """Device time of one captured step, from BACK_TO_BACK_STEPS replays enqueued back to back
    between two CUDA events: the host enqueues without waiting, so no host gap is timed. Each
    replay writes its greedy choice and the next position into the step's input, so the replays
    run over positions centred on `pos`, all below the span of `pos`'s graph."""
    start = pos - BACK_TO_BACK_STEPS // 2 - 1  # back_to_back_ms runs once more, to warm up
    span = step.spans[bisect.bisect_right(step.spans, pos)]
    if start < 0 or start + BACK_TO_BACK_STEPS + 1 > span:
        raise ValueError(f"{BACK_TO_BACK_STEPS} replays around {pos} do not fit below {span}")
    with torch.inference_mode():
        step.step_in.copy_(torch.tensor((5, start), dtype=torch.long))
    return back_to_back_ms(step.replay_for(pos), step.step_in.device)


def host_loop_ms(step: DecodeStep, pos: int, tokens: int) -> dict[str, float]:
    """Per-token wall time of `tokens` greedy steps from `pos`, driven by the host two ways in
    the same process: step by step (the step, then its argmax read before the next step is
    queued) and chained (`DecodeStep.launch`: the next step queued before the token is read)."""
    with torch.inference_mode():
        token = 5
        t0 = time.perf_counter()
        for p in range(pos, pos + tokens):
            token = int(torch.argmax(step(token, p)).item())
        stepwise = time.perf_counter() - t0
        t0 = time.perf_counter()
        read = step.launch(pos, 5)
        for p in range(pos + 1, pos + tokens):
            following = step.launch(p)
            read()
            read = following
        read()
        chained = time.perf_counter() - t0
    return {
        "host_loop_stepwise_ms": stepwise * 1e3 / tokens,
        "host_loop_chained_ms": chained * 1e3 / tokens,
    }


def back_to_back_ms(run: Callable[[], None], device: torch.device) -> float:
    """Time of one `run`, from runs enqueued back to back after one warm run: between two CUDA
    events on a GPU (BACK_TO_BACK_STEPS runs, no host gap timed), by the host clock on a CPU
    (CPU_BACK_TO_BACK_STEPS runs)."""
    with torch.inference_mode():
        run()
        if device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(CPU_BACK_TO_BACK_STEPS):
                run()
            return (time.perf_counter() - t0) * 1e3 / CPU_BACK_TO_BACK_STEPS
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(BACK_TO_BACK_STEPS):
            run()
        end.record()
        end.synchronize()
    return float(start.elapsed_time(end)) / BACK_TO_BACK_STEPS


def verify_step_ratios(
    model: LlamaModel, runner: Runner, capture: Capture | None, device: torch.device
) -> dict[str, Any]:
    """The verify step of k drafts (k in VERIFY_DRAFTS: k + 1 rows at VERIFY_POS, over the
    smallest span) against the single-token step at the same position: with `capture`, graphs of
    their own on the runner's cache, replayed; without, the same static bodies run eagerly. Also
    the relative L2 distance of the verify step's first row from the single-token step's logits
    (same token, same position, same cache)."""
    cache = runner.cache
    tokens = [5 + i for i in range(max(VERIFY_DRAFTS) + 1)]
    spans = decode_spans(cache.max_seq_len)  # the runner's: the captured step's spans
    span = spans[bisect.bisect_left(spans, VERIFY_POS + len(tokens))]
    vocab = model.config.vocab_size
    step_in = torch.tensor((tokens[0], VERIFY_POS), dtype=torch.long, device=device)
    step_logits = torch.empty(vocab, dtype=torch.float32, device=device)
    graph = runner.decode if isinstance(runner.decode, GraphDecode) else None
    if graph is not None and capture is not None:
        step: Callable[[], None] = graph.replay_for(VERIFY_POS)
        step_logits = graph.logits
        verify = GraphVerify(model, cache, capture, VERIFY_DRAFTS, [span])
        timing = "graph replays"
        step_ms = graph_step_ms(graph, VERIFY_POS)
    else:
        step = partial(model.decode_static, step_in, cache, span, step_logits)
        timing = "static bodies, eager"
        step_ms = back_to_back_ms(step, device)
    result: dict[str, Any] = {"verify_timing": timing, "verify_single_step_ms": step_ms}
    verify_logits = torch.empty(0)
    for k in VERIFY_DRAFTS:
        if timing == "graph replays":
            replay = verify.load(tokens[: k + 1], VERIFY_POS)
            if replay is None:
                raise RuntimeError(f"no verify graph holds {k} drafts at {VERIFY_POS}")
            run, verify_logits = replay, verify.logits[: k + 1]
        else:
            ids = torch.tensor(tokens[: k + 1], dtype=torch.long, device=device)
            meta = torch.tensor((VERIFY_POS, k + 1), dtype=torch.long, device=device)
            verify_logits = torch.empty(k + 1, vocab, dtype=torch.float32, device=device)
            run = partial(model.verify_static, ids, meta, cache, span, verify_logits)
        ms = back_to_back_ms(run, device)
        result[f"verify_{k}_ms"] = ms
        result[f"verify_{k}_over_step"] = ms / step_ms
    with torch.inference_mode():
        if timing == "graph replays" and graph is not None:  # its replays moved its input on
            graph.step_in.copy_(step_in)
        step()  # the single-token step of tokens[0] at VERIFY_POS, as the verify's first row
        _sync(device)
        first = verify_logits[0].clone()
        single = step_logits.clone()
    result["verify_vs_step_logits_rel_err"] = float((first - single).norm() / single.norm())
    return result


def measure_path(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """bench/streaming.py with the engine on `device`; skipped with the reason when it cannot run."""
    try:
        import uvloop

        from bench import streaming
    except ImportError as exc:  # the GPU host's image may lack the appliance's dependencies
        return {"skipped": f"missing Python module {exc.name}; carry wheels (docs/PERFORMANCE.md)"}
    # The tiny checkpoint goes to a temporary folder, not under --out: on a lent GPU host only a
    # few files no more than two folders down come back from $OUT, and it would crowd them out.
    with tempfile.TemporaryDirectory(prefix="gpu_decode_tiny_") as model_root:
        path_args = argparse.Namespace(
            requests=args.path_requests,
            warmup=5,
            prompt_tokens=128,
            output_tokens=64,
            model_root=model_root,
        )
        started = time.perf_counter()
        results = uvloop.run(streaming.run(path_args, ("--device", str(device))))
    return {"seconds": time.perf_counter() - started, **results}


def verify_table(variants: list[dict[str, Any]]) -> str:
    """The verify step's time over the single-token step's, per measured variant."""
    ks = " | ".join(f"verify {k} / step" for k in VERIFY_DRAFTS)
    lines = [
        f"| variant | timed | step ms | {ks} | first row vs step rel err |",
        "|---|---|" + "---:|" * (len(VERIFY_DRAFTS) + 2),
    ]
    for v in variants:
        if "verify_vs_step_logits_rel_err" not in v or "error" in v:
            continue
        ratios = " | ".join(f"{v[f'verify_{k}_over_step']:.2f}" for k in VERIFY_DRAFTS)
        lines.append(
            f"| {v['variant']} | {v['verify_timing']} | {v['verify_single_step_ms']:.3f} "
            f"| {ratios} | {v['verify_vs_step_logits_rel_err']:.1e} |"
        )
    return "\n".join(lines)


def prefill_table(variants: list[dict[str, Any]]) -> str:
    """The fixed-shape prefill on the fused kernels against the torch step, per variant that
    measured both."""
    lines = [
        "| variant | tokens | fused ms | torch ms | torch / fused | fused kernels | "
        "torch kernels | logits rel err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in variants:
        for rows in PREFILL_ROWS:
            key = f"prefill_{rows}"
            if f"{key}_fused_vs_torch_rel_err" not in v:
                continue
            mine, theirs = v[f"{key}_fused_ms"], v[f"{key}_torch_ms"]
            counts = [v.get(f"{key}_{body}_kernels") for body in ("fused", "torch")]
            cells = " | ".join("n/a" if c is None else f"{c:.0f}" for c in counts)
            lines.append(
                f"| {v['variant']} | {rows} | {mine:.3f} | {theirs:.3f} | {theirs / mine:.2f} "
                f"| {cells} | {v[f'{key}_fused_vs_torch_rel_err']:.1e} |"
            )
    return "\n".join(lines)


def host_loop_table(variants: list[dict[str, Any]]) -> str:
    """Per token: the graph replayed back to back, and the host driving greedy steps one by one
    and chained, per measured variant."""
    lines = [
        "| variant | graph step ms | host loop, step by step ms | host loop, chained ms |",
        "|---|---:|---:|---:|",
    ]
    for v in variants:
        if "host_loop_chained_ms" not in v:
            continue
        graph = v.get("graph_step_ms_back_to_back")
        lines.append(
            f"| {v['variant']} | {'n/a' if graph is None else format(graph, '.3f')} "
            f"| {v['host_loop_stepwise_ms']:.3f} | {v['host_loop_chained_ms']:.3f} |"
        )
    return "\n".join(lines)


def table(report: dict[str, Any]) -> str:
    floor_bw = report["copy_bandwidth_gbps"]
    lines = [
        f"GPU decode: {report['device_name']} (capability {report['capability']}), shape "
        f"{report['shape']}, torch {report['torch']}, triton {report['triton']}; "
        f"copy bandwidth (read+write) {floor_bw:.0f} GB/s",
        "| variant | weights GB/step | floor ms | decode P50 ms | P99 ms | P50/floor | "
        "graph step ms | kernels/step | logits vs eager | TTFT 64 ms | TTFT 128 ms | "
        "TTFT 2048 ms | matmul 2048 ms | TTFT 2048 / matmul | TTFT 2048 reuse ms | reuse - TTFT 64 ms | "
        "peak GiB | capture s | start-up s |",
        "|---|" + "---:|" * 18,
    ]

    def f(value: Any, spec: str = ".2f") -> str:
        return "n/a" if value is None else format(value, spec)

    for v in report["variants"]:
        if "skipped" in v:
            lines.append(f"| {v['variant']} | skipped: {v['skipped']} |")
            continue
        if "error" in v:
            lines.append(f"| {v['variant']} | error: {v['error']} |")
            continue
        floor_ms = v["weight_bytes_per_step"] / (floor_bw * 1e9) * 1e3
        lines.append(
            f"| {v['variant']} | {v['weight_bytes_per_step'] / 1e9:.3g} | {floor_ms:.3f} "
            f"| {v['decode_ms_p50']:.3f} | {v['decode_ms_p99']:.3f} "
            f"| {v['decode_ms_p50'] / floor_ms:.2f} | {f(v.get('graph_step_ms_back_to_back'), '.3f')} "
            f"| {f(v.get('kernels_per_step', v.get('cpu_ops_per_step')), '.0f')} "
            f"| {f(v.get('graph_vs_torch_logits_rel_err', v.get('triton_vs_torch_logits_rel_err')), '.1e')} "
            f"| {v['ttft_64_ms_p50']:.2f} | {v['ttft_128_ms_p50']:.2f} "
            f"| {v['ttft_2048_ms_p50']:.1f} | {v['matmul_2048_ms']:.1f} "
            f"| {v['ttft_2048_over_matmul']:.2f} | {v['ttft_reuse_ms_p50']:.2f} "
            f"| {v['ttft_reuse_minus_ttft_64_ms']:+.2f} "
            f"| {f(v.get('peak_memory_gib'))} | {f(v['graph_capture_s'])} | {v['startup_s']:.1f} |"
        )
    lines.append(verify_table(report["variants"]))
    lines.append(host_loop_table(report["variants"]))
    lines.append(prefill_table(report["variants"]))
    path = report["path"]
    if "skipped" in path:
        lines.append(f"whole path: skipped ({path['skipped']})")
    elif "error" in path:
        lines.append(f"whole path: error: {path['error']}")
    else:
        keys = [
            "(a) TTFT via gateway",
            "(b) TTFT direct to engine",
            "(e) TTFT via gateway, stream socket",
            "(c) bare grpc.aio unary echo",
            "(d) the echo through a bare grpc.aio relay",
            "(a) inter-token via gateway",
            "(b) inter-token direct",
            "(e) inter-token via gateway, stream socket",
        ]
        lines.append("| whole path (µs) | P50 | P99 |\n|---|---:|---:|")
        lines += [f"| {k} | {path[k + ' P50']:.1f} | {path[k + ' P99']:.1f} |" for k in keys]
    return "\n".join(lines)


def error_line(exc: BaseException) -> str:
    """One line naming a failure: its type and the first line of its message, bounded."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return line[:ERROR_CHARS]


def environment(device: torch.device) -> dict[str, Any]:
    """What ran the measurement: device name and compute capability, torch, CUDA and Triton."""
    try:
        triton_version: str | None = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    on_cuda = device.type == "cuda"
    capability = torch.cuda.get_device_capability(device) if on_cuda else None
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "capability": None if capability is None else f"{capability[0]}.{capability[1]}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
    }


def cuda_context_problem(device: torch.device) -> str | None:
    """Why `device` can take no more work after a failure (a sticky CUDA error: an illegal
    address, a launch failure), None when it still synchronises."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
    except Exception as exc:
        return error_line(exc)
    return None


class Progress:
    """The report as it grows, written to `path` after every change (atomically: a reader or a
    killed run never leaves half a file), so a run stopped at any point leaves what it measured.
    The lock lets the overrun watchdog write it from its own thread."""

    def __init__(self, path: Path, report: dict[str, Any]) -> None:
        self.path = path
        self.report = report
        self.lock = threading.Lock()
        self.write()

    def set(self, key: str, value: Any) -> None:
        with self.lock:
            self.report[key] = value
            self._write()

    def add_variant(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.report["variants"].append(entry)
            self._write()

    def write(self) -> None:
        with self.lock:
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=2, default=str))
        os.replace(tmp, self.path)


def start_watchdog(progress: Progress, seconds: float) -> threading.Timer:
    """After `seconds`, record that the run overran and end the process (exit status 3): a
    variant that hangs on the device cannot take the whole call's time, and what was measured
    before it is on disk."""

    def overrun() -> None:
        now = progress.report.get("running") or "between variants"
        progress.set("overrun", f"stopped at {seconds:.0f} s, running: {now}")
        print(f"gpu_decode: stopped at {seconds:.0f} s (overran), running: {now}", flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, overrun)
    timer.daemon = True
    timer.start()
    return timer


def skip_reason(variant: Variant, device: torch.device) -> str | None:
    """Why `variant` cannot run on `device` at all (None: it can)."""
    if variant.graph and device.type != "cuda":
        return "CUDA graphs need cuda"
    if variant.pdl != "off" and (
        device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0)
    ):
        return "programmatic dependent launch needs a CUDA device of compute capability 9.0 on"
    if variant.kernels == "triton":
        return triton_problem(device)
    return None


def select_variants(names: str | None) -> list[Variant]:
    """`--variants`: comma-separated variant names (all when None); ValueError names the known."""
    if names is None:
        return list(VARIANTS)
    by_name = {v.name: v for v in VARIANTS}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown or not wanted:
        known = ", ".join(by_name)
        raise ValueError(f"unknown variant(s) {unknown or names!r}; known: {known}")
    return [by_name[n] for n in wanted]


def run_variants(
    args: argparse.Namespace,
    variants: list[Variant],
    device: torch.device,
    progress: Progress,
    started: float,
) -> None:
    """Each variant isolated: a failure is recorded as one line (`error`, with the figures taken
    before it) and the run goes on; a variant is skipped, saying so, when the time spent plus
    the longest variant so far would pass `--budget-s`. A failure that leaves the CUDA context
    unusable (a device-side assert) hands the variants after it to a fresh process."""
    rng = random.Random(args.seed)
    longest = 0.0
    for index, variant in enumerate(variants):
        reason = skip_reason(variant, device)
        spent = time.monotonic() - started
        if reason is None and args.budget_s is not None and spent + longest > args.budget_s:
            reason = (
                f"time budget: {spent:.0f} s spent + {longest:.0f} s (the longest variant) "
                f"> --budget-s {args.budget_s:g}"
            )
        if reason is not None:
            progress.add_variant({"variant": variant.name, "skipped": reason})
            continue
        progress.set("running", variant.name)
        entry: dict[str, Any] = {"variant": variant.name}
        t0 = time.monotonic()
        fused.DENSE_PRODUCTS, fused.FOLDED = variant.dense, variant.folded
        kernels.PDL = variant.pdl
        dead: str | None = None
        try:
            measure_variant(args, variant, device, rng, entry)
        except Exception as exc:
            entry["error"] = error_line(exc)
            dead = cuda_context_problem(device)
        finally:
            fused.DENSE_PRODUCTS, fused.FOLDED, kernels.PDL = "triton", False, "off"
        gc.collect()
        entry["seconds"] = time.monotonic() - t0
        longest = max(longest, entry["seconds"])
        progress.add_variant(entry)
        print(json.dumps(entry, default=str), flush=True)
        rest = variants[index + 1 :]
        if dead is not None and rest:
            run_in_fresh_process(args, rest, progress, started, dead)
            break
    progress.set("running", None)


# Runs `python -m bench.gpu_decode ARGV`; returns its exit status.
Spawn = Callable[[list[str]], int]


def _spawn(argv: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "bench.gpu_decode", *argv], check=False).returncode


def run_in_fresh_process(
    args: argparse.Namespace,
    variants: list[Variant],
    progress: Progress,
    started: float,
    why: str,
    spawn: Spawn = _spawn,
) -> None:
    """Runs `variants` in a new process (a CUDA context of its own) with this run's settings and
    the budget left, and adds what it measured to `progress`. A process that dies (a segfault,
    an abort) while running a variant loses only that one (recorded as an error): the ones after
    it run in another fresh process; one that dies before its first variant is not retried."""
    print(f"gpu_decode: the CUDA context is unusable ({why}); the rest runs in a fresh process")
    left = list(variants)
    while left:
        progress.set("running", f"fresh process: {', '.join(v.name for v in left)}")
        status, measured, running = _fresh_process(args, left, started, spawn)
        reported = {entry["variant"] for entry in measured}
        for entry in measured:
            progress.add_variant(entry)
        unreported = [v for v in left if v.name not in reported]
        lost = next((v for v in unreported if v.name == running), None)
        if lost is None:  # it ended before a variant, or did not say: none is tried again
            for variant in unreported:
                progress.add_variant(
                    {"variant": variant.name, "error": f"fresh process exited {status}"}
                )
            return
        progress.add_variant(
            {"variant": lost.name, "error": f"fresh process exited {status} while running it"}
        )
        left = [v for v in unreported if v is not lost]
        if left:
            print(f"gpu_decode: {lost.name} ended its process; the rest runs in another one")


def _fresh_process(
    args: argparse.Namespace, variants: list[Variant], started: float, spawn: Spawn
) -> tuple[int, list[dict[str, Any]], str | None]:
    """One fresh process's exit status, the variants it reported and the one it was running
    when it ended (None: none)."""
    with tempfile.TemporaryDirectory(prefix="gpu-decode-") as out:
        argv = [
            *("--device", args.device, "--shape", args.shape, "--seed", str(args.seed)),
            *("--tokens", str(args.tokens), "--warmup-tokens", str(args.warmup_tokens)),
            *("--ttft-runs", str(args.ttft_runs), "--max-seq-len", str(args.max_seq_len)),
            *("--copy-bytes", str(FRESH_PROCESS_COPY_BYTES), "--skip-path", "--out", out),
            *("--variants", ",".join(v.name for v in variants)),
        ]
        if args.budget_s is not None:
            argv += ["--budget-s", f"{max(0.0, args.budget_s - (time.monotonic() - started)):.0f}"]
        status = spawn(argv)
        try:
            report = json.loads((Path(out) / "gpu_decode.json").read_text())
            measured, running = list(report["variants"]), report.get("running")
        except (OSError, ValueError, KeyError, TypeError):
            measured, running = [], None
    return status, measured, running if isinstance(running, str) else None


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="llama-3.1-8b", help="llama-3.1-8b or tiny")
    parser.add_argument("--tokens", type=int, default=256, help="decode tokens timed (>= 256)")
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument("--ttft-runs", type=int, default=5)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument(
        "--copy-bytes", type=int, default=None, help="default 2 GiB GPU, 256 MiB CPU"
    )
    parser.add_argument("--path-requests", type=int, default=200)
    parser.add_argument("--skip-path", action="store_true", help="skip the whole-path comparison")
    parser.add_argument(
        "--variants", default=None, help="comma-separated variant names to run (default: all)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip the variants (and the whole path) that would run past this many seconds; "
        f"the process stops itself {OVERRUN_GRACE_S:.0f} s after it (exit status 3)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT") or "var/bench")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="go on with the run whose gpu_decode.json is in --out (its process died): what it "
        "reported is kept, the variant it was running is recorded as an error, the rest run",
    )
    record.add_flag(parser)
    return parser


def resumed(path: Path, variants: list[Variant]) -> tuple[dict[str, Any], list[Variant]]:
    """The report of a run whose process died (written after each variant) and the variants it
    did not reach; the one it was running is recorded as an error. ValueError: nothing to
    resume there."""
    try:
        report = json.loads(path.read_text())
        done = {entry["variant"] for entry in report["variants"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--resume: no run to go on with in {path} ({exc})") from None
    running = report.get("running")
    if running not in done and any(v.name == running for v in variants):
        report["variants"].append(
            {"variant": running, "error": "its process ended while running it (--resume)"}
        )
        done.add(running)
    report["running"] = None
    return report, [v for v in variants if v.name not in done]


def main(argv: list[str] | None = None) -> int:
    parser = main_parser()
    args = parser.parse_args(argv)
    try:
        variants = select_variants(args.variants)
    except ValueError as exc:
        parser.error(str(exc))
    started = time.monotonic()
    with record.recording(
        "gpu_decode", record.record_dir(args), None if argv is None else list(argv)
    ) as run_record:
        device = enter_device(args.device)
        env = environment(device)
        print(
            f"gpu_decode: {env['device_name']} (capability {env['capability']}), "
            f"torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}",
            flush=True,
        )
        Path(args.out).mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] = {
            **env,
            "shape": args.shape,
            "tokens": args.tokens,
            "budget_s": args.budget_s,
            "variants": [],
            "path": {"skipped": "not run yet"},
        }
        path = Path(args.out) / "gpu_decode.json"
        if args.resume:
            try:
                earlier, variants = resumed(path, variants)
            except ValueError as exc:
                parser.error(str(exc))
            report = {**report, **earlier, "resumed": True}
        progress = Progress(path, report)
        watchdog = (
            None
            if args.budget_s is None
            else start_watchdog(progress, args.budget_s + OVERRUN_GRACE_S)
        )
        try:
            copy_bytes = args.copy_bytes or ((2 << 30) if device.type == "cuda" else (256 << 20))
            progress.set("copy_bandwidth_gbps", copy_bandwidth(device, copy_bytes) / 1e9)
            if device.type == "cuda":
                # CUPTI set up after CUDA graphs exist has faulted profiling and later captures
                # (pytorch#75504); one empty profiler session before the first capture avoids it.
                with torch.profiler.profile():
                    pass
            run_variants(args, variants, device, progress, started)
            progress.set("path", measure_path_isolated(args, device, started))
        finally:
            if watchdog is not None:
                watchdog.cancel()
        run_record.results["report"] = report
        print(table(report))
        return 0


def measure_path_isolated(
    args: argparse.Namespace, device: torch.device, started: float
) -> dict[str, Any]:
    """The whole path, or why not: `--skip-path`, the time budget spent, or its failure."""
    if args.skip_path:
        return {"skipped": "--skip-path"}
    spent = time.monotonic() - started
    if args.budget_s is not None and spent > args.budget_s:
        return {"skipped": f"time budget: {spent:.0f} s spent > --budget-s {args.budget_s:g}"}
    try:
        return measure_path(args, device)
    except Exception as exc:
        return {"error": error_line(exc)}


if __name__ == "__main__":
    raise SystemExit(main())
