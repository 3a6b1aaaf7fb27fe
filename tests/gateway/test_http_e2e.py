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
