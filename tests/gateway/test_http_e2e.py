"""The HTTP API end to end with real processes: `appliance serve` with an [http] listener in front of
the engine server process, spoken to by the `openai` SDK (synchronous client) and by curl."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from appliance.client import generate
from appliance.tools import processes
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Tiny
from tests.gateway.test_http_api import grpc_chat

MODEL = "tiny"


@dataclass(frozen=True)
class Gateway:
    grpc: str
    http: str


@pytest.fixture(scope="module")
def gateway(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("http-e2e")
    engine_addr = f"127.0.0.1:{processes.free_port()}"
    gateway_addr = f"127.0.0.1:{processes.free_port()}"
    http_addr = f"127.0.0.1:{processes.free_port()}"
    config = processes.write_gateway_config(
        work / "gateway.toml",
        gateway_addr,
        MODEL,
        engine_addr,
        tiny.tokenizer_dir,
        http_listen=http_addr,
    )
    engine = processes.spawn(
        ["engine", "--repository", str(tiny.repo), "--listen", engine_addr], work / "engine.log"
    )
    gateway = processes.spawn(["serve", "--config", str(config)], work / "gateway.log")
    try:
        processes.wait_serving(gateway_addr, gateway)
        yield Gateway(gateway_addr, f"http://{http_addr}")
    finally:
        codes = processes.stop(gateway), processes.stop(engine)
        assert codes == (0, 0), (work / "gateway.log").read_text()[-2000:]


def _curl(*args: str) -> str:
    out = subprocess.run(
        ["curl", "-sS", "--max-time", "60", *args], capture_output=True, text=True, check=True
    )
    return out.stdout


async def test_sdk_curl_and_grpc_agree(gateway: Gateway) -> None:
    import grpc

    client = openai.OpenAI(base_url=gateway.http + "/v1", api_key="unused", max_retries=0)
    chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello from HTTP"}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=chat,
        max_tokens=10,
        temperature=0,
    )
    assert reply.choices[0].message.content
    assert (reply.model_extra or {})["appliance"]["cache_tier"] == "miss"
    # The same question through gRPC: answered from the cache the HTTP request filled.
    async with grpc.aio.insecure_channel(gateway.grpc) as channel:
        result = await generate(
            pb_grpc.InferenceStub(channel),
            pb.GenerateRequest(
                model=MODEL,
                messages=grpc_chat(chat),
                max_tokens=10,
                temperature=0,
            ),
        )
    assert result.text == reply.choices[0].message.content
    assert result.final.cache_tier == pb.CACHE_TIER_EXACT_L1
    # curl, streaming: the events end with [DONE].
    body = json.dumps(
        {"model": MODEL, "messages": chat, "max_tokens": 10, "temperature": 0, "stream": True}
    )
    events = _curl(
        "-N",
        gateway.http + "/v1/chat/completions",
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
    ).split("\n\n")
    assert events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == reply.choices[0].message.content
    assert json.loads(_curl(gateway.http + "/health")) == {"status": "SERVING"}
    assert [m.id for m in client.models.list()] == [MODEL]


def _long(topic: str, question: str) -> str:
    """A long preamble about `topic` (many KV blocks) before `question`."""
    preamble = " ".join(f"{topic} fact number {i} is worth remembering." for i in range(40))
    return f"{preamble}\nQuestion: {question}"


def test_sdk_reads_the_prompt_tokens_the_engine_reused(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=gateway.http + "/v1", api_key="unused", max_retries=0)

    def ask(question: str) -> openai.types.CompletionUsage:
        completion = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": _long("Otter", question)}],
            max_tokens=4,
            temperature=0,
        )
        assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
        return completion.usage

    first = ask("where?")
    assert first.prompt_tokens_details is not None
    assert first.prompt_tokens_details.cached_tokens == 0
    second = ask("when?")
    assert second.prompt_tokens_details is not None
    cached = second.prompt_tokens_details.cached_tokens or 0
    # Whole blocks of the shared preamble (the tiny repository's 32 tokens each).
    assert 0 < cached < second.prompt_tokens and cached % 32 == 0


def test_continuous_usage_stats_count_every_chunk(gateway: Gateway) -> None:
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "Count with me",
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
    )
    events = _curl(
        "-N", gateway.http + "/v1/completions", "-H", "Content-Type: application/json", "-d", body
    ).split("\n\n")
    assert events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all("usage" in c for c in chunks), chunks
    so_far = [c["usage"]["completion_tokens"] for c in chunks]
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    assert so_far == sorted(so_far) and so_far[-1] == 6 and len(prompt) == 1
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
        for c in chunks
    )
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
