"""Cache-hit benchmark: what a cached answer costs, against the bare hops it is made of.

One run starts a redis-server, the engine server, two gateways (both on that Redis; the second with
`[cache] l1_max_entries = 0`, so its every hit is EXACT_L2) and a bare grpc.aio echo server, all as
real processes on 127.0.0.1, then measures from this process:
  (a) an L1 hit end to end: unary Complete through gateway 1 (tier asserted EXACT_L1),
  (b) a bare grpc.aio unary echo (bench/echo_server.py) of a payload the size of (a)'s response,
  (c) an L2 hit: the same Complete through gateway 2 (tier asserted EXACT_L2),
  (d) a bare redis-py asyncio GET (hiredis) of the very value (c) reads, from this process,
  (e) request_of() + check() + cache_key() + LruCache.get() in-process on a populated LRU, 1 KB and 8 KB prompts,
  (f) L1-hit throughput with K concurrent client coroutines against the echo's with the same K,
  (g) what recording a finished request costs in-process: the metrics sink and the access log line,
  (h) a whole L1 hit in-process: InferenceService.Complete with a stub context, no gRPC (the
      gateway's own Python per hit: (a)'s server side less grpc.aio and protobuf's wire work).
(a), (b), (c), (d) alternate request by request so drift on the machine hits all of them alike; (f)
alternates gateway and echo rounds. Targets: (a) P99 <= 1.25 x (b) P99;
(c) - (a) <= 1.2 x (d) (P50s and P99s); (e) P50 <= 10 µs at 1 KB; (f) >= 0.8 x echo.

    python -m bench.cache [--requests 2000] [--concurrency 16] [--profile FILE]

--profile FILE records the gateway 1 process with py-spy (raw format) under an extra L1-hit load
after the measurements; it changes none of the numbers above.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import hashlib
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import grpc
import numpy as np
import psutil
import redis.asyncio as aredis
import uvloop
from redis.utils import HIREDIS_AVAILABLE

from appliance.backends.base import NO_ENGINE_LIMITS, NO_SPECULATION, Backend
from appliance.cache.entry import CachedAnswer
from appliance.cache.keys import ModelIdentity, cache_key
from appliance.cache.l1 import LruCache
from appliance.cache.tiers import CacheQuery
from appliance.config import CacheConfig
from appliance.gateway.admission import Admission
from appliance.gateway.breaker import CircuitBreaker
from appliance.gateway.health import ModelHealth
from appliance.gateway.messages import request_of
from appliance.gateway.metrics import GatewayMetrics, MetricsSink
from appliance.gateway.models import ModelPolicy, ServedModel
from appliance.gateway.pipeline import Pipeline, sampling_key
from appliance.gateway.report import AccessLog, RequestReport, Sinks
from appliance.gateway.request import Limits, check
from appliance.gateway.server import make_cache
from appliance.gateway.service import InferenceService
from appliance.logline import FORMAT, OneLineFormatter
from appliance.text.tokenizer import ModelText
from appliance.tools import processes
from appliance.tools.tiny_model import ensure_tiny_model
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from bench import record
from bench.common import MODEL, prompt_of, run_dir, start_redis_and_engine
from bench.echo_server import METHOD

L1_TIER, L2_TIER = pb.CACHE_TIER_EXACT_L1, pb.CACHE_TIER_EXACT_L2
KEY_PREFIX = "bench"


@dataclass
class Setup:
    """The processes one run started, and where they listen."""

    tokenizer_dir: Path
    fingerprint: str
    redis_url: str
    gw1: str
    gw2: str
    echo: str
    gw1_pid: int
    echo_pid: int
    pids: tuple[int, ...]  # every process this run started, this one included


def cpu_s(times: Any) -> float:
    return float(times.user + times.system)


def box_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores)."""
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


def ours_s(pids: tuple[int, ...]) -> float:
    return sum(cpu_s(psutil.Process(pid).cpu_times()) for pid in pids)


def outside_from(s: Setup) -> Callable[[], float]:
    """From now on: the cores, on average, busy with processes this run did not start."""
    t0, box0, ours0 = time.perf_counter(), box_busy_s(), ours_s(s.pids)

    def cores() -> float:
        busy = (box_busy_s() - box0) - (ours_s(s.pids) - ours0)
        return busy / (time.perf_counter() - t0)

    return cores


def cache_tables(redis_url: str, timeout_ms: float, l1_max_entries: int | None) -> str:
    l1 = "" if l1_max_entries is None else f"l1_max_entries = {l1_max_entries}\n"
    return (
        f'\n[cache]\n{l1}\n[cache.redis]\nurl = "{redis_url}"\nkey_prefix = "{KEY_PREFIX}"\n'
        f'timeout_ms = {timeout_ms}\nmac_key_file = "mac-key"\n'
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="samples of (a)-(d) each")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16, help="K client coroutines in (f)")
    parser.add_argument("--seconds", type=float, default=2.0, help="(f): per side and round")
    parser.add_argument("--rounds", type=int, default=3, help="(f): gateway/echo alternations")
    parser.add_argument("--iterations", type=int, default=20000, help="(e): per prompt size")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument(
        "--redis-timeout-ms",
        type=float,
        default=50.0,
        help="gateways' [cache.redis] timeout_ms: roomy, so a hiccup never turns (c) into a miss",
    )
    parser.add_argument("--model-root", default="var/tiny")
    parser.add_argument("--profile", type=Path, help="py-spy raw profile of gateway 1 under load")
    record.add_flag(parser)
    args = parser.parse_args()

    _, repo = ensure_tiny_model(Path(args.model_root))
    tok_dir = (repo / "tensorrt_llm" / "tokenizer").resolve()
    fingerprint = (tok_dir.parent / "engine_fingerprint").read_text().strip()
    # Every process is stopped (and Redis killed) on the way out, whatever happened.
    with record.recording("cache", record.record_dir(args)), contextlib.ExitStack() as stack:
        work = stack.enter_context(run_dir("bench.cache"))
        backends = start_redis_and_engine(stack, work, repo)
        redis_server, engine_addr, engine = backends.redis, backends.engine_addr, backends.engine
        gateways = []
        (work / "mac-key").write_text("bench-cache-mac-key-shared-by-both-gateways\n")
        for name, l1_entries in (("gw1", None), ("gw2", 0)):
            addr = f"127.0.0.1:{processes.free_port()}"
            config = processes.write_gateway_config(
                work / f"{name}.toml", addr, MODEL, engine_addr, tok_dir
            )
            with config.open("a") as f:
                f.write(cache_tables(redis_server.url, args.redis_timeout_ms, l1_entries))
            proc = processes.spawn(["serve", "--config", str(config)], work / f"{name}.log")
            stack.callback(processes.stop, proc)
            gateways.append((addr, proc))
        echo_addr = f"127.0.0.1:{processes.free_port()}"
        echo = subprocess.Popen(
            [sys.executable, "-m", "bench.echo_server", "--port", echo_addr.rsplit(":", 1)[1]]
        )
        stack.callback(processes.stop, echo)
        for addr, proc in gateways:
            processes.wait_serving(addr, proc)
        setup = Setup(
            tok_dir,
            fingerprint,
            redis_server.url,
            gateways[0][0],
            gateways[1][0],
            echo_addr,
            gateways[0][1].pid,
            echo.pid,
            (
                os.getpid(),
                backends.redis_pid,
                engine.pid,
                *(p.pid for _, p in gateways),
                echo.pid,
            ),
        )
        uvloop.run(measure(args, setup))


async def wait_l2_key(client: aredis.Redis, timeout_s: float = 10.0) -> bytes:
    """The Redis key gateway 1 wrote back after its miss (the write is off the request path)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        keys = [k async for k in client.scan_iter(match=f"{KEY_PREFIX}:*")]
        if keys:
            assert len(keys) == 1, keys
            name: bytes = keys[0]
            return name
        await asyncio.sleep(0.01)
    raise RuntimeError("gateway 1 never wrote its answer to Redis")


async def measure(args: argparse.Namespace, s: Setup) -> None:
    assert HIREDIS_AVAILABLE, "redis-py without hiredis: (d) would not be the floor it claims"
    text = ModelText.load(s.tokenizer_dir)
    prompt = prompt_of(text, args.prompt_tokens)
    request = pb.GenerateRequest(
        model=MODEL, prompt=prompt, max_tokens=args.output_tokens, temperature=0
    )
    rds = aredis.Redis.from_url(s.redis_url)
    async with (
        grpc.aio.insecure_channel(s.gw1) as ch1,
        grpc.aio.insecure_channel(s.gw2) as ch2,
        grpc.aio.insecure_channel(s.echo) as ech,
    ):
        gw1, gw2 = pb_grpc.InferenceStub(ch1), pb_grpc.InferenceStub(ch2)
        echo_call = ech.unary_unary(METHOD)
        miss = await gw1.Complete(request, timeout=60)
        assert miss.final.cache_tier == pb.CACHE_TIER_MISS, miss.final
        name = await wait_l2_key(rds)
        value = await rds.get(name)
        assert isinstance(value, bytes)
        hit = await gw1.Complete(request)
        assert hit.final.cache_tier == L1_TIER, hit.final
        payload = hit.SerializeToString()
        l2 = await gw2.Complete(request)
        assert l2.final.cache_tier == L2_TIER, l2.final
        assert (l2.text, list(l2.token_ids)) == (hit.text, list(hit.token_ids))
        assert (await echo_call(payload, wait_for_ready=True)) == payload

        outside_abcd = outside_from(s)
        a, b, c, d, a_srv, c_srv, not_l2 = await latencies(
            args, gw1, gw2, echo_call, rds, request, name
        )
        outside = {"(a)-(d)": outside_abcd()}
        stats = await pb_grpc.CacheAdminStub(ch2).Stats(pb.CacheStatsRequest())
        faults = {k: v for k, v in stats.counters.items() if k.startswith(("l2_", "breaker"))}
        sizes = {
            "request": request.ByteSize(),
            "hit response": len(payload),
            "redis value": len(value),
            "completion tokens": len(hit.token_ids),
        }
        outside_e = outside_from(s)
        e = in_process(args, text, s.tokenizer_dir, s.fingerprint, hit)
        outside["(e)"] = outside_e()
        outside_h = outside_from(s)
        e |= await hit_path(args, text, s.tokenizer_dir, s.fingerprint, request, hit)
        outside["(h)"] = outside_h()
        f = await throughput(args, gw1, echo_call, request, payload, s)
        if args.profile:
            await profile(args, gw1, request, s)
    await rds.aclose()
    report(args, a, b, c, d, a_srv, c_srv, e, f, sizes, outside)
    print(f"gateway 2 answers not EXACT_L2 (left out of (c)): {not_l2 or 'none'}")
    print("gateway 2 Redis counters: " + ", ".join(f"{k} {v}" for k, v in sorted(faults.items())))


async def latencies(
    args: argparse.Namespace,
    gw1: pb_grpc.InferenceStub,
    gw2: pb_grpc.InferenceStub,
    echo_call: Any,
    rds: aredis.Redis,
    request: pb.GenerateRequest,
    name: bytes,
) -> tuple[list[float], list[float], list[float], list[float], list[float], list[float], list[str]]:
    """(a), (b), (c), (d) one after another, request by request; seconds. Plus the gateways' own
    arrival-to-final-message time for (a) and (c) (Final.timings.total_us), and the gateway 2
    answers that were not EXACT_L2 (a Redis GET over its time budget is a miss): those are left
    out of (c) and listed."""
    a: list[float] = []
    b: list[float] = []
    c: list[float] = []
    d: list[float] = []
    a_srv: list[float] = []
    c_srv: list[float] = []
    payload = (await gw1.Complete(request)).SerializeToString()
    clock = time.perf_counter_ns
    wrong = 0
    not_l2: list[str] = []
    for i in range(args.warmup + args.requests):
        t0 = clock()
        r1 = await gw1.Complete(request)
        t1 = clock()
        await echo_call(payload)
        t2 = clock()
        r2 = await gw2.Complete(request)
        t3 = clock()
        v = await rds.get(name)
        t4 = clock()
        wrong += (r1.final.cache_tier != L1_TIER) + (v is None)
        if r2.final.cache_tier != L2_TIER:
            tier = pb.CacheTier.Name(r2.final.cache_tier)
            not_l2.append(f"{tier} in {(t3 - t2) / 1e3:.0f} µs")
        if i >= args.warmup:
            a.append((t1 - t0) / 1e9)
            b.append((t2 - t1) / 1e9)
            d.append((t4 - t3) / 1e9)
            a_srv.append(r1.final.timings.total_us / 1e6)
            if r2.final.cache_tier == L2_TIER:
                c.append((t3 - t2) / 1e9)
                c_srv.append(r2.final.timings.total_us / 1e6)
    assert wrong == 0, f"{wrong} L1 answers with the wrong cache tier (or a missing Redis value)"
    limit = max(1, args.requests // 100)
    assert len(not_l2) <= limit, f"more than {limit} gateway 2 answers not EXACT_L2: {not_l2}"
    return a, b, c, d, a_srv, c_srv, not_l2


def text_of(size: int) -> str:
    """ASCII prose of exactly size bytes."""
    sentence = "The gateway answers a repeated question from its cache, without the engine. "
    return (sentence * (size // len(sentence) + 1))[:size]


# The limits write_gateway_config gives the gateways.
LIMITS = Limits(
    max_input_tokens=2047, max_output_tokens=512, default_max_tokens=64, context_length=2048
)


def identity_of(text: ModelText, tokenizer_dir: Path, fingerprint: str) -> ModelIdentity:
    """What the gateway's _identity hashes: the tokenizer files."""
    digest = hashlib.blake2b(digest_size=16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).is_file():
            digest.update((tokenizer_dir / name).read_bytes())
    return ModelIdentity(MODEL, fingerprint, digest.hexdigest(), text.template_version)


class StubContext:
    """What Generate and Complete ask of a grpc.aio context: no credentials, no deadline."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def time_remaining(self) -> float | None:
        return None


async def hit_path(
    args: argparse.Namespace,
    text: ModelText,
    tokenizer_dir: Path,
    fingerprint: str,
    request: pb.GenerateRequest,
    hit: pb.CompleteResponse,
) -> dict[str, list[float]]:
    """(h): InferenceService.Complete of an L1 hit in this process, with a stub context and no
    gRPC: all of the gateway's own Python for a hit (gate, route, check, key, lookup, replay, the
    reply, the metrics and the access line, formatted as text to /dev/null); seconds. Run after
    a full collection and gc.freeze, as the gateway runs."""
    model = ServedModel(
        name=MODEL,
        text=text,
        limits=LIMITS,
        # A hit never reaches the backend; the check stage reads only what it can do.
        backend=cast(
            Backend,
            SimpleNamespace(
                speculation=NO_SPECULATION,
                max_top_logprobs=0,
                guided=False,
                unserved={},
                engine_limits=NO_ENGINE_LIMITS,
            ),
        ),
        identity=identity_of(text, tokenizer_dir, fingerprint),
        policy=ModelPolicy(default_deadline_s=30.0, ttft_budget_s=None, fallback=None),
        health=ModelHealth(CircuitBreaker(5, 5.0)),
    )
    cache = make_cache(CacheConfig())
    assert cache is not None
    pipeline = Pipeline(
        {MODEL: model},
        cache,
        cast(Admission, None),  # nor admission
        Sinks(MetricsSink(GatewayMetrics()), AccessLog()),
    )
    service = InferenceService(pipeline)
    context = StubContext()
    access = logging.getLogger("appliance.access")
    devnull = open(os.devnull, "w")  # noqa: SIM115 (closed below)
    line = logging.StreamHandler(devnull)
    line.setFormatter(OneLineFormatter(FORMAT))
    saved = access.handlers, access.level, access.propagate
    # The access line is written whatever logging the caller set up (a test sets none).
    access.handlers, access.level, access.propagate = [line], logging.INFO, False
    try:
        checked = check(request_of(request), LIMITS)
        key = cache_key(
            checked.namespace, model.identity, checked.prompt, checked.messages,
            sampling_key(checked),
        )  # fmt: skip
        answer = CachedAnswer(hit.text, tuple(hit.token_ids), "stop", 128, len(hit.token_ids))
        cache.tiers[0].store(
            CacheQuery(key, checked.namespace, model.identity, checked.prompt, (), sampling_key(checked)),
            answer,
        )  # fmt: skip
        reply = await service.Complete(request, context)
        assert reply.final.cache_tier == L1_TIER, reply.final
        assert (reply.text, list(reply.token_ids)) == (hit.text, list(hit.token_ids))
        gc.collect()
        gc.freeze()
        clock = time.perf_counter_ns
        out = []
        for _ in range(args.iterations):
            t0 = clock()
            await service.Complete(request, context)
            out.append((clock() - t0) / 1e9)
        return {"(h) InferenceService.Complete of an L1 hit in-process (no gRPC)": out}
    finally:
        gc.unfreeze()
        access.handlers, access.level, access.propagate = saved
        devnull.close()
        pipeline.close()


def in_process(
    args: argparse.Namespace,
    text: ModelText,
    tokenizer_dir: Path,
    fingerprint: str,
    hit: pb.CompleteResponse,
) -> dict[str, list[float]]:
    """(e): the gateway's own functions, as _answer calls them before any await; seconds."""
    identity = identity_of(text, tokenizer_dir, fingerprint)
    limits = LIMITS
    answer = CachedAnswer(hit.text, tuple(hit.token_ids), "stop", 128, len(hit.token_ids))
    lru = LruCache(max_entries=10000, max_bytes=256 * 1024 * 1024, ttl_s=300.0)
    for i in range(lru.max_entries - 2):
        lru.put(hashlib.blake2b(str(i).encode(), digest_size=16).digest(), answer, ("d", MODEL))
    clock = time.perf_counter_ns
    out: dict[str, list[float]] = {}
    for size in (1024, 8192):
        req = pb.GenerateRequest(
            model=MODEL, prompt=text_of(size), max_tokens=args.output_tokens, temperature=0
        )
        checked = check(request_of(req), limits)
        key = cache_key(
            checked.namespace, identity, checked.prompt, checked.messages, sampling_key(checked)
        )
        lru.put(key, answer, (checked.namespace, MODEL))
        total, parts_check, parts_key, parts_get = [], [], [], []
        for _ in range(args.iterations):
            t0 = clock()
            ch = check(request_of(req), limits)
            t1 = clock()
            k = cache_key(ch.namespace, identity, ch.prompt, ch.messages, sampling_key(ch))
            t2 = clock()
            got = lru.get(k)
            t3 = clock()
            assert got is answer
            total.append((t3 - t0) / 1e9)
            parts_check.append((t1 - t0) / 1e9)
            parts_key.append((t2 - t1) / 1e9)
            parts_get.append((t3 - t2) / 1e9)
        kb = size // 1024
        out[f"(e) check + key + L1 get, {kb} KB prompt"] = total
        out[f"    of which request_of() + check(), {kb} KB"] = parts_check
        out[f"    of which cache_key(), {kb} KB"] = parts_key
        out[f"    of which LruCache.get(), {kb} KB"] = parts_get
    # (g) What recording a finished request costs: the metrics sink and the access log line (to a
    # handler that drops it: the cost of formatting, not of the terminal).
    metrics = GatewayMetrics()
    sink = MetricsSink(metrics)
    access = AccessLog()
    logging.getLogger("appliance.access").addHandler(logging.NullHandler())
    logging.getLogger("appliance.access").propagate = False
    logging.getLogger("appliance.access").setLevel(logging.INFO)
    miss = RequestReport(
        request_id="r", namespace="default", model=MODEL, answered_by=MODEL, tier="miss",
        finish_reason="stop", prompt_tokens=128, completion_tokens=args.output_tokens,
        queue_us=100, ttft_us=2000, total_us=90000, inter_token_us=[1500] * (args.output_tokens - 1),
    )  # fmt: skip
    hit_report = dataclasses.replace(miss, tier="l1", inter_token_us=[])
    for name, r in (("hit", hit_report), (f"miss, {args.output_tokens} tokens", miss)):
        m_cost, a_cost = [], []
        for _ in range(args.iterations):
            t0 = clock()
            sink.report(r)
            t1 = clock()
            access.report(r)
            t2 = clock()
            m_cost.append((t1 - t0) / 1e9)
            a_cost.append((t2 - t1) / 1e9)
        out[f"(g) metrics sink per request, {name}"] = m_cost
        out[f"(g) access log line per request, {name}"] = a_cost
    clock_cost = [(clock() - clock()) / -1e9 for _ in range(10000)]
    out["    (perf_counter_ns pair itself)"] = clock_cost
    return out


@dataclass
class Rate:
    requests: int
    wall_s: float
    server_cpu_s: float
    client_cpu_s: float
    box_busy_s: float
    outside_s: float

    @property
    def per_s(self) -> float:
        return self.requests / self.wall_s


async def closed_loop(
    call: Callable[[], Awaitable[bool]], k: int, seconds: float, server_pid: int, s: Setup
) -> Rate:
    """K coroutines calling back to back; counts what completes inside the measured window."""
    done = 0
    bad = 0
    stop = False

    async def worker() -> None:
        nonlocal done, bad
        while not stop:
            ok = await call()
            done += 1
            bad += not ok

    server = psutil.Process(server_pid)
    me = psutil.Process()
    tasks = [asyncio.create_task(worker()) for _ in range(k)]
    await asyncio.sleep(0.3)  # ramp up, not counted
    n0, t0 = done, time.perf_counter()
    s0, c0, box0, ours0 = server.cpu_times(), me.cpu_times(), box_busy_s(), ours_s(s.pids)
    await asyncio.sleep(seconds)
    n1, t1 = done, time.perf_counter()
    s1, c1, box1, ours1 = server.cpu_times(), me.cpu_times(), box_busy_s(), ours_s(s.pids)
    stop = True
    await asyncio.gather(*tasks)
    assert bad == 0, f"{bad} throughput responses with the wrong cache tier or payload"

    return Rate(
        n1 - n0,
        t1 - t0,
        cpu_s(s1) - cpu_s(s0),
        cpu_s(c1) - cpu_s(c0),
        box1 - box0,
        (box1 - box0) - (ours1 - ours0),
    )


async def throughput(
    args: argparse.Namespace,
    gw1: pb_grpc.InferenceStub,
    echo_call: Any,
    request: pb.GenerateRequest,
    payload: bytes,
    s: Setup,
) -> tuple[Rate, Rate]:
    async def hit() -> bool:
        r = await gw1.Complete(request)
        return bool(r.final.cache_tier == L1_TIER)

    async def echo() -> bool:
        return bool(len(await echo_call(payload)) == len(payload))

    gws: list[Rate] = []
    echoes: list[Rate] = []
    for _ in range(args.rounds):
        gws.append(await closed_loop(hit, args.concurrency, args.seconds, s.gw1_pid, s))
        echoes.append(await closed_loop(echo, args.concurrency, args.seconds, s.echo_pid, s))

    def total(rates: list[Rate]) -> Rate:
        return Rate(
            sum(r.requests for r in rates),
            sum(r.wall_s for r in rates),
            sum(r.server_cpu_s for r in rates),
            sum(r.client_cpu_s for r in rates),
            sum(r.box_busy_s for r in rates),
            sum(r.outside_s for r in rates),
        )

    return total(gws), total(echoes)


async def profile(
    args: argparse.Namespace, gw1: pb_grpc.InferenceStub, request: pb.GenerateRequest, s: Setup
) -> None:
    seconds = 10
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    proc = await asyncio.create_subprocess_exec(
        spy, "record", "-p", str(s.gw1_pid), "-d", str(seconds), "-f", "raw",
        "-o", str(args.profile), stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip

    async def hit() -> bool:
        await gw1.Complete(request)
        return True

    try:
        await closed_loop(hit, args.concurrency, seconds + 1.0, s.gw1_pid, s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        await proc.wait()
    print(f"py-spy profile of gateway 1 ({seconds} s of L1 hits): {args.profile}")


def report(
    args: argparse.Namespace,
    a: list[float],
    b: list[float],
    c: list[float],
    d: list[float],
    a_srv: list[float],
    c_srv: list[float],
    e: dict[str, list[float]],
    f: tuple[Rate, Rate],
    sizes: dict[str, int],
    outside: dict[str, float],
) -> None:
    us = 1e6

    def row(name: str, values: list[float]) -> str:
        return (
            f"| {name} | {np.percentile(values, 50) * us:9.2f} | {np.percentile(values, 99) * us:9.2f} "
            f"| {statistics.fmean(values) * us:9.2f} | {len(values)} |"
        )

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"\ncache hits: {args.requests} requests each of (a)-(d) after {args.warmup} warm-up, "
        f"interleaved a,b,c,d; {os.cpu_count()} CPUs; load average at the end {load}"
    )
    print("sizes (bytes): " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    busy = ", ".join(f"during {k} {v:.2f}" for k, v in outside.items())
    print(f"cores busy outside this benchmark's processes: {busy}; (f) below")
    print("\n| measure (µs) | P50 | P99 | mean | n |\n|---|---:|---:|---:|---:|")
    print(row("(a) L1 hit, Complete via gateway 1 (client-side)", a))
    print(row("(b) bare grpc.aio unary echo, same payload size", b))
    print(row("(c) L2 hit, Complete via gateway 2 (l1_max_entries = 0)", c))
    print(row("(d) bare redis-py asyncio GET (hiredis), same value", d))
    print(row("    (a) gateway-side arrival → final built", a_srv))
    print(row("    (c) gateway-side arrival → final built", c_srv))
    for name, values in e.items():
        print(row(name, values))

    gw, echo = f
    print(
        f"\n(f) throughput, {args.concurrency} client coroutines in this one process, "
        f"{args.rounds} alternating rounds of {args.seconds:.1f} s per side:"
    )
    print(
        "| side | requests/s | server cores | client cores | whole box busy (of 2) "
        "| of which outside the benchmark | requests per server core-second |"
        "\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for label, r in (("L1 hits via gateway 1", gw), ("bare echo", echo)):
        print(
            f"| {label} | {r.per_s:9.0f} | {r.server_cpu_s / r.wall_s:.2f} "
            f"| {r.client_cpu_s / r.wall_s:.2f} | {r.box_busy_s / r.wall_s:.2f} "
            f"| {r.outside_s / r.wall_s:.2f} "
            f"| {r.requests / r.server_cpu_s:9.0f} |"
        )

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    ratio_a = np.percentile(a, 99) / np.percentile(b, 99)
    print(f"\n(a) P99 / (b) P99 = {ratio_a:.3f} (target <= 1.25): {verdict(bool(ratio_a <= 1.25))}")
    for q, label in ((50, "P50"), (99, "P99")):
        extra = (np.percentile(c, q) - np.percentile(a, q)) * us
        floor = np.percentile(d, q) * us
        ratio = extra / floor
        print(
            f"(c) - (a) {label} = {extra:.1f} µs vs (d) {label} {floor:.1f} µs -> "
            f"{ratio:.3f} x (target <= 1.2): {verdict(bool(ratio <= 1.2))}"
        )
    e1 = np.percentile(e["(e) check + key + L1 get, 1 KB prompt"], 50) * us
    print(f"(e) P50 at 1 KB = {e1:.2f} µs (target <= 10 µs): {verdict(bool(e1 <= 10.0))}")
    ratio_f = gw.per_s / echo.per_s
    per_core = (gw.requests / gw.server_cpu_s) / (echo.requests / echo.server_cpu_s)
    print(
        f"(f) L1-hit requests/s / echo requests/s = {ratio_f:.3f} (target >= 0.8): "
        f"{verdict(ratio_f >= 0.8)}; per server core-second: {per_core:.2f}"
    )


if __name__ == "__main__":
    main()
