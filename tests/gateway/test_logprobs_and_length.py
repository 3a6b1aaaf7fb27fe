"""logprobs, min_tokens and ignore_eos through the gateway: the openai SDK over HTTP and the gRPC
API, against the engine server on the tiny model."""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest
import torch
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionTokenLogprob

from appliance.backends import wire
from appliance.backends.base import GREEDY, GenerationRequest
from appliance.backends.triton import InputNames, TritonBackend
from appliance.text.tokenizer import ModelText
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny
from tests.engine.test_length_and_logprobs import reference_logprobs
from tests.gateway.test_http_api import client, gateway, stub  # noqa: F401

PROMPT = "Tell me everything"
BYPASS: dict[str, Any] = {"appliance": {"cache_policy": "bypass"}}


async def grpc_answer(
    inference: pb_grpc.InferenceStub, **fields: Any
) -> tuple[list[int], list[pb.TokenLogprob], pb.Final]:
    request = pb.GenerateRequest(model="tiny", prompt=PROMPT, temperature=0, **fields)
    reply = await inference.Complete(request)
    return list(reply.token_ids), list(reply.logprobs), reply.final


async def test_grpc_logprobs_are_the_log_softmax_of_the_engine_logits(
    stub: pb_grpc.InferenceStub,  # noqa: F811
    tiny: Tiny,
    engine: Engine,
) -> None:
    ids, logprobs, final = await grpc_answer(stub, max_tokens=6, logprobs=True)
    assert [e.token_id for e in logprobs] == ids and len(ids) == final.usage.completion_tokens
    text = ModelText.load(tiny.tokenizer_dir)
    assert [e.token for e in logprobs] == [text.table.bytes_of(t) for t in ids]
    model = engine.models["tensorrt_llm"].model
    expected = reference_logprobs(model, text.encode_prompt(PROMPT), ids)
    assert [e.logprob for e in logprobs] == pytest.approx(expected, abs=1e-3)
    # Without the flag: none.
    _, none, _ = await grpc_answer(stub, max_tokens=6)
    assert none == []


async def test_chat_logprobs_whole_and_streamed(
    client: AsyncOpenAI,  # noqa: F811
    stub: pb_grpc.InferenceStub,  # noqa: F811
) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
    whole = await client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=0,
        extra_body=BYPASS,
    )
    assert whole.choices[0].logprobs is not None and whole.usage is not None
    content = whole.choices[0].logprobs.content
    assert content is not None and len(content) == whole.usage.completion_tokens
    assert all(e.logprob <= 0 and e.top_logprobs == [] for e in content)
    assert "".join(bytes(e.bytes or []).decode(errors="replace") for e in content).strip()
    streamed: list[ChatCompletionTokenLogprob] = []
    stream = await client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=0,
        extra_body=BYPASS,
        stream=True,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # Without logprobs the answer says null, as OpenAI's does.
    plain = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body=BYPASS
    )
    assert plain.choices[0].logprobs is None


async def test_completion_logprobs_whole_and_streamed(
    client: AsyncOpenAI,  # noqa: F811
    stub: pb_grpc.InferenceStub,  # noqa: F811
) -> None:
    _, expected, _ = await grpc_answer(stub, max_tokens=6, logprobs=True)
    args: dict[str, Any] = dict(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0, extra_body=BYPASS
    )
    whole = await client.completions.create(**args)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected], abs=1e-6)
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed: list[float] = []
    async for chunk in await client.completions.create(stream=True, **args):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs or []
    assert streamed == lp.token_logprobs


async def test_min_tokens_holds_stop_strings_back(client: AsyncOpenAI) -> None:  # noqa: F811
    base: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    free = await client.completions.create(extra_body=BYPASS, **base)
    text = free.choices[0].text
    assert free.usage is not None and free.usage.completion_tokens == 12
    stop = text[2:4]  # text the answer reaches within its first few tokens
    stopped = await client.completions.create(stop=[stop], extra_body=BYPASS, **base)
    assert stopped.choices[0].finish_reason == "stop" and len(stopped.choices[0].text) <= 2
    held = await client.completions.create(
        stop=[stop], extra_body={**BYPASS, "min_tokens": 12}, **base
    )
    # The stop string is looked for only after 12 tokens: the whole answer comes back.
    assert held.choices[0].text == text
    assert held.usage is not None and held.usage.completion_tokens == 12


async def test_ignore_eos_runs_to_max_tokens(client: AsyncOpenAI) -> None:  # noqa: F811
    answer = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=20,
        temperature=0,
        extra_body={**BYPASS, "ignore_eos": True, "min_tokens": 3},
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 20
    assert answer.choices[0].finish_reason == "length"


async def test_ignore_eos_sends_end_id_minus_one_to_triton() -> None:
    backend = TritonBackend("127.0.0.1:1", "m")
    backend._names = InputNames(
        present=frozenset({"input_ids", "input_lengths", "request_output_len", "end_id"}),
        seed=None,
        min_tokens="min_length",
        batch_dim=True,
    )
    base = GenerationRequest("r", [1, 2], 4, 2, 2, GREEDY, None)

    def inputs(g: GenerationRequest) -> dict[str, list[Any]]:
        req = backend._request(g)
        return {
            req.inputs[i].name: wire.input_tensor(req, i).values for i in range(len(req.inputs))
        }

    assert inputs(base)["end_id"] == [2]
    sent = inputs(GenerationRequest("r", [1, 2], 4, 2, 2, GREEDY, None, ignore_eos=True))
    assert sent["end_id"] == [-1]
    assert inputs(GenerationRequest("r", [1, 2], 4, 2, 2, GREEDY, None, min_tokens=3))[
        "min_length"
    ] == [3]
    # A model without return_log_probs refuses logprobs with what to change.
    with pytest.raises(Exception, match="return_log_probs"):
        inputs(GenerationRequest("r", [1, 2], 4, 2, 2, GREEDY, None, logprobs=True))
    await backend.close()


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "between 0 and max_tokens (8)"),
        ({"min_tokens": -1}, "min_tokens", "between 0 and max_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos", "must be a boolean"),
        ({"logprobs": 1}, "logprobs", "must be a boolean"),
    ],
)
async def test_bad_chat_fields_are_400_naming_the_field(
    client: AsyncOpenAI,  # noqa: F811
    body: dict[str, Any],
    param: str,
    words: str,
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body=body
        )
    assert err.value.body["param"] == param  # type: ignore[index]
    assert words in err.value.body["message"]  # type: ignore[index]


def test_logprob_values_are_finite_log_probabilities() -> None:
    """What the engine computes for a token is a log-probability: <= 0, and 0 only when certain."""
    from appliance.engine.sampling import Sampler, SamplingParams

    logits = torch.tensor([2.0, 1.0, 0.0])
    greedy = Sampler(SamplingParams(top_k=1))
    assert greedy.logprob(logits, 0) == pytest.approx(float(torch.log_softmax(logits, 0)[0]))
    sampled = Sampler(SamplingParams(temperature=0.5, top_k=2))
    assert sampled.logprob(logits, 1) == pytest.approx(float(torch.log_softmax(logits / 0.5, 0)[1]))
    assert math.isfinite(sampled.logprob(logits, 2))
