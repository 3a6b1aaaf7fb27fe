"""Cached prompt tokens: the engine's reused KV blocks (the TensorRT-LLM backend's
`return_perf_metrics` output `kv_cache_reused_blocks`) as the prompt tokens a client is told were
cached, in the gRPC final message's usage, OpenAI's `usage.prompt_tokens_details.cached_tokens`
and the gateway's counter. An answer from the gateway's own cache claims none; a server that does
not report reuse (an older Triton) means 0, never an error. The engine server stands in."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as ts

from appliance.backends.triton import cached_tokens
from appliance.engine.server import EngineService
from appliance.gateway.server import RunningGateway
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from engine_build.pbtxt import KV_CACHE_OUTPUTS, PERF_METRICS_INPUT, PERF_OUTPUTS
from tests.conftest import Engine, Tiny
from tests.gateway.test_http_api import _client
from tests.gateway.test_top_logprobs import gateway_before

# The tiny repository's block size (engine-build's default: TensorRT-LLM 1.2's).
BLOCK = 32


def prompt(topic: str, question: str) -> str:
    """A long shared preamble (many KV blocks) about `topic`, then `question`."""
    preamble = " ".join(f"{topic} fact number {i} is worth remembering." for i in range(40))
    return f"{preamble}\nQuestion: {question}"


async def complete(gateway: RunningGateway, text: str) -> pb.CompleteResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        request = pb.GenerateRequest(model="tiny", prompt=text, max_tokens=3, temperature=0)
        reply: pb.CompleteResponse = await pb_grpc.InferenceStub(channel).Complete(request)
        return reply


def counted(gateway: RunningGateway) -> float:
    value = gateway.metrics.registry.get_sample_value(
        "appliance_cached_prompt_tokens_total", {"model": "tiny"}
    )
    return value or 0.0


@pytest.fixture
async def gateway(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    async for running in gateway_before(EngineService(engine.models), tiny):
        yield running


async def test_a_shared_prefix_is_reported_cached_and_a_cache_hit_claims_none(
    gateway: RunningGateway,
) -> None:
    before = counted(gateway)
    first = await complete(gateway, prompt("Walrus", "how many?"))
    assert first.final.cache_tier == pb.CACHE_TIER_MISS
    assert first.final.usage.cached_prompt_tokens == 0
    second = await complete(gateway, prompt("Walrus", "why so?"))
    usage = second.final.usage
    assert second.final.cache_tier == pb.CACHE_TIER_MISS
    assert 0 < usage.cached_prompt_tokens < usage.prompt_tokens
    assert usage.cached_prompt_tokens % BLOCK == 0
    assert counted(gateway) - before == usage.cached_prompt_tokens
    # The same request again: the gateway's cache answers, no engine read the prompt.
    again = await complete(gateway, prompt("Walrus", "why so?"))
    assert again.final.cache_tier == pb.CACHE_TIER_EXACT_L1
    assert again.final.usage.cached_prompt_tokens == 0
    assert counted(gateway) - before == usage.cached_prompt_tokens
    # OpenAI's usage over HTTP, whole and streamed (include_usage).
    async with _client(gateway) as client:
        whole = await client.completions.create(
            model="tiny", prompt=prompt("Walrus", "where?"), max_tokens=3, temperature=0
        )
        assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
        assert whole.usage.prompt_tokens_details.cached_tokens == usage.cached_prompt_tokens
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt("Heron", "how tall?")}],
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is not None
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0  # a first Heron prompt
        hit = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt("Heron", "how tall?")}],
            max_tokens=3,
            temperature=0,
        )
        assert (hit.model_extra or {})["appliance"]["cache_tier"] == "l1"
        assert hit.usage is not None and hit.usage.prompt_tokens_details is not None
        assert hit.usage.prompt_tokens_details.cached_tokens == 0


class OlderTriton(EngineService):
    """A server whose model declares no perf metrics (a Triton before `return_perf_metrics`)."""

    async def ModelConfig(
        self, request: ts.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> ts.ModelConfigResponse:
        reply = await super().ModelConfig(request, context)
        config = mc.ModelConfig()
        config.CopyFrom(reply.config)
        perf = {name for name, _ in PERF_OUTPUTS}
        kept_inputs = [i for i in config.input if i.name != PERF_METRICS_INPUT]
        kept_outputs = [o for o in config.output if o.name not in perf]
        del config.input[:], config.output[:]
        config.input.extend(kept_inputs)
        config.output.extend(kept_outputs)
        return ts.ModelConfigResponse(config=config)


class SilentReuse(EngineService):
    """A server whose model declares the KV-cache outputs but whose responses carry none."""

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[ts.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ts.ModelStreamInferResponse]:
        kv = {name for name, _ in KV_CACHE_OUTPUTS}
        async for message in super().ModelStreamInfer(request_iterator, context):
            response = message.infer_response
            kept = [
                (out, raw)
                for out, raw in zip(response.outputs, response.raw_output_contents, strict=True)
                if out.name not in kv
            ]
            del response.outputs[:], response.raw_output_contents[:]
            for out, raw in kept:
                response.outputs.append(out)
                response.raw_output_contents.append(raw)
            yield message


@pytest.mark.parametrize("service", [OlderTriton, SilentReuse])
async def test_a_server_that_reports_no_reuse_means_none_cached(
    tiny: Tiny, engine: Engine, service: type[EngineService]
) -> None:
    async for gateway in gateway_before(service(engine.models), tiny):
        topic = service.__name__
        await complete(gateway, prompt(topic, "one?"))
        second = await complete(gateway, prompt(topic, "two?"))  # the engine did reuse
        assert second.final.cache_tier == pb.CACHE_TIER_MISS and second.text
        assert second.final.usage.cached_prompt_tokens == 0
        assert second.final.usage.prompt_tokens > BLOCK


@pytest.mark.parametrize(
    ("blocks", "block", "prompt_tokens", "expected"),
    [
        (0, 32, 100, 0),
        (2, 32, 100, 64),
        (4, 32, 128, 127),  # the last prompt token is always computed
        (1, 64, 1, 0),
        (5, 16, 40, 39),
    ],
)
def test_reused_blocks_as_tokens(
    blocks: int, block: int, prompt_tokens: int, expected: int
) -> None:
    assert cached_tokens(blocks, block, prompt_tokens) == expected
