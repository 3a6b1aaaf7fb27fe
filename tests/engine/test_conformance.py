"""The engine server behaves like Triton + the tensorrt_llm backend on every point the gateway uses.

One test per behaviour; requests are built by hand with tritonclient's protos, not with the gateway's
client, so the two cannot agree on a mistake.
"""

from __future__ import annotations

import array
import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc
import pytest
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.engine.runner import EngineStats
from tests.conftest import Engine

MODEL = "tensorrt_llm"
PROMPT = [1, 300, 301, 302, 303, 304]


def _tensor(req: ts.ModelInferRequest, name: str, dtype: str, code: str, values: list) -> None:
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
    fields = [
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
    return response.parameters["triton_final_response"].bool_param


async def collect(
    stub: ts_grpc.GRPCInferenceServiceStub, *requests: ts.ModelInferRequest, metadata: tuple = ()
) -> list[ts.ModelStreamInferResponse]:
    async def gen() -> AsyncIterator[ts.ModelInferRequest]:
        for r in requests:
            yield r

    return [m async for m in stub.ModelStreamInfer(gen(), metadata=metadata, timeout=60)]


async def wait_for(stats: EngineStats, predicate: object, timeout: float = 30.0) -> None:
    """Waits on the engine's own state (not on time) for a condition to hold."""

    def block() -> bool:
        with stats.changed:
            return stats.changed.wait_for(predicate, timeout=timeout)  # type: ignore[arg-type]

    assert await asyncio.to_thread(block), "engine state did not change"


async def test_server_and_model_readiness(triton: ts_grpc.GRPCInferenceServiceStub) -> None:
    assert (await triton.ServerLive(ts.ServerLiveRequest())).live
    assert (await triton.ServerReady(ts.ServerReadyRequest())).ready
    assert (await triton.ModelReady(ts.ModelReadyRequest(name=MODEL))).ready
    assert not (await triton.ModelReady(ts.ModelReadyRequest(name="nope"))).ready


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
    good = [m.infer_response for m in responses[1:]]
    assert [r.id for r in good] == ["good", "good"] and is_final(good[-1])


async def test_missing_required_input_is_an_in_band_error(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    responses = await collect(triton, request(skip=["request_output_len"]))
    assert "missing required input(s) ['request_output_len']" in responses[0].error_message


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
    assert len(tokens_of(reply)) == 4 and is_final(reply)


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
) -> tuple[grpc.aio.StreamStreamCall, asyncio.Queue]:
    outgoing: asyncio.Queue = asyncio.Queue()
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


async def test_stop_with_the_same_id_cancels_and_sends_the_empty_final(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub
) -> None:
    stats: EngineStats = engine.models[MODEL].runner.stats
    before = stats.cancelled
    call, outgoing = await _first_token_then(triton, request("long-1", max_tokens=1500))
    stop_replies = await collect(triton, request("long-1", stop=True))  # from another stream
    await wait_for(stats, lambda: stats.cancelled > before)
    await outgoing.put(None)
    rest = await read_rest(call)
    assert stats.tokens_generated and stats.running is None
    assert rest and rest[-1].id == "long-1" and is_final(rest[-1]) and not rest[-1].outputs
    assert sum(len(tokens_of(r)) for r in rest) < 1499
    assert [is_final(m.infer_response) for m in stop_replies] == [True]


async def test_without_the_flag_a_cancelled_request_ends_with_no_response(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub
) -> None:
    stats: EngineStats = engine.models[MODEL].runner.stats
    before = stats.cancelled
    call, outgoing = await _first_token_then(
        triton, request("long-2", max_tokens=1500, empty_final=False)
    )
    await outgoing.put(request("long-2", stop=True, empty_final=False))
    await wait_for(stats, lambda: stats.cancelled > before)
    await outgoing.put(None)
    rest = await read_rest(call)
    assert not any(is_final(r) for r in rest)  # Triton drops a flag-only final response
    assert all(tokens_of(r) for r in rest)


async def test_closing_the_stream_cancels_generation(
    engine: Engine, triton: ts_grpc.GRPCInferenceServiceStub
) -> None:
    stats: EngineStats = engine.models[MODEL].runner.stats
    before_cancelled, before_tokens = stats.cancelled, stats.tokens_generated
    call, _ = await _first_token_then(triton, request("long-3", max_tokens=1500))
    call.cancel()
    await wait_for(stats, lambda: stats.cancelled > before_cancelled and stats.running is None)
    assert stats.tokens_generated - before_tokens < 1500


async def test_statistics_count_requests(triton: ts_grpc.GRPCInferenceServiceStub) -> None:
    before = (await triton.ModelStatistics(ts.ModelStatisticsRequest(name=MODEL))).model_stats[0]
    await collect(triton, request(max_tokens=2))
    after = (await triton.ModelStatistics(ts.ModelStatisticsRequest(name=MODEL))).model_stats[0]
    assert after.inference_count == before.inference_count + 1
    assert after.inference_stats.success.count == before.inference_stats.success.count + 1


async def test_prompt_beyond_the_model_context_is_refused(
    triton: ts_grpc.GRPCInferenceServiceStub,
) -> None:
    responses = await collect(triton, request(max_tokens=5000))
    assert "exceeds the maximum sequence length" in responses[0].error_message
