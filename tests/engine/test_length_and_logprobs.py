"""min_tokens, an end id of -1 and return_log_probs on the engine server, as Triton's tensorrt_llm
model takes and returns them (built by hand with tritonclient's protos, like test_conformance)."""

from __future__ import annotations

import array
from typing import Any

import pytest
import torch
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.engine.llama import LlamaModel
from tests.conftest import Engine
from tests.engine.test_conformance import PROMPT, _tensor, collect, request, tokens_of

MAX = 8


def floats(response: ts.ModelInferResponse, name: str) -> tuple[list[float], list[int]] | None:
    for i, out in enumerate(response.outputs):
        if out.name == name:
            data = array.array("f")
            data.frombytes(response.raw_output_contents[i])
            return data.tolist(), list(out.shape)
    return None


def reference_logprobs(model: LlamaModel, prompt: list[int], tokens: list[int]) -> list[float]:
    """log-softmax of the model's own logits at each generated token, recomputed from scratch."""
    out = []
    with torch.inference_mode():
        for i, token in enumerate(tokens):
            ids = prompt + tokens[:i]
            logits = model.forward(ids, model.new_cache(len(ids)), 0)
            out.append(float(torch.log_softmax(logits.float(), dim=-1)[token]))
    return out


async def greedy(
    triton: ts_grpc.GRPCInferenceServiceStub, **kw: Any
) -> list[ts.ModelStreamInferResponse]:
    req = request(top_k=1, **kw)
    responses = await collect(triton, req)
    assert all(not m.error_message for m in responses), responses[-1].error_message
    return responses


def with_input(req: ts.ModelInferRequest, name: str, dtype: str, code: str, value: float) -> None:
    _tensor(req, name, dtype, code, [value])


async def test_streamed_log_probs_are_cumulative_and_match_the_logits(
    triton: ts_grpc.GRPCInferenceServiceStub, engine: Engine
) -> None:
    req = request(top_k=1, max_tokens=MAX)
    with_input(req, "return_log_probs", "BOOL", "B", 1)
    responses = await collect(triton, req)
    tokens: list[int] = []
    for m in responses:
        new = tokens_of(m.infer_response)
        tokens += new
        got = floats(m.infer_response, "output_log_probs")
        assert got is not None
        values, shape = got
        # Every token so far, as TensorRT-LLM's executor returns them: [batch, beam, tokens].
        assert shape == [1, 1, len(tokens)] and len(values) == len(tokens)
        cum = floats(m.infer_response, "cum_log_probs")
        assert cum is not None and cum[1] == [1, 1]
        assert cum[0][0] == pytest.approx(sum(values), abs=1e-4)
    assert len(tokens) == MAX
    model = engine.models["tensorrt_llm"].model
    assert values == pytest.approx(reference_logprobs(model, PROMPT, tokens), abs=1e-3)
    assert all(v <= 0 for v in values)


async def test_no_log_probs_unless_asked(triton: ts_grpc.GRPCInferenceServiceStub) -> None:
    responses = await greedy(triton, max_tokens=3)
    assert all(floats(m.infer_response, "output_log_probs") is None for m in responses)


async def _tokens(triton: ts_grpc.GRPCInferenceServiceStub, req: ts.ModelInferRequest) -> list[int]:
    responses = await collect(triton, req)
    assert all(not m.error_message for m in responses), responses[-1].error_message
    return [t for m in responses for t in tokens_of(m.infer_response)]


@pytest.mark.parametrize(
    "model, name", [("tensorrt_llm", "min_tokens"), ("legacy_names_llm", "min_length")]
)
async def test_min_tokens_holds_the_end_id_back(
    triton: ts_grpc.GRPCInferenceServiceStub, model: str, name: str
) -> None:
    free = await _tokens(triton, request(top_k=1, max_tokens=MAX, model=model))
    assert len(free) == MAX
    # The third greedy token as the end id: the generation ends before it...
    end = free[2]
    ended = await _tokens(triton, request(top_k=1, max_tokens=MAX, model=model, end_id=end))
    assert ended == free[: free.index(end)]
    # ...unless min_tokens says more tokens come first: the end id cannot be chosen before them.
    req = request(top_k=1, max_tokens=MAX, model=model, end_id=end)
    with_input(req, name, "INT32", "i", 5)
    held = await _tokens(triton, req)
    assert len(held) >= 5
    assert end not in held[:5]


async def test_end_id_minus_one_runs_to_request_output_len(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    free = await _tokens(triton, request(top_k=1, max_tokens=MAX))
    assert await _tokens(triton, request(top_k=1, max_tokens=MAX, end_id=-1)) == free


async def test_negative_min_tokens_is_refused(triton: ts_grpc.GRPCInferenceServiceStub) -> None:
    req = request(top_k=1, max_tokens=MAX)
    with_input(req, "min_tokens", "INT32", "i", -1)
    responses = await collect(triton, req)
    assert "min_tokens must be >= 0" in responses[-1].error_message
