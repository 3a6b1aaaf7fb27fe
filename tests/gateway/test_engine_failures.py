"""An engine that fails a request it was given (its own fault, or a status the gateway does not
know) is, to the client, a service that could not answer now: UNAVAILABLE with a retry hint on
gRPC, 503 on HTTP, the engine's words kept; never INTERNAL or UNKNOWN. A refusal of the request
itself keeps its status."""

from __future__ import annotations

import aiohttp
import grpc
import pytest

from appliance.config import CacheConfig, HttpConfig
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Tiny
from tests.gateway.plugin_classes import FailsAfterOne, plugin_gateway


async def test_an_engine_failure_is_unavailable_with_a_hint_and_the_engines_words(
    tiny: Tiny,
) -> None:
    listen = HttpConfig(listen="127.0.0.1:0")
    async with plugin_gateway(
        tiny.tokenizer_dir, "FailsAfterOne", cache=CacheConfig(enabled=False), http=listen
    ) as gateway:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            for max_tokens, code in FailsAfterOne.FAILURES.items():
                expected = (
                    code
                    if code == grpc.StatusCode.INVALID_ARGUMENT
                    else grpc.StatusCode.UNAVAILABLE
                )
                request = pb.GenerateRequest(
                    model="tiny", prompt="hello there", max_tokens=max_tokens, temperature=0
                )
                with pytest.raises(grpc.aio.AioRpcError) as unary:
                    await stub.Complete(request)
                assert unary.value.code() == expected, (code, unary.value.details())
                assert "Executor failed process requestId 3" in (unary.value.details() or "")
                streamed = stub.Generate(request)
                with pytest.raises(grpc.aio.AioRpcError) as stream:
                    async for _ in streamed:
                        pass
                assert stream.value.code() == expected, (code, stream.value.details())
                if expected == grpc.StatusCode.UNAVAILABLE:
                    trailers = dict(await streamed.trailing_metadata() or ())
                    assert int(trailers["grpc-retry-pushback-ms"]) > 0
        assert gateway.http is not None
        async with aiohttp.ClientSession() as http:
            body = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}
            url = f"http://127.0.0.1:{gateway.http.port}/v1/completions"
            async with http.post(url, json=body) as answer:
                assert answer.status == 503, await answer.text()
                assert "Executor failed" in (await answer.json())["error"]["message"]
                assert int(answer.headers["Retry-After"]) >= 1


async def test_every_engine_failure_the_client_is_told_of_as_unavailable_counts_against_it(
    tiny: Tiny,
) -> None:
    """A failure the client is told of as the engine's own (UNAVAILABLE, not its request's
    status) is one the model's health counts: its breaker opens on them as on any engine fault."""
    cache = CacheConfig(enabled=False)
    async with (
        plugin_gateway(tiny.tokenizer_dir, "FailsAfterOne", cache=cache) as gateway,
        grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel,
    ):
        stub = pb_grpc.InferenceStub(channel)
        health = gateway.models["tiny"].health
        for max_tokens, code in FailsAfterOne.FAILURES.items():
            health.last_failure = ""
            request = pb.GenerateRequest(
                model="tiny", prompt="hello there", max_tokens=max_tokens, temperature=0
            )
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.Complete(request)
            counted = health.last_failure.startswith(f"{code.name}:")
            assert counted == (failed.value.code() == grpc.StatusCode.UNAVAILABLE), code
