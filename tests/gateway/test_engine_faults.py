"""An engine that misbehaves under the gateway: one whose stream breaks partway (it restarted) is,
to the client, a service to retry shortly (UNAVAILABLE with a retry hint, 503 with Retry-After);
one that accepts streams and then sends nothing holds no client past its deadline, leaks no
admission slot and has every engine request it was given ended."""

from __future__ import annotations

import asyncio
import signal
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import grpc
import pytest
from tritonclient.grpc import service_pb2 as ts

from appliance.backends import wire
from appliance.backends.base import GREEDY, GenerationRequest
from appliance.backends.stream_socket import PREAMBLE, frame
from appliance.backends.triton import REQUIRED_INPUTS, InputNames, TritonBackend
from appliance.config import CacheConfig, HttpConfig
from appliance.gateway.server import RunningGateway
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Tiny
from tests.gateway.plugin_classes import Stalls, plugin_gateway
from tests.gateway.test_latency_discipline import (  # noqa: F401  (fixtures)
    LONG,
    EngineProcess,
    channel,
    engines,
    gateway,
    req,
)
from tests.support import until_async

NO_CACHE = CacheConfig(enabled=False)


def complete(max_tokens: int, prompt: str = "hello there") -> pb.GenerateRequest:
    return pb.GenerateRequest(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)


def settled(running: RunningGateway, model: str = "tiny") -> bool:
    """Nothing of any request is left: no slot held, nobody waiting, nothing in flight."""
    gate = running.pipeline.admission.gates[model]  # type: ignore[attr-defined]
    return not gate.running and not gate.waiting and running.pipeline.in_flight[model] == 0


async def test_a_stream_the_engine_breaks_partway_is_unavailable_with_a_retry_hint(
    tiny: Tiny,
) -> None:
    listen = HttpConfig(listen="127.0.0.1:0")
    async with (
        plugin_gateway(tiny.tokenizer_dir, "ResetsMidStream", cache=NO_CACHE, http=listen) as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as to,
    ):
        stub = pb_grpc.InferenceStub(to)
        streamed = stub.Generate(complete(4))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in streamed:
                pass
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        assert "closed the stream before the end" in (failed.value.details() or "")
        trailers = dict(await streamed.trailing_metadata() or ())
        assert int(trailers["grpc-retry-pushback-ms"]) >= 1000
        assert gw.http is not None
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}
            url = f"http://127.0.0.1:{gw.http.port}/v1/completions"
            async with http.post(url, json=body) as answer:
                assert answer.status == 503, await answer.text()
                assert int(answer.headers["Retry-After"]) >= 1
        await until_async(lambda: settled(gw), "a broken stream left its request behind")


async def test_an_engine_that_never_answers_holds_nobody_past_the_deadline_nor_a_slot(
    tiny: Tiny,
) -> None:
    """One slot; three clients without a deadline of their own (the model's is theirs): the one
    at the engine gets no token, the two behind it wait in line. Each ends by the deadline, every
    engine request is ended, and the slot goes to the next request."""
    async with (
        plugin_gateway(tiny.tokenizer_dir, "Stalls", cache=NO_CACHE, default_deadline_s=0.5) as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as to,
    ):
        stub = pb_grpc.InferenceStub(to)
        backend = gw.models["tiny"].backend
        assert isinstance(backend, Stalls)
        calls = [stub.Complete(complete(2, f"prompt {n}")) for n in range(3)]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        codes = []
        for outcome in outcomes:
            assert isinstance(outcome, grpc.aio.AioRpcError), outcome
            codes.append(outcome.code())
        assert codes[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        # A waiter leaves the line when its first token could no longer come in time.
        assert set(codes[1:]) <= {
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        }, codes
        await until_async(lambda: settled(gw), "a stalled engine kept a slot or a request")
        assert backend.ended == backend.streams >= 1
        # The slot is free: the next request reaches the engine, gets its token, then the
        # deadline.
        before = backend.streams
        streamed = stub.Generate(complete(3))
        first = await streamed.read()
        assert isinstance(first, pb.GenerateResponse) and list(first.token_ids)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            while await streamed.read() is not grpc.aio.EOF:
                pass
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert backend.streams == before + 1
        await until_async(lambda: settled(gw), "a stall after a token kept a slot or a request")
        assert backend.ended == backend.streams


class ReplayingEngine:
    """A stream socket engine that answers each request with one token, 7, and its final response,
    then once more with a copy of that final (`duplicate_final`) or, before its own answer, with a
    token, 99, for a request id it was never sent (`foreign`)."""

    def __init__(self, duplicate_final: bool = False, foreign: bool = False) -> None:
        self.duplicate_final = duplicate_final
        self.foreign = foreign
        self.connections = 0

    def answer(self, request: ts.ModelInferRequest) -> list[ts.ModelStreamInferResponse]:
        def response(rid: str, tokens: list[int], final: bool) -> ts.ModelStreamInferResponse:
            out = ts.ModelInferResponse(model_name=request.model_name, id=rid)
            out.parameters["triton_final_response"].bool_param = final
            if tokens:
                wire.add_output(out, "output_ids", "INT32", tokens, [1, 1, len(tokens)])
            return ts.ModelStreamInferResponse(infer_response=out)

        answer = [response(request.id, [7], False), response(request.id, [], True)]
        if self.foreign:
            answer.insert(0, response("someone-else", [99], False))
        if self.duplicate_final:
            answer.append(response(request.id, [], True))
        return answer

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await reader.readexactly(len(PREAMBLE))
            while True:
                (size,) = struct.unpack("<I", await reader.readexactly(4))
                request = ts.ModelInferRequest.FromString(await reader.readexactly(size))
                for response in self.answer(request):
                    writer.write(frame(response))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client closed the stream, or the test ended (Python 3.11 logs a cancel)
        finally:
            writer.close()


@asynccontextmanager
async def socket_backend(engine: ReplayingEngine, tmp_path: Path) -> AsyncIterator[TritonBackend]:
    path = tmp_path / "engine.sock"
    server = await asyncio.start_unix_server(engine.serve, str(path))
    backend = TritonBackend("127.0.0.1:1", "tensorrt_llm", path)
    backend._names = InputNames(
        present=frozenset(REQUIRED_INPUTS), seed=None, min_tokens=None, batch_dim=True
    )
    try:
        yield backend
    finally:
        await backend.close()
        server.close()


def generation(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2, 3], 4, None, None, GREEDY, 10.0)


async def tokens(backend: TritonBackend, rid: str) -> list[int]:
    return [t async for step in backend.stream(generation(rid)) for t in step]


@pytest.mark.parametrize("fault", ["duplicate_final", "foreign"])
async def test_a_response_for_another_request_is_never_taken_as_this_ones(
    fault: str, tmp_path: Path
) -> None:
    """A duplicate final left on a kept stream, or a response naming a request id the stream
    never carried, is not the answer of the request that reads it."""
    engine = ReplayingEngine(**{fault: True})
    async with socket_backend(engine, tmp_path) as backend:
        assert await tokens(backend, "gw-1") == [7]
        assert await tokens(backend, "gw-2") == [7]
        assert await tokens(backend, "gw-3") == [7]
        assert engine.connections == 1  # one kept stream carried them all


async def test_a_flight_goes_on_while_anyone_follows_it_and_ends_at_the_engine_after(
    tiny: Tiny,
) -> None:
    """Two clients ask the same cacheable question: one generation. Its leader's client leaving
    leaves it running for the other; the other leaving too ends the engine request."""
    async with (
        plugin_gateway(tiny.tokenizer_dir, "Stalls") as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as to,
    ):
        stub = pb_grpc.InferenceStub(to)
        backend = gw.models["tiny"].backend
        assert isinstance(backend, Stalls)
        leader = stub.Generate(complete(3))
        assert list((await leader.read()).token_ids)
        follower = stub.Generate(complete(3))
        assert list((await follower.read()).token_ids)  # the token generated before it came
        assert backend.streams == 1
        leader.cancel()
        await until_async(lambda: gw.pipeline.in_flight["tiny"] == 1, "the leader never left")
        assert backend.ended == 0
        follower.cancel()
        await until_async(lambda: settled(gw), "an abandoned flight kept its slot")
        assert backend.ended == 1


async def test_a_backend_that_breaks_its_contract_fails_no_request_with_unknown(
    tiny: Tiny, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend that raises what is no BackendError (a bug of its own), before its first token
    or after: the client is told the engine could not answer (UNAVAILABLE, a retry hint), the
    model's health counts it, and the log says where it broke."""
    settings = {"cache": NO_CACHE, "breaker_failures": 10}
    async with (
        plugin_gateway(tiny.tokenizer_dir, "Breaks", **settings) as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as to,
    ):
        stub = pb_grpc.InferenceStub(to)
        health = gw.models["tiny"].health
        for max_tokens in (2, 3):
            streamed = stub.Generate(complete(max_tokens))
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in streamed:
                    pass
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
            assert "RuntimeError" in (failed.value.details() or "")
            trailers = dict(await streamed.trailing_metadata() or ())
            assert int(trailers["grpc-retry-pushback-ms"]) >= 1000
            assert "RuntimeError" in health.last_failure
            health.last_failure = ""
        await until_async(lambda: settled(gw), "a broken backend left its request behind")
    assert any("plugin_classes.py" in r.getMessage() for r in caplog.records)
    assert not any("a bug of the backend's own" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "gateway", [({"breaker_failures": 1, "breaker_reset_s": 0.3}, {})], indirect=True
)
async def test_an_engine_killed_mid_stream_fails_its_stream_with_a_hint_then_recovers(
    gateway: RunningGateway,  # noqa: F811
    channel: grpc.aio.Channel,  # noqa: F811
    engines: tuple[EngineProcess, ...],  # noqa: F811
) -> None:
    stub = pb_grpc.InferenceStub(channel)
    primary = gateway.pipeline.models["primary"]
    long = stub.Generate(req(**LONG))
    assert list((await long.read()).token_ids)
    engines[0].signal(signal.SIGKILL)
    engines[0].proc.wait()  # type: ignore[union-attr]
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        while await long.read() is not grpc.aio.EOF:
            pass
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
    trailers = dict(await long.trailing_metadata() or ())
    assert int(trailers["grpc-retry-pushback-ms"]) >= 1000
    assert primary.health.breaker.opened == 1
    await until_async(lambda: settled(gateway, "primary"), "the broken stream kept its slot")
    engines[0].start()  # same port
    await engines[0].wait_ready()

    async def from_primary() -> pb.CompleteResponse | None:
        try:
            reply: pb.CompleteResponse = await stub.Complete(
                req(cache_policy=pb.CACHE_POLICY_BYPASS)
            )
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
            return None
        return reply

    again = await until_async(from_primary, "the engine never answered again", 30.0, 0.1)
    assert again.final.model == "primary"
    assert primary.health.breaker.state == "closed"


async def test_tokens_past_max_tokens_are_neither_sent_nor_kept(tiny: Tiny) -> None:
    """An engine that goes on past the request's max_tokens: the answer stops at max_tokens
    (finish reason length, usage counting what was sent) and the engine request is ended."""
    async with (
        plugin_gateway(tiny.tokenizer_dir, "Overruns", cache=NO_CACHE) as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as to,
    ):
        stub = pb_grpc.InferenceStub(to)
        backend = gw.models["tiny"].backend
        reply = await stub.Complete(complete(7), timeout=30)
        assert len(reply.token_ids) == 7
        assert reply.final.usage.completion_tokens == 7
        assert reply.final.finish_reason == pb.FINISH_REASON_LENGTH
        await until_async(lambda: settled(gw), "an overrunning engine kept its slot")
        assert backend.ended == backend.streams == 1  # type: ignore[attr-defined]


async def test_a_half_open_breaker_lets_one_of_a_hundred_concurrent_requests_probe(
    tiny: Tiny,
) -> None:
    """A hundred requests arrive together once the breaker's open time has passed: one reaches
    the engine, the others are refused as while it was open, with a retry hint."""
    settings = {
        "cache": NO_CACHE,
        "breaker_failures": 1,
        "breaker_reset_s": 0.1,
        "max_in_flight": 4,
        "max_queue": 200,
        "default_deadline_s": 30.0,
    }
    async with (
        plugin_gateway(tiny.tokenizer_dir, "Stalls", **settings) as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as to,
    ):
        stub = pb_grpc.InferenceStub(to)
        backend = gw.models["tiny"].backend
        assert isinstance(backend, Stalls)
        breaker = gw.models["tiny"].health.breaker
        gw.models["tiny"].health.failed("a test opened it")
        await until_async(lambda: breaker.state == "half-open", "the breaker never half-opened")
        calls = [stub.Complete(complete(2, f"prompt {n}")) for n in range(100)]
        await until_async(lambda: sum(c.done() for c in calls) == 99, "not 99 were refused")
        probe = next(c for c in calls if not c.done())
        for call in calls:
            if call is probe:
                continue
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
            trailers = dict(refused.value.trailing_metadata() or ())
            assert int(trailers["grpc-retry-pushback-ms"]) >= 1000
        assert backend.streams == 1  # only the probe reached the engine
        probe.cancel()
        await until_async(lambda: settled(gw), "the probe kept its slot")


async def test_a_readiness_check_that_raises_marks_the_engine_unreachable(tiny: Tiny) -> None:
    """The health monitor outlives a backend whose readiness check raises: the model is not
    serving, and says why."""
    async with plugin_gateway(tiny.tokenizer_dir, "ReadinessBreaks", cache=NO_CACHE) as gw:
        health = gw.models["tiny"].health
        await until_async(lambda: not health.reachable, "the engine never became unreachable")
        assert "RuntimeError" in health.describe()
        await gw.monitor.check()  # another round: the monitor goes on
        assert not health.reachable


async def test_a_request_let_through_before_the_probe_failing_lets_no_second_probe(
    tiny: Tiny,
) -> None:
    """A request let through while the breaker was closed fails while the probe is out: the
    probe still decides, so once the open time passes again no second request probes."""
    settings = {
        "cache": NO_CACHE,
        "breaker_failures": 1,
        "breaker_reset_s": 0.1,
        "max_in_flight": 4,
        "ttft_budget_ms": 1.0,  # a stalled request its client leaves counts against the engine
        "default_deadline_s": 5.0,
    }
    async with (
        plugin_gateway(tiny.tokenizer_dir, "Stalls", **settings) as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as to,
    ):
        stub = pb_grpc.InferenceStub(to)
        backend = gw.models["tiny"].backend
        assert isinstance(backend, Stalls)
        health = gw.models["tiny"].health
        straggler = stub.Generate(complete(2, "let through while closed"))
        await until_async(lambda: backend.streams == 1, "the first never reached the engine")
        health.failed("a test opened it")
        await until_async(lambda: health.breaker.state == "half-open", "never half-opened")
        probe = stub.Generate(complete(2, "the probe"))
        await until_async(lambda: backend.streams == 2, "the probe never reached the engine")
        straggler.cancel()
        await until_async(lambda: backend.ended == 1, "the first never ended")
        await until_async(lambda: health.breaker.state != "open", "the breaker stayed open")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Complete(complete(2, "while the probe is out"))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        assert backend.streams == 2
        probe.cancel()
        await until_async(lambda: settled(gw), "the probe kept its slot")


async def test_a_flight_waiting_for_a_slot_leaves_the_line_when_its_last_client_leaves(
    tiny: Tiny,
) -> None:
    async with (
        plugin_gateway(tiny.tokenizer_dir, "Stalls", max_queue=4) as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as to,
    ):
        stub = pb_grpc.InferenceStub(to)
        backend = gw.models["tiny"].backend
        assert isinstance(backend, Stalls)
        gate = gw.pipeline.admission.gates["tiny"]  # type: ignore[attr-defined]
        holder = stub.Generate(complete(2, "holds the only slot"))
        await until_async(lambda: backend.streams == 1, "the slot was never taken")
        waiting = [stub.Generate(complete(3, "one answer for both")) for _ in range(2)]
        await until_async(
            lambda: gw.pipeline.flights.joined == 1 and len(gate.waiting) == 1,
            "the two never waited on one flight",
        )
        for call in waiting:
            call.cancel()
        await until_async(lambda: not gate.waiting, "the abandoned flight stayed in line")
        holder.cancel()
        await until_async(lambda: settled(gw), "a request was left behind")
        assert backend.streams == backend.ended == 1


async def test_an_end_past_max_tokens_does_not_make_the_cut_answer_stopped(tiny: Tiny) -> None:
    """The engine's end id comes after more tokens than max_tokens: the answer is cut at
    max_tokens, which is what ended it (finish reason length, not stop)."""
    async with (
        plugin_gateway(tiny.tokenizer_dir, "OverrunsToItsEnd", cache=NO_CACHE) as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as to,
    ):
        reply = await pb_grpc.InferenceStub(to).Complete(complete(2), timeout=30)
        assert len(reply.token_ids) == 2
        assert reply.final.finish_reason == pb.FINISH_REASON_LENGTH
