"""The gateway's event loop while it reads the largest requests its limits admit.

A gateway runs in this process's event loop (real gRPC and HTTP over loopback, the tiny model's
engine server as a process), beside a probe: a coroutine that sleeps 1 ms at a time and records
each gap between its wake-ups. Each case sends its requests one after another, each built and
encoded before the case starts (the client's own JSON work is not measured), and reports the
longest gap and the P99 gap of the probe meanwhile, with the requests' mean wall time. A gap
is at least the probe's 1 ms sleep; anything above that is time something held the loop (or
the GIL, from another thread).

The cases: a baseline of small chats; a chat whose history holds MAX_PAST_CALLS past calls with
nested arguments, one call of nested arguments, one call of an object of many keys, one call of
one long string (each request up to the body limit, HTTP's max_body_bytes and gRPC's 4 MiB);
MAX_TOOLS tools whose parameters schemas fill MAX_SCHEMA_BYTES; a json_schema guide of
MAX_GUIDE_BYTES; an HTTP body of the size limit made of many small messages. The tokenizer
config's context is raised (a copy: the model itself is the tiny one) so that the gateway's
bound on a request's characters admits bodies of the size limits, as a long-context model's
does; such a request is refused after it was checked and tokenized (longer than the engine's
context), which is all the gateway does with it before the engine.

A second table runs each gRPC case's check stage alone (read, checked, its past calls parsed,
written and keyed) on a worker thread beside the probe: the gaps the JSON work leaves, without
the tokenize stage's or a garbage collection's that other work triggered.

    python -m bench.loop_lag                # 3 requests a case
    python -m bench.loop_lag --requests 5 --record
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import uvloop

from appliance.config import load_config
from appliance.gateway.json_body import MAX_VALUES
from appliance.gateway.messages import request_of
from appliance.gateway.models import load_models
from appliance.gateway.request import MAX_MESSAGES, Limits, check
from appliance.gateway.server import keep_long_lived_from_gc, start_server
from appliance.gateway.tool_calls import MAX_PAST_CALLS, MAX_SCHEMA_BYTES, MAX_TOOLS
from appliance.grpc_limits import MAX_REQUEST_BYTES
from appliance.tools import processes
from appliance.tools.tiny_model import ensure_tiny_model
from appliance.v1 import inference_pb2 as pb
from bench import record

MODEL = "tiny"
COMPLETE = "/appliance.v1.Inference/Complete"
# What a request may take beside its bulk: the rest of the body or message.
MARGIN = 4096
GUIDE_BYTES = 64 * 1024


@dataclass
class Case:
    name: str
    api: str  # "grpc" or "http"
    payload: bytes


class Probe:
    """Sleeps 1 ms at a time and keeps the gaps between its wake-ups (seconds)."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    def start(self) -> None:
        self.gaps = []
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> list[float]:
        """The gaps so far, after one more wake-up (a case shorter than the sleep has one)."""
        assert self._task is not None
        count = len(self.gaps)
        while len(self.gaps) == count:
            await asyncio.sleep(0.001)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return self.gaps


# -- the requests ------------------------------------------------------------------------------


def nested_value(chars: int, seed: int = 0) -> dict[str, Any]:
    """An object of small nested values whose compact JSON is about `chars` long."""
    items: list[Any] = []
    size = 0
    i = seed
    while size < chars:
        item = {"id": i, "name": f"n{i}", "tags": ["a", "b", {"x": 1.5, "y": None}], "v": [i, -0.0]}
        items.append(item)
        size += len(json.dumps(item, separators=(",", ":"))) + 1
        i += 1
    return {"items": items}


def many_keys(chars: int) -> dict[str, Any]:
    """An object of many short keys whose compact JSON is about `chars` long."""
    return {f"k{i:07d}": i for i in range(chars // 16)}


def long_string(chars: int) -> dict[str, Any]:
    return {"text": "lorem ipsum " * (chars // 12)}


def fit(build: Callable[[int], bytes], limit: int) -> bytes:
    """build(size) for the largest size tried (halving its excess) whose bytes fit `limit`."""
    size = limit
    while True:
        data = build(size)
        if len(data) <= limit:
            return data
        size = int(size * limit / len(data) * 0.98)


def history(calls: list[str]) -> list[dict[str, Any]]:
    """A chat whose assistant message made `calls` (arguments texts), with their results."""
    return [
        {"role": "user", "content": "Look these up."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": f"c{i}", "name": "lookup", "arguments": a} for i, a in enumerate(calls)
            ],
        },
        {"role": "tool", "content": "done", "tool_call_id": "c0"},
    ]


def http_body(messages: list[dict[str, Any]], **extra: Any) -> bytes:
    wired = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in m["tool_calls"]
            ]
        wired.append(m)
    body = {"model": MODEL, "max_tokens": 1, "messages": wired, **extra}
    return json.dumps(body).encode()


def grpc_message(messages: list[dict[str, Any]], **extra: Any) -> bytes:
    chat = pb.ChatMessages()
    for m in messages:
        message = chat.messages.add(
            role=m["role"], content=m["content"], tool_call_id=m.get("tool_call_id", "")
        )
        for c in m.get("tool_calls", ()):
            message.tool_calls.add(name=c["name"], arguments=c["arguments"], id=c["id"])
    request = pb.GenerateRequest(model=MODEL, max_tokens=1, messages=chat, **extra)
    return request.SerializeToString()


def _chat_of(
    encode: Callable[..., bytes], make: Callable[[int], list[str]]
) -> Callable[[int], bytes]:
    """A request of a history whose past calls' arguments `make` makes for a size."""
    return lambda n: encode(history(make(n)))


def tool_schemas() -> list[tuple[str, dict[str, Any]]]:
    """MAX_TOOLS tools whose parameters schemas (many small properties) fill MAX_SCHEMA_BYTES."""
    each = MAX_SCHEMA_BYTES // MAX_TOOLS - 64
    tools = []
    for t in range(MAX_TOOLS):
        properties: dict[str, Any] = {}
        schema = {"type": "object", "properties": properties}
        while len(json.dumps(schema)) < each:
            properties[f"p{len(properties)}"] = {"type": "integer"}
        tools.append((f"tool{t}", schema))
    return tools


def guide_schema() -> str:
    """A JSON Schema of about GUIDE_BYTES of small properties."""
    properties: dict[str, Any] = {}
    schema = {"type": "object", "properties": properties}
    while len(json.dumps(schema)) < GUIDE_BYTES - 64:
        properties[f"p{len(properties)}"] = {"type": "string"}
    return json.dumps(schema)


def cases(max_body: int) -> list[Case]:
    small = [{"role": "user", "content": "Say hello."}]
    out = [
        Case("baseline: small chat", "grpc", grpc_message(small)),
        Case("baseline: small chat", "http", http_body(small)),
    ]
    per_call = {
        "grpc": MAX_REQUEST_BYTES - MARGIN,
        "http": max_body - MARGIN,
    }
    encode: dict[str, Callable[..., bytes]] = {"grpc": grpc_message, "http": http_body}
    shapes: list[tuple[str, Callable[[int], list[str]]]] = [
        (
            f"{MAX_PAST_CALLS} past calls, nested arguments",
            lambda n: [
                json.dumps(nested_value(n // MAX_PAST_CALLS // 2, i)) for i in range(MAX_PAST_CALLS)
            ],
        ),
        ("1 past call, nested arguments", lambda n: [json.dumps(nested_value(n // 2))]),
        ("1 past call, an object of many keys", lambda n: [json.dumps(many_keys(n // 2))]),
        ("1 past call, one long string", lambda n: [json.dumps(long_string(n))]),
    ]
    for api in ("grpc", "http"):
        for name, make in shapes:
            out.append(Case(name, api, fit(_chat_of(encode[api], make), per_call[api])))
    tools = tool_schemas()
    tool_chat = [{"role": "user", "content": "Call one."}]
    out.append(
        Case(
            f"{MAX_TOOLS} tools, {MAX_SCHEMA_BYTES // 1024} KiB of schemas",
            "grpc",
            grpc_message(
                tool_chat,
                tools=pb.Tools(tools=[pb.Tool(name=n, parameters=json.dumps(s)) for n, s in tools]),
            ),
        )
    )
    out.append(
        Case(
            f"{MAX_TOOLS} tools, {MAX_SCHEMA_BYTES // 1024} KiB of schemas",
            "http",
            http_body(
                tool_chat,
                tools=[
                    {"type": "function", "function": {"name": n, "parameters": s}} for n, s in tools
                ],
            ),
        )
    )
    guide = guide_schema()
    out.append(
        Case(
            f"json_schema guide of {GUIDE_BYTES // 1024} KiB",
            "grpc",
            grpc_message(small, guide=pb.Guide(type=pb.GUIDE_TYPE_JSON_SCHEMA, guide=guide)),
        )
    )
    out.append(
        Case(
            f"json_schema guide of {GUIDE_BYTES // 1024} KiB",
            "http",
            http_body(
                small,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "g", "schema": json.loads(guide)},
                },
            ),
        )
    )
    # MAX_MESSAGES messages of text parts: about json_body.MAX_VALUES values in all.
    parts = MAX_VALUES // MAX_MESSAGES // 2 - 1
    many = fit(
        lambda n: http_body(
            [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "x" * max(1, n // 40_000)}] * parts,
                }
                for _ in range(MAX_MESSAGES)
            ]
        ),
        max_body - MARGIN,
    )
    out.append(Case(f"body of {MAX_MESSAGES} messages of {parts} text parts", "http", many))
    return out


# -- the run -----------------------------------------------------------------------------------


def long_context_tokenizer(source: Path, work: Path) -> Path:
    """A copy of the tokenizer whose config names a context of 131072 tokens."""
    target = work / "tensorrt_llm" / "tokenizer"
    shutil.copytree(source, target)
    shutil.copy(source.parent / "engine_fingerprint", target.parent / "engine_fingerprint")
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = 131072
    (target / "config.json").write_text(json.dumps(config))
    return target


async def send(
    case: Case, channel: grpc.aio.Channel, session: aiohttp.ClientSession, http_url: str
) -> str:
    """The request's outcome: its status (gRPC) or HTTP status."""
    if case.api == "grpc":
        call = channel.unary_unary(COMPLETE, response_deserializer=pb.CompleteResponse.FromString)
        try:
            await call(case.payload, timeout=120)
        except grpc.aio.AioRpcError as exc:
            return str(exc.code().name)
        return "OK"
    async with session.post(
        http_url, data=case.payload, headers={"Content-Type": "application/json"}
    ) as reply:
        await reply.read()
        return str(reply.status)


def gap_row(gaps: list[float]) -> tuple[float, float]:
    """The longest and the P99 gap, in ms."""
    ordered = sorted(gaps)
    return ordered[-1] * 1000, ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


async def check_stage(all_cases: list[Case], requests: int) -> list[dict[str, Any]]:
    """Each gRPC case's check stage alone (the request read and checked: its past calls parsed,
    written and keyed), on a worker thread as the pipeline runs a long chat's, beside the probe:
    the gaps the JSON work leaves, without the tokenize stage's or the engine's."""
    limits = Limits(
        max_input_tokens=131071,
        max_output_tokens=512,
        default_max_tokens=64,
        context_length=131072,
        max_input_chars=8 * 2**20,
    )
    loop = asyncio.get_running_loop()
    probe = Probe()
    rows: list[dict[str, Any]] = []
    print(f"\nThe check stage alone on a worker thread, {requests} requests a case")
    print("| case | request KiB | mean s | longest gap ms | P99 gap ms |")
    print("|---|---:|---:|---:|---:|")
    for case in all_cases:
        if case.api != "grpc":
            continue
        message = pb.GenerateRequest.FromString(case.payload)
        probe.start()
        started = time.perf_counter()
        for _ in range(requests):
            await loop.run_in_executor(None, check, request_of(message), limits, "")
        wall = (time.perf_counter() - started) / requests
        longest, p99 = gap_row(await probe.stop())
        print(
            f"| {case.name} | {len(case.payload) / 1024:,.0f} | {wall:.2f} | {longest:.1f} | {p99:.1f} |"
        )
        rows.append(
            {"case": case.name, "mean_s": wall, "longest_gap_ms": longest, "p99_gap_ms": p99}
        )
    return rows


async def measure(args: argparse.Namespace, work: Path, stack: ExitStack) -> dict[str, Any]:
    _, repo = ensure_tiny_model(Path(args.model_root))
    tokenizer = long_context_tokenizer(repo / "tensorrt_llm" / "tokenizer", work)
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    engine = processes.spawn(
        ["engine", "--repository", str(repo), "--listen", engine_addr], work / "engine.log"
    )
    stack.callback(processes.stop, engine)
    http_addr = f"127.0.0.1:{processes.free_port()}"
    path = processes.write_gateway_config(
        work / "g.toml",
        f"127.0.0.1:{processes.free_port()}",
        MODEL,
        engine_addr,
        tokenizer,
        http_listen=http_addr,
    )
    path.write_text(path.read_text().replace("[server]\n", "[server]\naccess_log = false\n"))
    config = load_config(path)
    gateway = await start_server(config, await load_models(config))
    keep_long_lived_from_gc(gateway)  # as `appliance serve` does
    rows: list[dict[str, Any]] = []
    probe = Probe()
    try:
        http_url = f"http://{http_addr}/v1/chat/completions"
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel,
            aiohttp.ClientSession() as session,
        ):
            all_cases = cases(config.http.max_body_bytes)
            for case in all_cases[:2]:  # warm both paths (the first HTTP body's decoder, etc.)
                await send(case, channel, session, http_url)
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"\n{args.requests} requests a case, one at a time; gaps of a 1 ms sleep")
            print(f"load average at the start: {load} ({os.cpu_count()} CPUs)")
            print("| case | API | request KiB | outcome | mean s | longest gap ms | P99 gap ms |")
            print("|---|---|---:|---|---:|---:|---:|")
            for case in all_cases:
                if args.only not in case.name:
                    continue
                outcomes: set[str] = set()
                probe.start()
                started = time.perf_counter()
                for _ in range(args.requests):
                    outcomes.add(await send(case, channel, session, http_url))
                wall = (time.perf_counter() - started) / args.requests
                gaps = await probe.stop()
                longest, p99 = gap_row(gaps)
                kib = len(case.payload) / 1024
                shown = ", ".join(sorted(outcomes))
                print(
                    f"| {case.name} | {case.api} | {kib:,.0f} | {shown} | {wall:.2f} "
                    f"| {longest:.1f} | {p99:.1f} |"
                )
                rows.append(
                    {
                        "case": case.name,
                        "api": case.api,
                        "request_bytes": len(case.payload),
                        "outcomes": sorted(outcomes),
                        "mean_s": wall,
                        "longest_gap_ms": longest,
                        "p99_gap_ms": p99,
                        "median_gap_ms": statistics.median(gaps) * 1000,
                    }
                )
            checks = await check_stage(all_cases, args.requests)
    finally:
        await gateway.drain(0.5)
    return {"gateway": rows, "check_stage": checks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-root", default="var/tiny", help="where the tiny model is made")
    parser.add_argument("--requests", type=int, default=3, help="requests a case")
    parser.add_argument("--only", default="", help="run only the cases whose name holds this")
    record.add_flag(parser)
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    with record.recording(
        "loop_lag", record.record_dir(args), None if argv is None else list(argv)
    ) as run_record:
        work = Path(tempfile.mkdtemp(prefix="loop-lag-"))
        with ExitStack() as stack:
            stack.callback(shutil.rmtree, work, True)
            run_record.results.update(uvloop.run(measure(args, work, stack)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
