"""Speculative decoding through the gateway: an engine server process started with `--speculative
ngram` behind `appliance serve`, over gRPC and HTTP. The final message counts the answer's draft
tokens, a request that switches speculation off gets the same greedy answer without drafts, the
counters reach /metrics; drafts asked of a model without a drafter are refused."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import pytest

from appliance.gateway.server import RunningGateway
from appliance.tools import processes
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny
from tests.gateway.test_inprocess import _gateway
from tests.support import gateway_config

MODEL = "tiny"
# A repeated phrase: prompt lookup has n-grams to copy from the first decode step.
PROMPT = "one two three four five " * 6


@dataclass(frozen=True)
class Stack:
    grpc: str
    http: str
    metrics: str


@pytest.fixture(scope="module")
def stack(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("spec-e2e")
    engine_addr, gateway_addr, http_addr, metrics_addr = (
        f"127.0.0.1:{processes.free_port()}" for _ in range(4)
    )
    config = processes.write_gateway_config(
        work / "gateway.toml",
        gateway_addr,
        MODEL,
        engine_addr,
        tiny.tokenizer_dir,
        http_listen=http_addr,
    )
    config.write_text(config.read_text() + f'\n[metrics]\nlisten = "{metrics_addr}"\n')
    engine = processes.spawn(
        [
            "engine",
            "--repository",
            str(tiny.repo),
            "--listen",
            engine_addr,
            "--speculative",
            "ngram",
        ],
        work / "engine.log",
    )
    gateway = processes.spawn(["serve", "--config", str(config)], work / "gateway.log")
    try:
        processes.wait_serving(gateway_addr, gateway)
        yield Stack(gateway_addr, f"http://{http_addr}", f"http://{metrics_addr}/metrics")
    finally:
        codes = processes.stop(gateway), processes.stop(engine)
        assert codes == (0, 0), (work / "gateway.log").read_text()[-2000:]


def request(**kw: object) -> pb.GenerateRequest:
    """Greedy, and never from the cache: each request is generated."""
    fields: dict[str, object] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0.0,
        "cache_policy": pb.CACHE_POLICY_BYPASS,
    }
    return pb.GenerateRequest(**{**fields, **kw})  # type: ignore[arg-type]


async def complete(address: str, req: pb.GenerateRequest) -> pb.CompleteResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        reply: pb.CompleteResponse = await pb_grpc.InferenceStub(channel).Complete(req, timeout=60)
        return reply


def http_complete(base: str, **appliance: object) -> dict[str, object]:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "appliance": {"cache_policy": "bypass", **appliance},
    }
    req = urllib.request.Request(
        base + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as response:
        answer: dict[str, object] = json.load(response)
        return answer


def counter(metrics: str, name: str) -> float:
    with urllib.request.urlopen(metrics, timeout=10) as response:
        text = response.read().decode()
    series = f'{name}{{model="{MODEL}"}} '
    values = [float(line[len(series) :]) for line in text.splitlines() if line.startswith(series)]
    return values[0] if values else 0.0


async def test_grpc_final_counts_drafts_and_false_switches_them_off(stack: Stack) -> None:
    drafted = await complete(stack.grpc, request())
    assert drafted.final.draft_tokens > 0
    assert drafted.final.accepted_draft_tokens <= drafted.final.draft_tokens
    plain = await complete(stack.grpc, request(speculation=False))
    assert plain.text == drafted.text
    assert (plain.final.draft_tokens, plain.final.accepted_draft_tokens) == (0, 0)
    asked = await complete(stack.grpc, request(speculation=True))
    assert asked.final.draft_tokens == drafted.final.draft_tokens


async def test_http_extension_counts_drafts(stack: Stack) -> None:
    drafted = http_complete(stack.http)["appliance"]
    assert isinstance(drafted, dict) and drafted["draft_tokens"] > 0
    assert 0 <= drafted["accepted_draft_tokens"] <= drafted["draft_tokens"]
    plain = http_complete(stack.http, speculation=False)["appliance"]
    assert isinstance(plain, dict)
    assert (plain["draft_tokens"], plain["accepted_draft_tokens"]) == (0, 0)


async def test_counters_add_up_the_final_messages(stack: Stack) -> None:
    drafts = counter(stack.metrics, "appliance_spec_draft_tokens_total")
    accepted = counter(stack.metrics, "appliance_spec_accepted_draft_tokens_total")
    reply = await complete(stack.grpc, request())
    assert reply.final.draft_tokens > 0
    # The report reaches the sink as the request ends; the scrape after the reply sees it.
    assert counter(stack.metrics, "appliance_spec_draft_tokens_total") == (
        drafts + reply.final.draft_tokens
    )
    assert counter(stack.metrics, "appliance_spec_accepted_draft_tokens_total") == (
        accepted + reply.final.accepted_draft_tokens
    )


@pytest.fixture
async def plain_gateway(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    running = await _gateway(gateway_config(tiny.tokenizer_dir, engine.address))
    yield running
    await running.drain(0.5)


async def test_drafts_asked_of_a_model_without_a_drafter_are_refused(
    plain_gateway: RunningGateway,
) -> None:
    address = f"127.0.0.1:{plain_gateway.port}"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await complete(address, request(speculation=True))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model 'tiny'" in (refused.value.details() or "")
    # Refused before the cache: a cached answer to the same question changes nothing.
    cached = request(speculation=None, cache_policy=pb.CACHE_POLICY_DEFAULT)
    assert (await complete(address, cached)).final.draft_tokens == 0
    with pytest.raises(grpc.aio.AioRpcError) as again:
        await complete(address, request(speculation=True, cache_policy=pb.CACHE_POLICY_DEFAULT))
    assert again.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Off is what the model does anyway: served.
    assert (await complete(address, request(speculation=False))).final.draft_tokens == 0
