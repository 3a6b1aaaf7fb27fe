"""The main job (`make demo`): engine server and gateway as two processes, a few streamed requests,
client-side TTFT and inter-token latency per request, then a clean shutdown of both."""

from __future__ import annotations

import asyncio
from pathlib import Path

from appliance import processes
from appliance.client import StreamResult, connect, generate
from appliance.v1 import inference_pb2 as pb

MODEL = "tiny-llama"
PROMPTS = [
    "The gateway streams tokens from the engine",
    "Explain why a batch size of one keeps latency low.",
    "Huge pages, pinned interrupts and C-states:",
    "Caches answer repeated questions without the GPU. Café, naïve, 東京 🚀",
]


def _requests(n: int, max_tokens: int) -> list[pb.GenerateRequest]:
    out = []
    for i in range(n):
        if i % len(PROMPTS) == 1:
            chat = pb.ChatMessages(
                messages=[
                    pb.ChatMessage(role="system", content="You are terse."),
                    pb.ChatMessage(role="user", content=PROMPTS[i % len(PROMPTS)]),
                ]
            )
            out.append(pb.GenerateRequest(model=MODEL, messages=chat, max_tokens=max_tokens))
        else:
            out.append(
                pb.GenerateRequest(
                    model=MODEL,
                    prompt=PROMPTS[i % len(PROMPTS)],
                    max_tokens=max_tokens,
                    temperature=0.8,
                    top_p=0.95,
                    seed=i,
                )
            )
    # The first question again: answered from the gateway's cache, without the engine.
    return [*out, out[0]] if out else out


async def _run_requests(address: str, n: int, max_tokens: int) -> list[StreamResult]:
    channel, stub = connect(address)
    async with channel:
        return [await generate(stub, r) for r in _requests(n, max_tokens)]


def _report(results: list[StreamResult]) -> None:
    print(
        f"\n{'#':>2} {'in':>4} {'out':>4} {'TTFT ms':>8} {'ITL ms':>7} {'finish':>7} {'cache':>8}  text"
    )
    for i, r in enumerate(results, 1):
        finish = pb.FinishReason.Name(r.final.finish_reason).removeprefix("FINISH_REASON_")
        tier = pb.CacheTier.Name(r.final.cache_tier).removeprefix("CACHE_TIER_")
        preview = r.text.replace("\n", " ")[:40]
        itl = (
            f"{r.inter_token_s * 1e3:>7.3f}"
            if r.final.cache_tier == pb.CACHE_TIER_MISS
            else "      -"
        )
        print(
            f"{i:>2} {r.final.usage.prompt_tokens:>4} {r.final.usage.completion_tokens:>4} "
            f"{r.ttft_s * 1e3:>8.2f} {itl} {finish:>7} {tier:>8}  {preview!r}"
        )
    print("TTFT and ITL as the client measures them (genai-perf definitions); a cache hit arrives")
    print("as one message, so it has no inter-token latency.")


def run_demo(workdir: Path, n: int, max_tokens: int) -> int:
    from appliance.tiny_model import ensure_tiny_model

    workdir.mkdir(parents=True, exist_ok=True)
    _, repo = ensure_tiny_model(workdir / "tiny")
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    gateway_addr = f"127.0.0.1:{processes.free_port()}"
    config = processes.write_gateway_config(
        workdir / "gateway.toml",
        gateway_addr,
        MODEL,
        engine_addr,
        (repo / "tensorrt_llm" / "tokenizer").resolve(),
    )
    print(f"engine server on {engine_addr}, gateway on {gateway_addr} (logs in {workdir})")
    engine = processes.spawn(
        ["engine", "--repository", str(repo), "--listen", engine_addr], workdir / "engine.log"
    )
    gateway = processes.spawn(["serve", "--config", str(config)], workdir / "gateway.log")
    try:
        processes.wait_serving(gateway_addr, gateway)
        results = asyncio.run(_run_requests(gateway_addr, n, max_tokens))
        _report(results)
    finally:
        codes = processes.stop(gateway), processes.stop(engine)
    print(f"gateway exited {codes[0]}, engine exited {codes[1]}")
    return 0 if codes == (0, 0) else 1
