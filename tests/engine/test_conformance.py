"""The engine server behaves like Triton + the tensorrt_llm backend on every point the gateway uses.

One test per behaviour; requests are built by hand with tritonclient's protos, not with the gateway's
client, so the two cannot agree on a mistake.
"""

from __future__ import annotations

import array
import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.engine.runner import EngineStats
from tests.conftest import Engine, Tiny, copy_repository
from tests.support import until_async, until_engine

MODEL = "tensorrt_llm"
PROMPT = [1, 300, 301, 302, 303, 304]


def _tensor(
    req: ts.ModelInferRequest, name: str, dtype: str, code: str, values: Sequence[float]
) -> None:
    t = req.inputs.add(name=name, datatype=dtype, shape=[1, len(values)])
    del t
    req.raw_input_contents.append(array.array(code, values).tobytes())


def request(
    request_id: str = "r1",
    prompt: list[int] | None = None,
    max_tokens: int = 8,
    *,
    model: str = MODEL,
    streaming: bool = True,
    empty_final: bool = True,
    stop: bool = False,
    end_id: int | None = None,
    seed: int | None = None,
    seed_name: str = "seed",
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    skip: Iterable[str] = (),
) -> ts.ModelInferRequest:
    prompt = PROMPT if prompt is None else prompt
    req = ts.ModelInferRequest(model_name=model, id=request_id)
    if empty_final:
        req.parameters["triton_enable_empty_final_response"].bool_param = True
    fields: list[tuple[str, str, str, Sequence[float]]] = [
        ("input_ids", "INT32", "i", prompt),
        ("input_lengths", "INT32", "i", [len(prompt)]),
        ("request_output_len", "INT32", "i", [max_tokens]),
        ("streaming", "BOOL", "B", [int(streaming)]),
    ]
    if stop:
        fields.append(("stop", "BOOL", "B", [1]))
    if end_id is not None:
        fields.append(("end_id", "INT32", "i", [end_id]))
    if seed is not None:
        fields.append((seed_name, "UINT64", "Q", [seed]))
    if temperature is not None:
        fields.append(("temperature", "FP32", "f", [temperature]))
    if top_k is not None:
        fields.append(("runtime_top_k", "INT32", "i", [top_k]))
    if top_p is not None:
        fields.append(("runtime_top_p", "FP32", "f", [top_p]))
    for name, dtype, code, values in fields:
        if name not in skip:
            _tensor(req, name, dtype, code, values)
    return req


def tokens_of(response: ts.ModelInferResponse) -> list[int]:
    for i, out in enumerate(response.outputs):
        if out.name == "output_ids":
            data = array.array("i")
            data.frombytes(response.raw_output_contents[i])
            return data.tolist()
    return []


def is_final(response: ts.ModelInferResponse) -> bool:
    final = response.parameters["triton_final_response"].bool_param
    assert isinstance(final, bool)
    return final


async def collect(
    stub: ts_grpc.GRPCInferenceServiceStub,
    *requests: ts.ModelInferRequest,
    metadata: tuple[tuple[str, str], ...] = (),
) -> list[ts.ModelStreamInferResponse]:
    async def gen() -> AsyncIterator[ts.ModelInferRequest]:
        for r in requests:
            yield r

    return [m async for m in stub.ModelStreamInfer(gen(), metadata=metadata, timeout=60)]


async def test_server_and_model_readiness(triton: ts_grpc.GRPCInferenceServiceStub) -> None:
    assert (await triton.ServerLive(ts.ServerLiveRequest())).live
    assert (await triton.ServerReady(ts.ServerReadyRequest())).ready
    assert (await triton.ModelReady(ts.ModelReadyRequest(name=MODEL))).ready
    # The version is read as Triton reads it (std::stol): "01" is version 1.
    assert (await triton.ModelReady(ts.ModelReadyRequest(name=MODEL, version="01"))).ready


async def _refusal(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details() or ""


async def test_readiness_of_an_unknown_model_or_version_is_false(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    """Triton's core answers ModelReady with `ready: false`, not an error, for a model or version
    it does not serve (ModelIsReady: a failed lookup leaves ready false); tritonclient's
    is_model_ready returns False."""
    assert not (await triton.ModelReady(ts.ModelReadyRequest(name="nope"))).ready
    assert not (await triton.ModelReady(ts.ModelReadyRequest(name=MODEL, version="2"))).ready
    assert not (await triton.ModelReady(ts.ModelReadyRequest(name=MODEL, version="0"))).ready


NOT_A_VERSION = (
    "failed to get model version from specified version string 'x' (details: stol), version "
    "should be an integral value > 0"
)
NEGATIVE_VERSION = "invalid model version specified '-1' , version should be an integral value > 0"


@pytest.mark.parametrize(("version", "message"), [("x", NOT_A_VERSION), ("-1", NEGATIVE_VERSION)])
async def test_a_version_that_is_not_a_positive_integer_is_refused_in_triton_words(
    triton: ts_grpc.GRPCInferenceServiceStub, version: str, message: str
) -> None:
    calls = {
        "ModelReady": triton.ModelReady(ts.ModelReadyRequest(name=MODEL, version=version)),
        "ModelMetadata": triton.ModelMetadata(ts.ModelMetadataRequest(name=MODEL, version=version)),
        "ModelConfig": triton.ModelConfig(ts.ModelConfigRequest(name=MODEL, version=version)),
        "ModelStatistics": triton.ModelStatistics(
            ts.ModelStatisticsRequest(name=MODEL, version=version)
        ),
    }
    req = request(model="sync_llm", streaming=False)
    req.model_version = version
    calls["ModelInfer"] = triton.ModelInfer(req, timeout=60)
    for name, call in calls.items():
        assert await _refusal(call) == (grpc.StatusCode.INVALID_ARGUMENT, message), name
    streamed = request("versioned")
    streamed.model_version = version
    (refused,) = await collect(triton, streamed)
    assert (refused.error_message, refused.infer_response.id) == (message, "versioned")


async def test_an_unknown_version_on_a_stream_is_refused_naming_it(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    versioned = request("v2")
    versioned.model_version = "2"
    (refused,) = await collect(triton, versioned)
    assert refused.error_message == f"Request for unknown model: '{MODEL}' version 2 is not found"


async def test_statistics_of_an_unknown_model_or_version_are_refused_in_triton_words(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    assert await _refusal(triton.ModelStatistics(ts.ModelStatisticsRequest(name="nope"))) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "requested model 'nope' is not available",
    )
    unknown_version = ts.ModelStatisticsRequest(name=MODEL, version="2")
    assert await _refusal(triton.ModelStatistics(unknown_version)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"requested model version is not available for model '{MODEL}'",
    )
    # Without a name: every model, whatever the version says.
    every = await triton.ModelStatistics(ts.ModelStatisticsRequest(version="2"))
    assert MODEL in {m.name for m in every.model_stats}


async def test_model_config_and_metadata(triton: ts_grpc.GRPCInferenceServiceStub) -> None:
    config = (await triton.ModelConfig(ts.ModelConfigRequest(name=MODEL))).config
    assert config.model_transaction_policy.decoupled
    assert config.max_batch_size == 1
    assert {"input_ids", "input_lengths", "request_output_len"} <= {i.name for i in config.input}
    meta = await triton.ModelMetadata(ts.ModelMetadataRequest(name=MODEL))
    shapes = {i.name: list(i.shape) for i in meta.inputs}
    assert shapes["input_ids"] == [-1, -1]  # batch dimension first


async def test_unknown_model_config_is_not_found(triton: ts_grpc.GRPCInferenceServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await triton.ModelConfig(ts.ModelConfigRequest(name="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "Request for unknown model: 'nope' is not found" in (err.value.details() or "")


async def test_every_streamed_response_carries_the_final_flag(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    responses = await collect(triton, request(max_tokens=6))
    assert all(not m.error_message for m in responses)
    flags = [is_final(m.infer_response) for m in responses]
    assert "triton_final_response" in responses[0].infer_response.parameters
    assert flags == [False] * 5 + [True]  # the last token's response is the final one
    assert sum(len(tokens_of(m.infer_response)) for m in responses) == 6
    assert all(m.infer_response.id == "r1" for m in responses)


async def test_end_id_ends_with_a_final_response_without_new_tokens(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    greedy = [
        t
        for m in await collect(triton, request(max_tokens=6, top_k=1))
        for t in tokens_of(m.infer_response)
    ]
    end = next(i for i in range(2, 6) if greedy[i] not in greedy[:i])
    responses = await collect(triton, request(max_tokens=6, top_k=1, end_id=greedy[end]))
    got = [tokens_of(m.infer_response) for m in responses]
    assert [t for chunk in got for t in chunk] == greedy[:end]
    assert got[-1] == [] and is_final(responses[-1].infer_response)
    assert len(responses[-1].infer_response.outputs) > 0  # a response, not a flag-only one


async def test_non_streaming_request_gets_one_final_response(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    responses = await collect(triton, request(max_tokens=5, streaming=False))
    assert len(responses) == 1 and is_final(responses[0].infer_response)
    assert len(tokens_of(responses[0].infer_response)) == 5


async def test_in_band_error_leaves_the_stream_open(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    responses = await collect(triton, request("bad", model="nope"), request("good", max_tokens=2))
    assert "Request for unknown model: 'nope' is not found" in responses[0].error_message
    # Like Triton's for a request it could not issue, the error names the request it answers.
    assert responses[0].infer_response.id == "bad"
    good = [m.infer_response for m in responses[1:]]
    assert [r.id for r in good] == ["good", "good"] and is_final(good[-1])


async def test_too_few_inputs_are_refused_in_triton_core_words(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub
) -> None:
    """Triton core's ValidateRequestInputs refuses a count of inputs outside [required, declared]
    and names the inputs given and the required ones missing, each list without spaces."""
    declared = len(engine.models[MODEL].specs)
    only_two = request("few", skip=["input_lengths", "request_output_len"])
    (refused,) = await collect(triton, only_two)
    assert (refused.error_message, refused.infer_response.id) == (
        f"[request id: few] expected number of inputs between 3 and {declared} but got 2 inputs "
        "for model 'tensorrt_llm'. Got input(s) ['input_ids','streaming'], but missing required "
        "input(s) ['input_lengths','request_output_len']. Please provide all required input(s).",
        "few",
    )


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        # TensorRT-LLM backend's createRequestsFromInputTensors.
        ("request_output_len", "request_output_len is not present in the request"),
        # TensorRT-LLM backend's splitBatchInputsTensors, which runs first.
        ("input_ids", "inputTokens or encoderInputFeatures tensor not provided"),
    ],
)
async def test_a_required_input_missing_within_the_count_is_refused_by_the_backend(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub, missing: str, message: str
) -> None:
    """Four inputs given, one required missing: within [required, declared], so Triton core issues
    the request and the backend answers with an error response (INTERNAL), final, on the stream
    with the request's id and model, or as the status of a ModelInfer call."""
    before = engine.stats().started
    (refused,) = await collect(triton, request("short", end_id=2, skip=[missing]))
    assert refused.error_message == message
    response = refused.infer_response
    assert (response.id, response.model_name, is_final(response)) == ("short", MODEL, True)
    sync = request("short", model="sync_llm", streaming=False, end_id=2, skip=[missing])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await triton.ModelInfer(sync)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INTERNAL, message)
    assert engine.stats().started == before


async def test_a_missing_input_lengths_is_not_refused(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    """The backend reads input_lengths only to split a batch of several requests
    (splitBatchInputsTensors): a request of one sequence is served without it."""
    responses = await collect(triton, request("no-lengths", max_tokens=3, skip=["input_lengths"]))
    assert not [r.error_message for r in responses if r.error_message]
    assert sum(len(tokens_of(r.infer_response)) for r in responses) == 3


async def test_input_lengths_is_not_read_for_one_sequence(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    """The backend reads input_lengths only to split a batch of several requests
    (splitBatchInputsTensors): one sequence is served whatever input_lengths says."""
    req = request("odd-lengths", max_tokens=3, skip=["input_lengths"])
    _tensor(req, "input_lengths", "INT32", "i", [len(PROMPT) + 40])
    responses = await collect(triton, req)
    assert not [r.error_message for r in responses if r.error_message]
    assert sum(len(tokens_of(r.infer_response)) for r in responses) == 3


def _negative_top_k(rid: str, model: str, streaming: bool) -> ts.ModelInferRequest:
    return request(rid, model=model, streaming=streaming, top_k=-1)


def _nan_top_p(rid: str, model: str, streaming: bool) -> ts.ModelInferRequest:
    return request(rid, model=model, streaming=streaming, top_p=float("nan"))


def _end_id_past_vocabulary(rid: str, model: str, streaming: bool) -> ts.ModelInferRequest:
    return request(rid, model=model, streaming=streaming, end_id=100_000)


def _prompt_too_long(rid: str, model: str, streaming: bool) -> ts.ModelInferRequest:
    return request(rid, [5] * 10_000, model=model, streaming=streaming)


def _token_past_vocabulary(rid: str, model: str, streaming: bool) -> ts.ModelInferRequest:
    return request(rid, [1, 100_000], model=model, streaming=streaming)


def _penalised(rid: str, model: str, streaming: bool) -> ts.ModelInferRequest:
    from appliance.backends import wire

    req = request(rid, model=model, streaming=streaming)
    wire.add_input(req, "repetition_penalty", "FP32", [1.3], batch_dim=True)
    return req


def _stop_without_id(rid: str, model: str, streaming: bool) -> ts.ModelInferRequest:
    return request("", model=model, streaming=streaming, stop=True)


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (_negative_top_k, "runtime_top_k must be >= 0"),
        (_nan_top_p, "runtime_top_p must be in [0, 1]"),
        (_end_id_past_vocabulary, "Executor failed process requestId 0"),
        (_prompt_too_long, "exceeds maximum input length"),
        (_token_past_vocabulary, "input_ids must be token ids"),
        (_penalised, "input 'repetition_penalty' is declared"),
        (_stop_without_id, "Trying to stop a request but request ID is not provided"),
    ],
    ids=["top-k", "top-p", "end-id", "prompt-length", "token-id", "not-implemented", "stop"],
)
async def test_a_refusal_after_core_checks_is_a_final_backend_error_response(
    engine: Engine,
    triton: ts_grpc.GRPCInferenceServiceStub,
    build: Callable[[str, str, bool], ts.ModelInferRequest],
    says: str,
) -> None:
    """A request that passed Triton core's checks is refused by the backend's error response,
    INTERNAL (its sendEnqueueResponse, or the executor's error): on a stream, Triton's
    StreamInferResponseComplete sends it as error_message with an infer_response holding the
    request's id, model name and version, and the final flag; a ModelInfer call ends with its
    status. Nothing runs for it."""
    before = engine.stats().started
    req = build("late", MODEL, True)
    (refused,) = await collect(triton, req)
    assert says in refused.error_message
    response = refused.infer_response
    assert (response.id, response.model_name, response.model_version) == (req.id, MODEL, "")
    assert is_final(response) and not response.outputs
    versioned = build("late", MODEL, True)
    versioned.model_version = "1"
    (refused,) = await collect(triton, versioned)
    assert refused.infer_response.model_version == "1"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await triton.ModelInfer(build("late", "sync_llm", False))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert says in (err.value.details() or "")
    assert engine.stats().started == before


async def test_core_messages_name_the_request_or_say_its_id_is_unknown(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    """Triton core's request checks start their messages with the request's id (its LogRequest);
    the model's name lookups (Model::GetInput, GetOutput) do not."""
    req = request("", max_tokens=2)
    req.inputs[2].datatype = "FP32"
    (refused,) = await collect(triton, req)
    assert refused.error_message.startswith(
        "[request id: <id_unknown>] inference input 'request_output_len' data-type is 'FP32'"
    )
    unknown = request("odd", max_tokens=2)
    _tensor(unknown, "no_such_input", "INT32", "i", [1])
    (refused,) = await collect(triton, unknown)
    assert (
        refused.error_message
        == "unexpected inference input 'no_such_input' for model 'tensorrt_llm'"
    )


async def test_wrong_datatype_is_an_in_band_error(triton: ts_grpc.GRPCInferenceServiceStub) -> None:
    req = request()
    req.inputs[2].datatype = "FP32"
    responses = await collect(triton, req)
    assert (
        "data-type is 'FP32', but model 'tensorrt_llm' expects 'INT32'"
        in responses[0].error_message
    )


async def test_error_header_turns_errors_into_a_grpc_status(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(triton, request(model="nope"), metadata=(("triton_grpc_error", "true"),))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # Triton compares the header's value with "true" exactly: any other leaves errors in-band.
    (refused,) = await collect(
        triton, request(model="nope"), metadata=(("triton_grpc_error", "True"),)
    )
    assert refused.error_message == "Request for unknown model: 'nope' is not found"


async def test_model_infer_is_refused_for_a_decoupled_model(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await triton.ModelInfer(request(streaming=False))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert err.value.details() == (
        "ModelInfer RPC doesn't support models with decoupled transaction policy"
    )


async def test_model_infer_serves_a_non_decoupled_model(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    reply = await triton.ModelInfer(request(model="sync_llm", max_tokens=4, streaming=False))
    assert len(tokens_of(reply)) == 4
    # The final flag is a stream's (Triton's stream handler sets it); ModelInfer's has none.
    assert not reply.parameters


async def test_seeded_sampling_is_reproducible_under_either_seed_name(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    def run(seed: int, model: str = MODEL, name: str = "seed") -> ts.ModelInferRequest:
        return request(
            max_tokens=12, seed=seed, temperature=1.0, top_p=1.0, model=model, seed_name=name
        )

    async def tokens(req: ts.ModelInferRequest) -> list[int]:
        return [t for m in await collect(triton, req) for t in tokens_of(m.infer_response)]

    first, again, other = await tokens(run(7)), await tokens(run(7)), await tokens(run(8))
    assert first == again and first != other
    assert await tokens(run(7, "legacy_names_llm", "random_seed")) == first


async def _first_token_then(
    triton: ts_grpc.GRPCInferenceServiceStub, req: ts.ModelInferRequest
) -> tuple[grpc.aio.StreamStreamCall, asyncio.Queue[ts.ModelInferRequest | None]]:
    outgoing: asyncio.Queue[ts.ModelInferRequest | None] = asyncio.Queue()
    await outgoing.put(req)

    async def gen() -> AsyncIterator[ts.ModelInferRequest]:
        while (item := await outgoing.get()) is not None:
            yield item

    call = triton.ModelStreamInfer(gen(), timeout=60)
    first = await call.read()
    assert tokens_of(first.infer_response)
    return call, outgoing


async def read_rest(call: grpc.aio.StreamStreamCall) -> list[ts.ModelInferResponse]:
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.append(message.infer_response)
    return out


def _final_of_stopped(rest: list[ts.ModelInferResponse], request_id: str) -> ts.ModelInferResponse:
    """The tensorrtllm backend sends the executor's final result of a stopped request as a
    response with output tensors (here no new tokens) and the final flag."""
    assert rest and all(not is_final(r) for r in rest[:-1])
    last = rest[-1]
    assert last.id == request_id and is_final(last)
    assert {o.name for o in last.outputs} >= {"output_ids", "sequence_length"}
    return last


async def test_stop_with_the_same_id_ends_the_stopped_stream_with_a_final_result(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub
) -> None:
    stats: EngineStats = engine.models[MODEL].runner.stats
    before = stats.cancelled
    call, outgoing = await _first_token_then(triton, request("long-1", max_tokens=1500))
    stop_replies = await collect(triton, request("long-1", stop=True))  # from another stream
    # The runner counts the cancellation and emits the final response before it lets go of the
    # request: wait for both, not only the count.
    await until_engine(stats, lambda: stats.cancelled > before and stats.running is None)
    await outgoing.put(None)
    rest = await read_rest(call)
    assert stats.tokens_generated
    _final_of_stopped(rest, "long-1")
    assert sum(len(tokens_of(r)) for r in rest) < 1499
    # The stop request itself: one response without outputs, flagged final.
    assert [is_final(m.infer_response) for m in stop_replies] == [True]
    assert not stop_replies[0].infer_response.outputs


@pytest.mark.parametrize("how", ["stop", "stop from another stream"])
async def test_a_stopped_stream_ends_without_empty_final_responses_enabled(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub, how: str
) -> None:
    """A plain Triton client (no triton_enable_empty_final_response) still sees its stopped
    request end: the final response carries outputs, so Triton never drops it."""
    stats: EngineStats = engine.models[MODEL].runner.stats
    before = stats.cancelled
    rid = f"plain-{how.replace(' ', '-')}"
    call, outgoing = await _first_token_then(
        triton, request(rid, max_tokens=1500, empty_final=False)
    )
    stop = request(rid, stop=True, empty_final=False)
    if how == "stop":
        await outgoing.put(stop)
    else:
        await collect(triton, stop)
    await until_engine(stats, lambda: stats.cancelled > before)
    await outgoing.put(None)
    rest = await read_rest(call)
    finals = [r for r in rest if is_final(r)]
    if how == "stop":
        # The stop request's own answer comes on the same stream, without outputs.
        assert len(finals) == 2 and {r.id for r in finals} == {rid}
        assert sum(1 for r in finals if not r.outputs) == 1
        rest = [r for r in rest if r.outputs]
    _final_of_stopped(rest, rid)
    assert tokens_of(rest[-1]) == []


@pytest.mark.parametrize("model", [MODEL, "sync_llm"])
async def test_a_stopped_request_that_does_not_stream_returns_what_it_generated(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub, model: str
) -> None:
    """The executor's final result of a cancelled request holds every token generated so far:
    a non-streaming answer to a stopped request carries them, not nothing."""
    stats = engine.stats(model)

    async def answer(req: ts.ModelInferRequest) -> ts.ModelInferResponse:
        if model == MODEL:
            return (await collect(triton, req))[-1].infer_response
        return await triton.ModelInfer(req, timeout=60)

    expected = tokens_of(await answer(request(model=model, top_k=1, streaming=False)))
    rid = f"partial-{model}"
    before = stats.tokens_generated
    stopped = asyncio.ensure_future(
        answer(request(rid, model=model, max_tokens=1500, top_k=1, streaming=False))
    )
    await until_async(lambda: stats.running == rid and stats.tokens_generated > before + 2)
    await answer(request(rid, model=model, stop=True))
    response = await stopped
    generated = tokens_of(response)
    assert is_final(response) if model == MODEL else not response.parameters
    assert 2 < len(generated) < 1500
    assert generated[: len(expected)] == expected[: len(generated)]


async def test_a_request_failed_while_computing_counts_as_a_failed_execution(
    triton: ts_grpc.GRPCInferenceServiceStub, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend reports a failed request's statistics and its batch's (size 1): Triton
    counts it as a failure and an execution, in batch_stats too, but not as an inference."""

    async def snapshot() -> ts.ModelStatistics:
        reply = await triton.ModelStatistics(ts.ModelStatisticsRequest(name="legacy_names_llm"))
        return reply.model_stats[0]

    def fail(job: object) -> None:
        raise RuntimeError("injected")

    def counts(stats: ts.ModelStatistics) -> tuple[int, ...]:
        batches = {b.batch_size: b.compute_infer.count for b in stats.batch_stats}
        inference = stats.inference_stats
        return (
            stats.inference_count,
            stats.execution_count,
            inference.success.count,
            inference.fail.count,
            batches.get(1, 0),
        )

    before = counts(await snapshot())
    monkeypatch.setattr(engine.models["legacy_names_llm"].runner, "_run", fail)
    (failed,) = await collect(triton, request("doomed", model="legacy_names_llm"))
    assert failed.error_message == "engine failure: injected"
    after = counts(await snapshot())
    assert [a - b for a, b in zip(after, before, strict=True)] == [0, 1, 0, 1, 1]


async def test_a_request_the_executor_refuses_counts_as_a_failed_execution(
    triton: ts_grpc.GRPCInferenceServiceStub, engine: Engine
) -> None:
    """The executor refuses a request with an error response, whose statistics the backend
    reports (a failure and an execution); a request the backend itself refuses as it reads it is
    never reported."""

    async def counts() -> tuple[int, ...]:
        reply = await triton.ModelStatistics(ts.ModelStatisticsRequest(name="legacy_names_llm"))
        stats = reply.model_stats[0]
        batches = {b.batch_size: b.compute_infer.count for b in stats.batch_stats}
        inference = stats.inference_stats
        return (
            stats.execution_count,
            inference.success.count,
            inference.fail.count,
            batches.get(1, 0),
        )

    vocab = engine.models["legacy_names_llm"].vocab_size
    before = await counts()
    (refused,) = await collect(triton, request("far-end", model="legacy_names_llm", end_id=vocab))
    assert "is not within acceptable range" in refused.error_message
    executor = await counts()
    assert [a - b for a, b in zip(executor, before, strict=True)] == [1, 0, 1, 1]
    (refused,) = await collect(triton, request("", model="legacy_names_llm", stop=True))
    assert refused.error_message == "Trying to stop a request but request ID is not provided"
    assert await counts() == executor


async def test_a_stop_reaches_only_the_model_it_is_sent_to(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    """Each model's backend keeps its own ids: a stop sent to one model leaves a request under
    the same id on another running."""
    call, outgoing = await _first_token_then(triton, request("shared-id", max_tokens=300))
    (answer,) = await collect(triton, request("shared-id", model="sync_llm", stop=True))
    assert not answer.error_message
    await outgoing.put(None)
    rest = await read_rest(call)
    assert sum(len(tokens_of(r)) for r in rest) == 299  # the first one was read before


async def test_stop_without_a_request_id_is_an_in_band_error(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    responses = await collect(triton, request("", stop=True))
    assert responses[0].error_message == "Trying to stop a request but request ID is not provided"


async def test_closing_the_stream_cancels_generation(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub
) -> None:
    stats: EngineStats = engine.models[MODEL].runner.stats
    before_cancelled, before_tokens = stats.cancelled, stats.tokens_generated
    call, _ = await _first_token_then(triton, request("long-3", max_tokens=1500))
    call.cancel()
    await until_engine(stats, lambda: stats.cancelled > before_cancelled and stats.running is None)
    assert stats.tokens_generated - before_tokens < 1500


async def test_statistics_count_finished_requests_with_triton_breakdown(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub
) -> None:
    async def snapshot() -> ts.ModelStatistics:
        reply = await triton.ModelStatistics(ts.ModelStatisticsRequest(name=MODEL))
        return reply.model_stats[0]

    before = await snapshot()
    call, outgoing = await _first_token_then(triton, request("counted", max_tokens=1500))
    running = await snapshot()
    # Triton counts a request when the backend reports it, at its end: not while it runs.
    assert running.inference_count == before.inference_count
    await outgoing.put(request("counted", stop=True))
    await outgoing.put(None)
    await read_rest(call)
    after = await snapshot()
    assert after.inference_count == before.inference_count + 1
    assert after.execution_count == before.execution_count + 1
    stats = after.inference_stats
    assert stats.success.count == before.inference_stats.success.count + 1  # stopped = success
    for part in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert getattr(stats, part).count == stats.success.count, part
    parts = sum(
        getattr(stats, p).ns - getattr(before.inference_stats, p).ns
        for p in ("queue", "compute_input", "compute_infer", "compute_output")
    )
    assert parts == stats.success.ns - before.inference_stats.success.ns  # the parts add up
    assert stats.compute_infer.ns > before.inference_stats.compute_infer.ns
    assert after.last_inference >= before.last_inference
    assert [b.batch_size for b in after.batch_stats] == [1]
    # Every execution, failed ones too, is one batch of size 1.
    assert after.batch_stats[0].compute_infer.count == after.execution_count


async def test_server_metadata_lists_the_extensions_served(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    meta = await triton.ServerMetadata(ts.ServerMetadataRequest())
    assert set(meta.extensions) == {"model_configuration", "statistics", "parameters"}


UNSERVED = [
    ("TraceSetting", ts.TraceSettingRequest(), "UNAVAILABLE", "the server does not support trace"),
    (
        "LogSettings",
        ts.LogSettingsRequest(),
        "UNAVAILABLE",
        "the server does not support dynamic logging",
    ),
    (
        "RepositoryModelLoad",
        ts.RepositoryModelLoadRequest(model_name=MODEL),
        "UNAVAILABLE",
        "explicit model load / unload is not allowed if polling is enabled",
    ),
    (
        "RepositoryModelUnload",
        ts.RepositoryModelUnloadRequest(model_name=MODEL),
        "UNAVAILABLE",
        "explicit model load / unload is not allowed if polling is enabled",
    ),
    (
        "CudaSharedMemoryRegister",
        ts.CudaSharedMemoryRegisterRequest(name="r"),
        "INVALID_ARGUMENT",
        "failed to register CUDA shared memory region: 'r', GPUs not supported",
    ),
    (
        "SystemSharedMemoryStatus",
        ts.SystemSharedMemoryStatusRequest(name="r"),
        "NOT_FOUND",
        "Unable to find system shared memory region: 'r'",
    ),
]


@pytest.mark.parametrize(("rpc", "message", "code", "details"), UNSERVED)
async def test_rpcs_not_served_answer_as_triton_does_without_a_traceback(
    triton: ts_grpc.GRPCInferenceServiceStub,
    caplog: pytest.LogCaptureFixture,
    rpc: str,
    message: object,
    code: str,
    details: str,
) -> None:
    with caplog.at_level("ERROR"), pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(triton, rpc)(message)
    assert err.value.code() == getattr(grpc.StatusCode, code)
    assert err.value.details() == details
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_repository_index_and_empty_shared_memory_status(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    index = await triton.RepositoryIndex(ts.RepositoryIndexRequest())
    assert {(m.name, m.version, m.state) for m in index.models} >= {(MODEL, "1", "READY")}
    assert not (await triton.SystemSharedMemoryStatus(ts.SystemSharedMemoryStatusRequest())).regions
    assert not (await triton.CudaSharedMemoryStatus(ts.CudaSharedMemoryStatusRequest())).regions
    await triton.SystemSharedMemoryUnregister(ts.SystemSharedMemoryUnregisterRequest())


async def test_prompt_beyond_the_model_context_is_refused(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub
) -> None:
    longest = engine.models[MODEL].max_len - 1
    responses = await collect(triton, request(prompt=[5] * (longest + 1)))
    assert f"exceeds maximum input length ({longest})" in responses[0].error_message


async def test_declared_inputs_the_engine_does_not_compute_are_refused_not_ignored(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    from appliance.backends import wire

    neutral = request("neutral", max_tokens=2)
    wire.add_input(neutral, "repetition_penalty", "FP32", [1.0], batch_dim=True)
    responses = await collect(triton, neutral)
    assert not [r.error_message for r in responses if r.error_message]
    penalised = request("penalised", max_tokens=2)
    wire.add_input(penalised, "repetition_penalty", "FP32", [1.3], batch_dim=True)
    responses = await collect(triton, penalised)
    assert "input 'repetition_penalty' is declared" in responses[0].error_message
    assert "does not implement it; omit it" in responses[0].error_message


RESERVED = (
    "parameter keys starting with 'triton_' are reserved for Triton usage. Only the following "
    "keys starting with 'triton_' are allowed: triton_enable_empty_final_response"
)
ANY_TYPE = "expected int64_param, bool_param, or string_param."
BAD_PARAMETERS: list[tuple[str, str, Any, str]] = [
    ("triton_stream", "bool_param", True, RESERVED),
    (
        "triton_enable_empty_final_response",
        "string_param",
        "true",
        "invalid value type for 'triton_enable_empty_final_response' parameter, expected "
        "bool_param.",
    ),
    ("priority", "int64_param", -1, "invalid value for 'priority', expected value >= 0."),
    (
        "sequence_start",
        "int64_param",
        1,
        "invalid value type for 'sequence_start' parameter, expected bool_param.",
    ),
    (
        "timeout",
        "string_param",
        "5s",
        "invalid value type for 'timeout' parameter, expected int64_param.",
    ),
    ("custom", "uint64_param", 3, f"invalid value type for 'custom' parameter, {ANY_TYPE}"),
    ("unset", "", None, f"invalid value type for 'unset' parameter, {ANY_TYPE}"),
]


@pytest.mark.parametrize(("key", "kind", "value", "message"), BAD_PARAMETERS)
async def test_request_parameters_are_checked_as_triton_checks_them(
    triton: ts_grpc.GRPCInferenceServiceStub, key: str, kind: str, value: Any, message: str
) -> None:
    """Triton's gRPC frontend reads a request's parameters before its inputs: reserved keys and
    the value types of those it reads itself are refused INVALID_ARGUMENT."""

    def spoilt(model: str, streaming: bool) -> ts.ModelInferRequest:
        req = _duplicated(request("params", model=model, streaming=streaming))  # inputs later
        if kind:
            setattr(req.parameters[key], kind, value)
        else:
            req.parameters[key].SetInParent()
        return req

    (refused,) = await collect(triton, spoilt(MODEL, True))
    assert (refused.error_message, refused.infer_response.id) == (message, "params")
    assert not refused.infer_response.parameters  # not issued: no final flag
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await triton.ModelInfer(spoilt("sync_llm", False))
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


async def test_parameters_triton_takes_are_served(triton: ts_grpc.GRPCInferenceServiceStub) -> None:
    req = request("taken", max_tokens=2)
    req.parameters["custom"].double_param = 1.5
    req.parameters["priority"].uint64_param = 2
    req.parameters["sequence_id"].string_param = "s"
    req.parameters["timeout"].int64_param = 10_000_000
    responses = await collect(triton, req)
    assert not [m.error_message for m in responses if m.error_message]
    assert is_final(responses[-1].infer_response)


def _duplicated(req: ts.ModelInferRequest) -> ts.ModelInferRequest:
    _tensor(req, "request_output_len", "INT32", "i", [50])
    return req


def _with_contents(req: ts.ModelInferRequest) -> ts.ModelInferRequest:
    req.inputs[2].contents.int_contents.append(50)
    return req


def _asking_unknown_output(req: ts.ModelInferRequest) -> ts.ModelInferRequest:
    req.outputs.add(name="nonexistent_output")
    return req


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (_duplicated, "[request id: spoilt] input 'request_output_len' already exists in request"),
        (
            _with_contents,
            "contents field must not be specified when using raw_input_contents for "
            "'request_output_len' for model 'tensorrt_llm'",
        ),
        (
            _asking_unknown_output,
            "unexpected inference output 'nonexistent_output' for model 'tensorrt_llm'",
        ),
    ],
    ids=["duplicate-input", "contents-and-raw", "unknown-output"],
)
async def test_a_request_triton_would_not_issue_is_refused_in_its_words(
    triton: ts_grpc.GRPCInferenceServiceStub,
    spoil: Callable[[ts.ModelInferRequest], ts.ModelInferRequest],
    message: str,
) -> None:
    responses = await collect(triton, spoil(request("spoilt", max_tokens=4)))
    assert [(r.error_message, r.infer_response.id) for r in responses] == [(message, "spoilt")]


async def test_a_temperature_that_is_not_a_number_is_refused_before_it_runs(
    triton: ts_grpc.GRPCInferenceServiceStub, engine: Engine
) -> None:
    before = engine.stats().started
    responses = await collect(triton, request("nan", temperature=float("nan")))
    assert [r.error_message for r in responses] == [
        "runtime_top_p must be in [0, 1] and temperature >= 0 for 'tensorrt_llm'"
    ]
    assert engine.stats().started == before


async def test_a_tiny_temperature_samples_the_likeliest_token_without_overflowing(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    tiny = await collect(
        triton, request("tiny-t", max_tokens=6, temperature=1e-45, top_k=50, seed=3)
    )
    greedy = await collect(triton, request("greedy", max_tokens=6, temperature=0.0))
    assert not [r.error_message for r in tiny if r.error_message]
    got = [t for r in tiny for t in tokens_of(r.infer_response)]
    assert got == [t for r in greedy for t in tokens_of(r.infer_response)]


async def test_a_failure_while_computing_is_answered_as_triton_answers_a_backend_error(
    triton: ts_grpc.GRPCInferenceServiceStub,
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def fail(job: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.models[MODEL].runner, "_run", fail)
    (failed,) = await collect(triton, request("doomed"))
    assert failed.error_message == "engine failure: injected"
    response = failed.infer_response
    assert (response.id, response.model_name) == ("doomed", MODEL) and is_final(response)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(triton, request("doomed"), metadata=(("triton_grpc_error", "true"),))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == "engine failure: injected"
    # The stream ended by the out-of-band error is no failure of its reader.
    assert not [r for r in caplog.records if r.getMessage() == "stream reader failed"]


async def test_stop_through_model_infer_cancels_and_generates_nothing(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub
) -> None:
    """The backend handles `stop=true` before anything else on either RPC: a stop sent with
    ModelInfer to a non-decoupled model cancels what runs under its id and is answered with a
    response without outputs; it is never run as a generation of its own inputs."""
    stats = engine.stats("sync_llm")
    idle = await triton.ModelInfer(request("nothing-here", [], model="sync_llm", stop=True))
    assert (idle.id, list(idle.outputs)) == ("nothing-here", [])
    long = asyncio.ensure_future(
        triton.ModelInfer(request("sync-long", model="sync_llm", max_tokens=1500, streaming=False))
    )
    await until_engine(stats, lambda: stats.running == "sync-long")
    stopped = await triton.ModelInfer(request("sync-long", model="sync_llm", stop=True))
    assert not stopped.outputs and not stopped.parameters
    assert len(tokens_of(await long)) < 1500
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await triton.ModelInfer(request("", model="sync_llm", stop=True))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == "Trying to stop a request but request ID is not provided"


async def test_responses_for_a_model_that_is_not_decoupled_keep_the_request_order(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    """Triton's stream handler queues a request for a model that is not decoupled (or one it
    could not look up) so that its response leaves in request order; a decoupled model's
    responses leave as they come."""
    bad_parameter = request("bad-parameter", model="sync_llm", streaming=False)
    bad_parameter.parameters["triton_x"].bool_param = True
    requests = [
        request("long", model="sync_llm", max_tokens=1000, streaming=False),
        request("unknown-model", model="nope"),
        bad_parameter,
        request("decoupled", max_tokens=1),
        request("short", model="sync_llm", max_tokens=1, streaming=False),
    ]
    ids = [m.infer_response.id for m in await collect(triton, *requests)]
    assert ids.index("decoupled") < ids.index("long")
    ids.remove("decoupled")
    assert ids == ["long", "unknown-model", "bad-parameter", "short"]


async def test_a_cancelled_model_infer_call_is_counted_once(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub
) -> None:
    """A request whose client cancelled the call still ends with the executor's final result and
    is reported then, as on a cancelled stream: counted once, as a success."""

    async def snapshot() -> ts.ModelStatistics:
        reply = await triton.ModelStatistics(ts.ModelStatisticsRequest(name="sync_llm"))
        return reply.model_stats[0]

    stats = engine.stats("sync_llm")
    before, cancelled = await snapshot(), stats.cancelled
    call = triton.ModelInfer(
        request("given-up", model="sync_llm", max_tokens=1500, streaming=False), timeout=60
    )
    await until_engine(stats, lambda: stats.running == "given-up")
    call.cancel()
    # The runner lets go of the request only after its final result has been handed on.
    await until_engine(stats, lambda: stats.cancelled > cancelled and stats.running is None)
    after = await snapshot()
    assert after.inference_count == before.inference_count + 1
    assert after.inference_stats.success.count == before.inference_stats.success.count + 1
    assert after.inference_stats.compute_infer.count == after.inference_stats.success.count
    assert engine.service.pending_by_model().get("sync_llm", 0) == 0


async def test_streaming_is_refused_for_a_model_that_is_not_decoupled(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    message = "Streaming is only supported if model is deployed using decoupled mode."
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await triton.ModelInfer(request("s", model="sync_llm", streaming=True))
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INTERNAL, message)
    (refused,) = await collect(triton, request("s", model="sync_llm", streaming=True))
    # The backend's error response: the request's last, with its id and model.
    response = refused.infer_response
    assert (refused.error_message, response.id, response.model_name) == (message, "s", "sync_llm")
    assert is_final(response)


async def test_top_k_and_top_p_out_of_range_are_taken_as_the_backend_takes_them(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub
) -> None:
    """The executor refuses a negative top_k; the backend takes a top_p <= 0 as none given (with
    top_k 0: greedy), and a NaN top_p is still refused."""
    before = engine.stats().started
    (refused,) = await collect(triton, request("neg-k", top_k=-1, seed=1))
    assert refused.error_message == "runtime_top_k must be >= 0, got -1"
    assert engine.stats().started == before

    async def tokens(req: ts.ModelInferRequest) -> list[int]:
        responses = await collect(triton, req)
        assert not [r.error_message for r in responses if r.error_message]
        return [t for r in responses for t in tokens_of(r.infer_response)]

    greedy = await tokens(request("greedy-p", max_tokens=6, temperature=0.0))
    assert await tokens(request("neg-p", max_tokens=6, top_k=0, top_p=-0.5, seed=5)) == greedy
    (nan,) = await collect(triton, request("nan-p", top_p=float("nan")))
    assert nan.error_message.startswith("runtime_top_p must be in [0, 1]")


@pytest.mark.parametrize("end_id", [-2, 97, 100_000])
async def test_an_end_id_outside_the_vocabulary_is_refused_as_the_executor_refuses_it(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub, end_id: int
) -> None:
    """The executor accepts an end id in [-1, vocabulary size) and refuses any other before it
    runs; -1 and the last token id are served."""
    vocab = engine.models[MODEL].model.config.vocab_size
    end_id = end_id if end_id != 97 else vocab
    before = engine.stats().started
    (refused,) = await collect(triton, request("bad-end", end_id=end_id))
    assert refused.error_message == (
        "Executor failed process requestId 0 due to the following error: "
        f"EndId ({end_id}) is not within acceptable range [-1, {vocab})."
    )
    assert refused.infer_response.id == "bad-end"
    assert engine.stats().started == before
    for ok in (-1, vocab - 1):
        responses = await collect(triton, request("ok-end", max_tokens=2, end_id=ok))
        assert not [r.error_message for r in responses if r.error_message]


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (
            [1, 2, 3],
            "[request id: bad-shape] unexpected shape for input 'input_ids' for model "
            "'tensorrt_llm'. Expected [-1,-1], "
            "got [1,2,3]. NOTE: Setting a non-zero max_batch_size in the model config requires a "
            "batch dimension to be prepended to each input shape. If you want to specify the full "
            "shape including the batch dim in your input dims config, try setting max_batch_size "
            "to zero. See the model configuration docs for more info on max_batch_size.",
        ),
        (
            [],
            "[request id: bad-shape] input 'input_ids' has no shape but model requires batch "
            "dimension for 'tensorrt_llm'",
        ),
    ],
    ids=["extra-dim", "no-shape"],
)
async def test_a_wrong_shape_is_refused_in_triton_words(
    triton: ts_grpc.GRPCInferenceServiceStub, shape: list[int], message: str
) -> None:
    req = request("bad-shape", max_tokens=2)
    del req.inputs[0].shape[:]
    req.inputs[0].shape.extend(shape)
    (refused,) = await collect(triton, req)
    assert (refused.error_message, refused.infer_response.id) == (message, "bad-shape")


# Triton core's checks of a request's inputs (its Normalize), in its order:
# every input's name and batch dimension, the batch size, then per input its datatype, shape
# and byte size.


def _short_raw(req: ts.ModelInferRequest) -> ts.ModelInferRequest:
    req.raw_input_contents[2] = req.raw_input_contents[2][:3]
    return req


def _bytes_in_int32(req: ts.ModelInferRequest) -> ts.ModelInferRequest:
    req.raw_input_contents[0] = req.raw_input_contents[0] + b"\0\0\0\0"
    return req


def _batch_two_and_wrong_type(req: ts.ModelInferRequest) -> ts.ModelInferRequest:
    req.inputs[1].datatype = "FP32"
    for tensor in req.inputs:
        tensor.shape[0] = 2
    return req


def _batches_disagree_and_wrong_type(req: ts.ModelInferRequest) -> ts.ModelInferRequest:
    req.inputs[1].datatype = "FP32"
    req.inputs[2].shape[0] = 2
    return req


def _batches_disagree_then_no_shape(req: ts.ModelInferRequest) -> ts.ModelInferRequest:
    req.inputs[1].shape[0] = 3
    del req.inputs[2].shape[:]
    return req


def _raw_for_fewer_inputs(req: ts.ModelInferRequest) -> ts.ModelInferRequest:
    del req.raw_input_contents[-1]
    return req


def _wildcard_dim(req: ts.ModelInferRequest) -> ts.ModelInferRequest:
    req.inputs[0].shape[1] = -1
    return req


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (
            _short_raw,
            "[request id: spoilt] input byte size mismatch for input 'request_output_len' for "
            "model 'tensorrt_llm'. Expected 4, got 3",
        ),
        (
            _bytes_in_int32,
            "[request id: spoilt] input byte size mismatch for input 'input_ids' for model "
            "'tensorrt_llm'. Expected 24, got 28",
        ),
        (
            _batch_two_and_wrong_type,
            "[request id: spoilt] inference request batch-size must be <= 1 for 'tensorrt_llm'",
        ),
        (
            _batches_disagree_and_wrong_type,
            "[request id: spoilt] input 'request_output_len' batch size does not match other "
            "inputs for 'tensorrt_llm'",
        ),
        (
            _batches_disagree_then_no_shape,
            "[request id: spoilt] input 'input_lengths' batch size does not match other inputs "
            "for 'tensorrt_llm'",
        ),
        (
            _raw_for_fewer_inputs,
            "unable to find data for input tensor 'streaming' for model 'tensorrt_llm' in request.",
        ),
        (
            _wildcard_dim,
            "[request id: spoilt] All input dimensions should be specified for input 'input_ids' "
            "for model 'tensorrt_llm', got [1,-1]",
        ),
    ],
    ids=[
        "short-raw",
        "long-raw",
        "batch-before-type",
        "batches-disagree",
        "disagree-before-no-shape",
        "raw-missing",
        "wildcard-dim",
    ],
)
async def test_inputs_are_checked_in_triton_core_order_and_words(
    triton: ts_grpc.GRPCInferenceServiceStub,
    spoil: Callable[[ts.ModelInferRequest], ts.ModelInferRequest],
    message: str,
) -> None:
    (refused,) = await collect(triton, spoil(request("spoilt", max_tokens=4)))
    assert (refused.error_message, refused.infer_response.id) == (message, "spoilt")


async def test_what_triton_accepts_is_served(triton: ts_grpc.GRPCInferenceServiceStub) -> None:
    """Triton's gRPC frontend reads raw_input_contents by input and
    leaves any entry past the last input unread; core keeps requested outputs in a set
    (AddOriginalRequestedOutput), so one named twice is one output."""
    extra = request("extra-raw", max_tokens=2)
    extra.raw_input_contents.append(b"unread")
    twice = request("output-twice", max_tokens=2)
    twice.outputs.add(name="output_ids")
    twice.outputs.add(name="output_ids")
    for req in (extra, twice):
        responses = await collect(triton, req)
        assert not [r.error_message for r in responses if r.error_message]
        assert sum(len(tokens_of(r.infer_response)) for r in responses) == 2
    assert [o.name for o in responses[-1].infer_response.outputs] == ["output_ids"]


def test_a_bytes_input_in_the_wrong_form_is_refused_in_triton_words() -> None:
    """Triton's ValidateBytesInputs: each element is a 4-byte length then its
    bytes, and the count must match the shape. (The served test models declare no BYTES input.)"""
    from appliance.backends import wire
    from appliance.engine.infer_request import InferError, check_byte_size

    where = "for inference input 'guide' for model 'm'"
    # Triton core's ValidateBytesInputs starts its messages with the request's id (LogRequest).
    prefix = "[request id: r] "
    cases = [
        (
            wire.encode("BYTES", [b"json", b"regex"]),
            f"{prefix}unexpected number of string elements 2 {where}, expecting 1",
        ),
        (
            b"\x04\0",
            f"{prefix}incomplete string length indicator {where}, expecting 4 bytes but only 2 "
            "bytes available. Please make sure the string length indicator is in one buffer.",
        ),
        (b"", f"{prefix}expected 1 string elements {where}, got 0"),
    ]
    for raw, message in cases:
        with pytest.raises(InferError) as refused:
            check_byte_size("guide", "BYTES", raw, 1, "m", "r")
        assert refused.value.message == message
    check_byte_size("guide", "BYTES", wire.encode("BYTES", [b"json"]), 1, "m", "r")


async def test_an_input_declared_in_a_type_the_engine_does_not_decode_is_refused_in_band(
    tiny: Tiny, tmp_path: Path
) -> None:
    """A config may declare FP16 or BF16 inputs (the TensorRT-LLM template's
    prompt_embedding_table): a request sending one gets Triton's byte-size refusal, or, its size
    right, an in-band INVALID_ARGUMENT; the stream carries on, never ending without an answer."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from appliance.engine.server import load_repository, start_engine, stop_engine

    repo = copy_repository(tiny.repo, tmp_path / "repo")
    config = repo / MODEL / "config.pbtxt"
    parsed = text_format.Parse(config.read_text(), mc.ModelConfig())
    table = "prompt_embedding_table"
    parsed.input.add(name=table, data_type=mc.TYPE_FP16, dims=[-1, -1], optional=True)
    config.write_text(text_format.MessageToString(parsed))
    models = load_repository(repo)
    server, service, port = await start_engine(models, "127.0.0.1:0")
    requests = []
    for request_id, raw in (("short", b"\0"), ("sized", b"\0\0")):
        req = request(request_id, max_tokens=2)
        req.inputs.add(name=table, datatype="FP16", shape=[1, 1, 1])
        req.raw_input_contents.append(raw)
        requests.append(req)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ts_grpc.GRPCInferenceServiceStub(channel)
            answers = await collect(stub, *requests, request("after", max_tokens=2))
    finally:
        await stop_engine(server, service, 0.0)
        for m in models.values():
            m.runner.close()
    errors = [r.error_message for r in answers if r.error_message]
    assert errors == [
        f"[request id: short] input byte size mismatch for input '{table}' for model '{MODEL}'. "
        "Expected 2, got 1",
        f"input '{table}' for model '{MODEL}': datatype 'FP16' is not supported; use one of "
        "BOOL, INT8, UINT8, INT16, UINT16, INT32, UINT32, INT64, UINT64, FP32, FP64, BYTES",
    ]
    assert any(is_final(r.infer_response) and r.infer_response.id == "after" for r in answers)


async def test_pad_id_is_taken_as_the_backend_takes_it(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    """The backend hands pad_id to the executor's Request (TensorRT-LLM
    triton_backend/inflight_batcher_llm/src/utils.cc, createRequestsFromInputTensors), which pads
    with it only where a beam is shorter than others or an encoder-decoder model has no decoder
    input: a beam-1 answer of a decoder-only model holds exactly the generated ids either way. It
    is checked as every declared input is: INT32, shape [1, 1]."""
    from appliance.backends import wire

    plain = await collect(triton, request("plain", max_tokens=4, temperature=0.0))
    padded = request("padded", max_tokens=4, temperature=0.0)
    wire.add_input(padded, "pad_id", "INT32", [7], batch_dim=True)
    answered = await collect(triton, padded)
    assert not [r.error_message for r in answered if r.error_message]
    assert [tokens_of(r.infer_response) for r in answered] == [
        tokens_of(r.infer_response) for r in plain
    ]
    wrong_type = request("pad-fp32", max_tokens=4)
    wire.add_input(wrong_type, "pad_id", "FP32", [7.0], batch_dim=True)
    wrong_shape = request("pad-two", max_tokens=4)
    wire.add_input(wrong_shape, "pad_id", "INT32", [7, 7], batch_dim=True)
    (type_refused,) = await collect(triton, wrong_type)
    (shape_refused,) = await collect(triton, wrong_shape)
    assert type_refused.error_message == (
        "[request id: pad-fp32] inference input 'pad_id' data-type is 'FP32', but model "
        "'tensorrt_llm' expects 'INT32'"
    )
    assert shape_refused.error_message.startswith(
        "[request id: pad-two] unexpected shape for input 'pad_id' for model 'tensorrt_llm'. "
        "Expected [-1,1], got [1,2]."
    )


async def test_a_fault_of_this_server_on_one_request_is_its_error_and_the_stream_goes_on(
    triton: ts_grpc.GRPCInferenceServiceStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault of this server's own code while it takes a request (a bug: here one injected
    into the guide step) is answered as the TensorRT-LLM backend answers an exception it
    catches: that request's final error response, INTERNAL, and the stream serves the next
    request. It never ends the stream with OK and requests unanswered."""
    from appliance.engine import server as engine_server
    from appliance.engine.infer_request import Decoded, compile_guide
    from appliance.engine.server import EngineModel

    real = compile_guide

    async def faulty(decoded: Decoded, model: EngineModel, request: ts.ModelInferRequest) -> None:
        if request.id == "boom":
            raise RuntimeError("a fault of the server's own code")
        await real(decoded, model, request)

    monkeypatch.setattr(engine_server, "compile_guide", faulty)
    answers = await collect(triton, request("boom", max_tokens=2), request("after", max_tokens=2))
    errors = [r for r in answers if r.error_message]
    assert [r.infer_response.id for r in errors] == ["boom"]
    assert "RuntimeError" in errors[0].error_message
    assert is_final(errors[0].infer_response)
    assert any(is_final(r.infer_response) and r.infer_response.id == "after" for r in answers)


async def test_a_fault_answering_one_request_is_its_final_error_and_the_stream_goes_on(
    triton: ts_grpc.GRPCInferenceServiceStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault of this server's own code while it builds a response of an issued request (a
    bug: here one injected into the response builder) is that request's final error response,
    INTERNAL, sent once: the request is not left unanswered nor the stream open forever, and
    the next request on the stream is served."""
    from appliance.engine import server as engine_server

    real = engine_server._response

    def faulty(name: str, infer: ts.ModelInferRequest, *args: Any) -> ts.ModelInferResponse:
        if infer.id == "boom":
            raise RuntimeError("a fault of the server's own code")
        return real(name, infer, *args)

    monkeypatch.setattr(engine_server, "_response", faulty)
    answers = await collect(triton, request("boom", max_tokens=4), request("after", max_tokens=2))
    boom = [r for r in answers if r.infer_response.id == "boom"]
    assert len(boom) == 1
    assert "RuntimeError" in boom[0].error_message
    assert is_final(boom[0].infer_response)
    assert any(is_final(r.infer_response) and r.infer_response.id == "after" for r in answers)


@pytest.mark.parametrize("where", ["compile_guide", "_response"])
async def test_a_fault_of_this_server_on_a_model_infer_call_is_internal_in_its_words(
    triton: ts_grpc.GRPCInferenceServiceStub, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """ModelInfer answers a fault of this server's own code (a bug: here one injected before
    the request is issued, or into the response builder) as the stream does: INTERNAL, its
    type and text, as the TensorRT-LLM backend's error response for an exception it catches;
    not grpc's UNKNOWN "Unexpected error"."""
    from appliance.engine import server as engine_server

    def faulty(*args: Any) -> Any:
        raise RuntimeError("a fault of the server's own code")

    monkeypatch.setattr(engine_server, where, faulty)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await triton.ModelInfer(request(model="sync_llm", max_tokens=2, streaming=False))
    assert refused.value.code() == grpc.StatusCode.INTERNAL
    assert refused.value.details() == "RuntimeError: a fault of the server's own code"
