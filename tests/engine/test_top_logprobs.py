"""The engine server's most likely alternatives per generated token (appliance_top_logprobs), the
output only its own served config declares: the k alternatives of each step are torch.topk of the
log-softmax of the logits the token was chosen from, greedy and sampled, and the chosen token's
log-probability (output_log_probs) is the same distribution's."""

from __future__ import annotations

import array

import pytest
import torch
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.engine.llama import LlamaModel
from appliance.engine.server import served_config
from engine_build.pbtxt import (
    MAX_TOP_LOGPROBS,
    TOP_LOGPROB_IDS_OUTPUT,
    TOP_LOGPROBS_INPUT,
    TOP_LOGPROBS_OUTPUT,
)
from tests.conftest import Engine
from tests.engine.test_conformance import PROMPT, collect, request, tokens_of
from tests.engine.test_length_and_logprobs import floats, with_input

MAX = 6
K = 5


def ints(response: ts.ModelInferResponse, name: str) -> tuple[list[int], list[int]] | None:
    for i, out in enumerate(response.outputs):
        if out.name == name:
            data = array.array("i")
            data.frombytes(response.raw_output_contents[i])
            return data.tolist(), list(out.shape)
    return None


def step_log_probs(
    model: LlamaModel, prompt: list[int], tokens: list[int], temperature: float | None
) -> list[torch.Tensor]:
    """Each generated token's step: the log-softmax of the model's logits there (divided by the
    temperature when sampled), recomputed from scratch."""
    out = []
    with torch.inference_mode():
        for i in range(len(tokens)):
            ids = prompt + tokens[:i]
            logits = model.forward(ids, model.new_cache(len(ids)), 0).float()
            if temperature is not None:
                logits = logits / temperature
            out.append(torch.log_softmax(logits, dim=-1))
    return out


async def answer(
    triton: ts_grpc.GRPCInferenceServiceStub, req: ts.ModelInferRequest
) -> tuple[list[int], list[float], list[list[int]], list[list[float]]]:
    """The generated ids, their log-probabilities, and each one's alternatives (ids, values)."""
    responses = await collect(triton, req)
    assert all(not m.error_message for m in responses), responses[-1].error_message
    tokens: list[int] = []
    chosen: list[float] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    for m in responses:
        new = tokens_of(m.infer_response)
        tokens += new
        got_ids = ints(m.infer_response, TOP_LOGPROB_IDS_OUTPUT)
        got_values = floats(m.infer_response, TOP_LOGPROBS_OUTPUT)
        assert got_ids is not None and got_values is not None
        # This response's tokens only: [batch, beam, tokens, k].
        assert got_ids[1] == got_values[1] == [1, 1, len(new), K]
        top_ids += [got_ids[0][i * K : (i + 1) * K] for i in range(len(new))]
        top_values += [got_values[0][i * K : (i + 1) * K] for i in range(len(new))]
        lp = floats(m.infer_response, "output_log_probs")
        if lp is not None and lp[0]:
            chosen = lp[0]
    return tokens, chosen, top_ids, top_values


@pytest.mark.parametrize(
    "sampling",
    [dict(top_k=1), dict(temperature=0.7, top_k=40, seed=11)],
    ids=["greedy", "sampled"],
)
async def test_alternatives_are_the_top_k_of_the_step_log_softmax(
    triton: ts_grpc.GRPCInferenceServiceStub, engine: Engine, sampling: dict[str, object]
) -> None:
    req = request(max_tokens=MAX, **sampling)  # type: ignore[arg-type]
    with_input(req, "return_log_probs", "BOOL", "B", 1)
    with_input(req, TOP_LOGPROBS_INPUT, "INT32", "i", K)
    tokens, chosen, top_ids, top_values = await answer(triton, req)
    assert len(tokens) == MAX and len(top_ids) == MAX and len(chosen) == MAX
    model = engine.models["tensorrt_llm"].model
    temperature = sampling.get("temperature")
    assert temperature is None or isinstance(temperature, float)
    steps = step_log_probs(model, PROMPT, tokens, temperature)
    for token, lp, ids, values, scores in zip(
        tokens, chosen, top_ids, top_values, steps, strict=True
    ):
        expected_values, expected_ids = torch.topk(scores, K + 1)
        assert values == pytest.approx(expected_values[:K].tolist(), abs=1e-3)
        # The ids are those tokens; where two values are too close for the recomputed logits to
        # order them alike, either order is right.
        assert values == pytest.approx([float(scores[i]) for i in ids], abs=1e-3)
        if bool((expected_values[:-1] - expected_values[1:]).min() > 1e-3):
            assert ids == expected_ids[:K].tolist()
        assert len(set(ids)) == K
        assert values == sorted(values, reverse=True)
        # The chosen token's log-probability is the same distribution's.
        assert lp == pytest.approx(float(scores[token]), abs=1e-3)
        if token in ids:
            assert lp == pytest.approx(values[ids.index(token)], abs=1e-5)
        else:
            assert lp <= values[-1] + 1e-5
    if "temperature" not in sampling:  # greedy: the chosen token is the most likely
        assert [ids[0] for ids in top_ids] == tokens
        assert chosen == pytest.approx([v[0] for v in top_values], abs=1e-6)


async def test_alternatives_without_log_probs_and_whole(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    """Alternatives alone (no return_log_probs), in a non-streamed answer: one row per generated
    token, none for the prompt the answer's output_ids hold."""
    streamed = request(max_tokens=MAX, top_k=1)
    with_input(streamed, TOP_LOGPROBS_INPUT, "INT32", "i", K)
    tokens, chosen, top_ids, _ = await answer(triton, streamed)
    assert chosen == [] and len(top_ids) == MAX
    whole = request(max_tokens=MAX, top_k=1, streaming=False)
    with_input(whole, TOP_LOGPROBS_INPUT, "INT32", "i", K)
    responses = await collect(triton, whole)
    final = responses[-1].infer_response
    got = ints(final, TOP_LOGPROB_IDS_OUTPUT)
    assert got is not None and got[1] == [1, 1, MAX, K]
    assert [got[0][i * K : (i + 1) * K] for i in range(MAX)] == top_ids
    assert tokens_of(final)[-MAX:] == tokens


async def test_none_unless_asked(triton: ts_grpc.GRPCInferenceServiceStub) -> None:
    responses = await collect(triton, request(max_tokens=3, top_k=1))
    assert all(ints(m.infer_response, TOP_LOGPROB_IDS_OUTPUT) is None for m in responses)
    zero = request(max_tokens=3, top_k=1)
    with_input(zero, TOP_LOGPROBS_INPUT, "INT32", "i", 0)
    responses = await collect(triton, zero)
    assert all(ints(m.infer_response, TOP_LOGPROB_IDS_OUTPUT) is None for m in responses)


@pytest.mark.parametrize("k", [-1, MAX_TOP_LOGPROBS + 1])
async def test_out_of_range_is_refused(triton: ts_grpc.GRPCInferenceServiceStub, k: int) -> None:
    req = request(max_tokens=3, top_k=1)
    with_input(req, TOP_LOGPROBS_INPUT, "INT32", "i", k)
    responses = await collect(triton, req)
    assert f"{TOP_LOGPROBS_INPUT} must be between 0 and {MAX_TOP_LOGPROBS}" in (
        responses[-1].error_message
    )


async def test_the_served_config_declares_them(triton: ts_grpc.GRPCInferenceServiceStub) -> None:
    config = (await triton.ModelConfig(ts.ModelConfigRequest(name="tensorrt_llm"))).config
    assert TOP_LOGPROBS_INPUT in {i.name for i in config.input if i.optional}
    outputs = {o.name: o for o in config.output}
    assert list(outputs[TOP_LOGPROB_IDS_OUTPUT].dims) == [-1, -1, -1]
    assert outputs[TOP_LOGPROBS_OUTPUT].data_type == mc.TYPE_FP32
    # Declared once, however often the config is served.
    again = served_config(config)
    assert [o.name for o in again.output] == [o.name for o in config.output]
