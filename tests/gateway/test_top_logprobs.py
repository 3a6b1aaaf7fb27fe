"""The most likely alternatives per token (top_logprobs) through the gateway: over gRPC and with the
openai SDK (chat `top_logprobs`, completions `logprobs: N`) against the engine server, whose served
config declares them; refused, naming the model, for a model whose config does not (TensorRT-LLM's
`tensorrt_llm` model, stood in for by the engine behind a Triton-like config); bounds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import openai
import pytest
import torch
from google.protobuf import text_format
from openai import AsyncOpenAI
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.backends.triton import InputNames
from appliance.engine.server import EngineService, served_config
from appliance.gateway.server import RunningGateway
from appliance.text.tokenizer import ModelText
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from engine_build.pbtxt import MAX_TOP_LOGPROBS, TOP_LOGPROBS_INPUT
from tests.conftest import Engine, Tiny
from tests.engine.test_top_logprobs import step_log_probs
from tests.gateway.test_http_api import _client, _config, _gateway, client, gateway, stub  # noqa: F401

PROMPT = "Tell me everything"
K = 3
MAX = 6
BYPASS: dict[str, Any] = {"appliance": {"cache_policy": "bypass"}}


def greedy(**fields: Any) -> pb.GenerateRequest:
    base: dict[str, Any] = dict(
        model="tiny",
        prompt=PROMPT,
        temperature=0,
        max_tokens=MAX,
        cache_policy=pb.CACHE_POLICY_BYPASS,
    )
    return pb.GenerateRequest(**{**base, **fields})


async def test_grpc_alternatives_are_the_top_k_of_the_engine_log_softmax(
    stub: pb_grpc.InferenceStub,  # noqa: F811
    tiny: Tiny,
    engine: Engine,
) -> None:
    reply = await stub.Complete(greedy(logprobs=True, top_logprobs=K))
    ids = list(reply.token_ids)
    assert len(ids) == MAX and [e.token_id for e in reply.logprobs] == ids
    text = ModelText.load(tiny.tokenizer_dir)
    model = engine.models["tensorrt_llm"].model
    steps = step_log_probs(model, text.encode_prompt(PROMPT), ids, None)
    for e, scores in zip(reply.logprobs, steps, strict=True):
        assert len(e.top) == K
        expected = torch.topk(scores, K).values.tolist()
        assert [a.logprob for a in e.top] == pytest.approx(expected, abs=1e-3)
        assert [a.token for a in e.top] == [text.table.bytes_of(a.token_id) for a in e.top]
        # Greedy: the chosen token is the most likely one, with the same log-probability.
        assert (e.top[0].token_id, e.top[0].logprob) == (e.token_id, e.logprob)
    # Streamed: the same alternatives, message by message.
    streamed = [
        e async for m in stub.Generate(greedy(logprobs=True, top_logprobs=K)) for e in m.logprobs
    ]
    assert streamed == list(reply.logprobs)
    # Without top_logprobs: log-probabilities alone.
    plain = await stub.Complete(greedy(logprobs=True))
    assert [len(e.top) for e in plain.logprobs] == [0] * MAX


async def test_chat_top_logprobs_whole_and_streamed(
    client: AsyncOpenAI,  # noqa: F811
    stub: pb_grpc.InferenceStub,  # noqa: F811
) -> None:
    args: dict[str, Any] = dict(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX,
        temperature=0,
        logprobs=True,
        top_logprobs=K,
        extra_body=BYPASS,
    )
    whole = await client.chat.completions.create(**args)
    choice_logprobs = whole.choices[0].logprobs
    assert choice_logprobs is not None
    content = choice_logprobs.content
    assert content is not None and len(content) == MAX
    for e in content:
        assert len(e.top_logprobs) == K
        first = e.top_logprobs[0]
        assert (first.token, first.logprob, first.bytes) == (e.token, e.logprob, e.bytes)
        assert [a.logprob for a in e.top_logprobs] == sorted(
            (a.logprob for a in e.top_logprobs), reverse=True
        )
        assert all(bytes(a.bytes or []).decode(errors="replace") == a.token for a in e.top_logprobs)
    streamed: list[Any] = []
    async for chunk in await client.chat.completions.create(stream=True, **args):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


async def test_completions_logprobs_n(
    client: AsyncOpenAI,  # noqa: F811
    stub: pb_grpc.InferenceStub,  # noqa: F811
) -> None:
    expected = (await stub.Complete(greedy(logprobs=True, top_logprobs=K))).logprobs
    args: dict[str, Any] = dict(
        model="tiny", prompt=PROMPT, max_tokens=MAX, temperature=0, logprobs=K, extra_body=BYPASS
    )
    whole = await client.completions.create(**args)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.tokens is not None
    assert len(lp.top_logprobs) == len(lp.tokens) == MAX
    for token, top, e in zip(lp.tokens, lp.top_logprobs, expected, strict=True):
        # text -> log-probability of each alternative, and the chosen token's (OpenAI's N + 1).
        want = {a.token.decode(errors="replace"): a.logprob for a in reversed(e.top)}
        want.setdefault(token, e.logprob)
        assert top == pytest.approx(want, abs=1e-6)
        assert len(top) <= K + 1 and token in top
    streamed: list[dict[str, float]] = []
    async for chunk in await client.completions.create(stream=True, **args):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.top_logprobs or []
    assert streamed == lp.top_logprobs
    # logprobs 0: the chosen tokens' log-probabilities, no alternatives (null, as OpenAI's).
    zero = await client.completions.create(**{**args, "logprobs": 0})
    assert zero.choices[0].logprobs is not None and zero.choices[0].logprobs.top_logprobs is None


async def test_bounds(
    client: AsyncOpenAI,  # noqa: F811
    stub: pb_grpc.InferenceStub,  # noqa: F811
) -> None:
    over = MAX_TOP_LOGPROBS + 1
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Complete(greedy(logprobs=True, top_logprobs=over))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "between 0 and 20" in (refused.value.details() or "")
    with pytest.raises(openai.BadRequestError) as chat:
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            logprobs=True,
            top_logprobs=over,
        )
    assert chat.value.body["param"] == "top_logprobs"  # type: ignore[index]
    assert "between 0 and 20" in chat.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as completion:
        await client.completions.create(model="tiny", prompt="hi", logprobs=over)
    assert completion.value.body["param"] == "logprobs"  # type: ignore[index]
    assert "between 0 and 20" in completion.value.body["message"]  # type: ignore[index]
    # The top of the range is served.
    top = await stub.Complete(greedy(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS, max_tokens=2))
    assert [len(e.top) for e in top.logprobs] == [MAX_TOP_LOGPROBS] * 2


# -- a model whose config declares no alternatives ---------------------------------------------


def without_alternatives(config: mc.ModelConfig) -> mc.ModelConfig:
    """The config as TensorRT-LLM's tensorrt_llm model has it: none of the appliance_top_* names."""
    triton = mc.ModelConfig()
    triton.CopyFrom(config)
    kept_inputs = [i for i in triton.input if not i.name.startswith("appliance_top")]
    kept_outputs = [o for o in triton.output if not o.name.startswith("appliance_top")]
    del triton.input[:], triton.output[:]
    triton.input.extend(kept_inputs)
    triton.output.extend(kept_outputs)
    return triton


class TritonLike(EngineService):
    """The engine server answering ModelConfig with its model's config less the alternatives."""

    async def ModelConfig(
        self, request: ts.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> ts.ModelConfigResponse:
        reply = await super().ModelConfig(request, context)
        return ts.ModelConfigResponse(config=without_alternatives(reply.config))


async def gateway_before(service: EngineService, tiny: Tiny) -> AsyncIterator[RunningGateway]:
    """A gateway whose backend is `service` (an engine server's servicer, changed) on its own
    gRPC server."""
    server = grpc.aio.server()
    ts_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    running = await _gateway(_config(tiny, f"127.0.0.1:{port}"))
    yield running
    await running.drain(0.5)
    await server.stop(grace=None)


@pytest.fixture
async def triton_like_gateway(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    async for running in gateway_before(TritonLike(engine.models), tiny):
        yield running


async def test_a_model_without_alternatives_refuses_them(
    triton_like_gateway: RunningGateway,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{triton_like_gateway.port}") as channel:
        inference = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await inference.Complete(greedy(logprobs=True, top_logprobs=1))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = refused.value.details() or ""
        assert "model 'tiny'" in details and "no alternatives" in details
        # The chosen tokens' log-probabilities are still served.
        plain = await inference.Complete(greedy(logprobs=True, top_logprobs=0))
        assert len(plain.logprobs) == MAX and all(len(e.top) == 0 for e in plain.logprobs)
    async with _client(triton_like_gateway) as http:
        with pytest.raises(openai.BadRequestError) as chat:
            await http.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": PROMPT}],
                logprobs=True,
                top_logprobs=2,
            )
        assert chat.value.body["param"] == "top_logprobs"  # type: ignore[index]
        assert "model 'tiny'" in chat.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as completion:
            await http.completions.create(model="tiny", prompt=PROMPT, logprobs=2)
        assert completion.value.body["param"] == "logprobs"  # type: ignore[index]


def test_the_client_reads_alternatives_from_the_config(tiny: Tiny) -> None:
    """The tiny repository's tensorrt_llm config.pbtxt (TensorRT-LLM's names, as engine_build
    writes them) declares none; the engine server's served config declares MAX_TOP_LOGPROBS."""
    path = tiny.repo / "tensorrt_llm" / "config.pbtxt"
    triton = text_format.Parse(path.read_text(), mc.ModelConfig())
    assert TOP_LOGPROBS_INPUT not in {i.name for i in triton.input}
    assert InputNames.from_config(triton).top_logprobs == 0
    assert InputNames.from_config(served_config(triton)).top_logprobs == MAX_TOP_LOGPROBS
