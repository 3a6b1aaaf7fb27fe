"""The OpenAI-compatible HTTP API, driven by the official `openai` SDK (and raw HTTP where the SDK
cannot send what a hostile client can), against the gateway in front of the engine server; both run
in the test's event loop so a test can look at the engine's statistics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import json
import logging
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from aiohttp import ClientConnectionResetError, web
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from appliance.config import GatewayConfig, HttpConfig, ServerConfig
from appliance.engine.runner import EngineStats
from appliance.gateway.admission import GatedAdmission
from appliance.gateway.http_api import BODY_BUDGET
from appliance.gateway.json_body import INLINE_BYTES
from appliance.gateway.models import load_models
from appliance.gateway.server import RunningGateway, start_server
from appliance.security.secretfile import write_secret
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny, engine_to_stop
from tests.gateway.test_inprocess import RecordingSink
from tests.security.conftest import Keys
from tests.support import gateway_config, until_async, until_engine

LONG = "Tell me everything"
# Greedy decoding of LONG runs to max_tokens (a sampled answer may end early), and bypassing the
# cache keeps every such request at the engine.
BYPASS = {"appliance": {"cache_policy": "bypass"}}
LONG_ARGS: dict[str, Any] = dict(
    model="tiny", prompt=LONG, max_tokens=1500, temperature=0, extra_body=BYPASS
)


def _config(tiny: Tiny, backend: str | dict[str, str], **kw: Any) -> GatewayConfig:
    return gateway_config(
        tiny.tokenizer_dir,
        backend,
        server=ServerConfig(listen="127.0.0.1:0", access_log=False),
        http=HttpConfig(listen="127.0.0.1:0", max_body_bytes=64 * 1024, client_timeout_s=5.0),
        **kw,
    )


async def _gateway(config: GatewayConfig) -> RunningGateway:
    running = await start_server(config, await load_models(config))
    assert running.http is not None
    return running


@pytest.fixture
async def gateway(tiny: Tiny, engine: Engine) -> AsyncIterator[RunningGateway]:
    running = await _gateway(_config(tiny, engine.address))
    yield running
    await running.drain(0.5)


def _url(running: RunningGateway) -> str:
    assert running.http is not None
    return f"http://127.0.0.1:{running.http.port}"


def _client(running: RunningGateway) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=_url(running) + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
async def client(gateway: RunningGateway) -> AsyncIterator[AsyncOpenAI]:
    async with _client(gateway) as c:
        yield c


@pytest.fixture
async def stub(gateway: RunningGateway) -> AsyncIterator[pb_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield pb_grpc.InferenceStub(channel)


async def _post(running: RunningGateway, path: str, body: bytes) -> tuple[int, Any, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(_url(running) + path, data=body) as r,
    ):
        return r.status, r.headers, await r.json()


# -- answers -----------------------------------------------------------------------------------


def grpc_chat(chat: list[ChatCompletionMessageParam]) -> pb.ChatMessages:
    """The same turns as the gateway's gRPC messages; every content here is plain text."""
    turns = []
    for m in chat:
        content = m.get("content")
        assert isinstance(content, str), content
        turns.append(pb.ChatMessage(role=m["role"], content=content))
    return pb.ChatMessages(messages=turns)


async def test_chat_answers_and_a_cache_hit_matches_grpc(
    client: AsyncOpenAI, stub: pb_grpc.InferenceStub
) -> None:
    chat: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello?"},
    ]
    grpc_reply = await stub.Complete(
        pb.GenerateRequest(
            model="tiny",
            messages=grpc_chat(chat),
            max_tokens=12,
            temperature=0,
        )
    )
    reply = await client.chat.completions.create(
        model="tiny",
        messages=chat,
        max_tokens=12,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == grpc_reply.text
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None
    assert reply.usage.completion_tokens == grpc_reply.final.usage.completion_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    ext = (reply.model_extra or {})["appliance"]
    assert (ext["cache_tier"], ext["model"], ext["degraded"]) == ("l1", "tiny", False)
    assert reply.id == "chatcmpl-" + ext["request_id"]
    assert 0 < ext["timings"]["ttft_us"] <= ext["timings"]["total_us"]


async def test_chat_stream_with_usage_equals_the_whole_answer(client: AsyncOpenAI) -> None:
    args: dict[str, Any] = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Stream this"}],
        max_completion_tokens=20,
        temperature=0,
        extra_body={"appliance": {"cache_policy": "bypass"}},
    )
    whole = await client.chat.completions.create(**args)
    stream = await client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    assert finish[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert (finish[0].model_extra or {})["appliance"]["cache_tier"] == "miss"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1


async def test_completion_stream_and_whole(client: AsyncOpenAI) -> None:
    whole = await client.completions.create(
        model="tiny", prompt="The gateway streams", max_tokens=10, seed=7, temperature=0.8
    )
    assert whole.object == "text_completion" and whole.choices[0].text
    stream = await client.completions.create(
        model="tiny",
        prompt=["The gateway streams"],
        max_tokens=10,
        seed=7,
        temperature=0.8,
        stream=True,
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


async def test_stop_strings_and_extension_fields(client: AsyncOpenAI) -> None:
    base = await client.completions.create(model="tiny", prompt=LONG, max_tokens=30, temperature=0)
    text = base.choices[0].text
    stop = text[3:6]
    cut = await client.completions.create(
        model="tiny",
        prompt=LONG,
        max_tokens=30,
        temperature=0,
        stop=stop,
        extra_body={"appliance": {"namespace": "other", "top_k": 1, "request_id": "mine"}},
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.id == "cmpl-mine"
    only = await client.completions.create(
        model="tiny",
        prompt=LONG,
        max_tokens=30,
        temperature=0,
        extra_body={"appliance": {"cache_policy": "only"}},
    )
    assert only.choices[0].text == text
    assert (only.model_extra or {})["appliance"]["cache_tier"] == "l1"


async def test_models_and_health(client: AsyncOpenAI, gateway: RunningGateway) -> None:
    listed = [m.id async for m in client.models.list()]
    assert listed == ["tiny"]
    assert (await client.models.retrieve("tiny")).id == "tiny"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-9")
    async with aiohttp.ClientSession() as session:
        async with session.get(_url(gateway) + "/health") as r:
            assert (r.status, await r.json()) == (200, {"status": "SERVING"})
        async with session.get(_url(gateway) + "/health?model=tiny") as r:
            assert r.status == 200
        await gateway.health.enter_graceful_shutdown()  # what a draining gateway publishes
        async with session.get(_url(gateway) + "/health") as r:
            assert (r.status, await r.json()) == (503, {"status": "NOT_SERVING"})


async def test_a_model_named_with_a_slash_is_retrieved_by_its_raw_path(
    tiny: Tiny, engine: Engine
) -> None:
    """Hugging Face names hold a slash: the openai SDK 3.x sends it encoded (%2F), curl and the
    1.x SDK as it is; both are the model, not a route the server lacks."""
    name = "org/tiny"
    running = await _gateway(_config(tiny, {name: engine.address}))
    try:
        async with _client(running) as client:
            assert (await client.models.retrieve(name)).id == name
        async with aiohttp.ClientSession() as session:
            async with session.get(_url(running) + "/v1/models/" + name) as r:
                assert (r.status, (await r.json())["id"]) == (200, name)
            async with session.get(_url(running) + "/v1/models/org/other") as r:
                assert (r.status, (await r.json())["error"]["code"]) == (404, "model_not_found")
    finally:
        await running.drain(0.5)


# -- errors ------------------------------------------------------------------------------------

SAME_AS_GRPC: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"max_tokens": 0}, {"max_tokens": 0}),
    ({"max_tokens": 100000}, {"max_tokens": 100000}),
    ({"temperature": -0.5}, {"temperature": -0.5}),
    ({"temperature": 1e9}, {"temperature": 1e9}),
    ({"top_p": 1.5}, {"top_p": 1.5}),
    ({"stop": ["x"] * 20}, {"stop": ["x"] * 20}),
    ({"prompt": ""}, {"prompt": ""}),
    ({"prompt": "word " * 3000}, {"prompt": "word " * 3000}),
    ({"appliance": {"top_k": -1}}, {"top_k": -1}),
    ({"appliance": {"ttft_budget_ms": 0}}, {"ttft_budget_ms": 0}),
    ({"appliance": {"namespace": "n" * 100}}, {"namespace": "n" * 100}),
    ({"appliance": {"request_id": "has space"}}, {"request_id": "has space"}),
]
# The check stage's fields the body holds in its "appliance" object.
APPLIANCE_FIELDS = {"top_k", "ttft_budget_ms", "namespace", "request_id"}


@pytest.mark.parametrize(("body", "fields"), SAME_AS_GRPC)
async def test_invalid_fields_get_the_grpc_message(
    gateway: RunningGateway,
    stub: pb_grpc.InferenceStub,
    body: dict[str, Any],
    fields: dict[str, Any],
) -> None:
    fields = {"model": "tiny", "prompt": "hello", **fields}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(pb.GenerateRequest(**fields))
    async with _client(gateway) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(
                model="tiny",
                prompt=body.pop("prompt", "hello"),
                extra_body=body,  # sent as is, whatever the SDK's types allow
            )
    assert bad.value.status_code == 400
    too_long = "word " * 3000 in fields.values()
    # The check stage names every field it refuses (OpenAI's param): the prompt where no other.
    named = next((f for f in fields if f not in {"model", "prompt"}), "prompt")
    # `param` names the field in the body: the appliance's own are in its "appliance" object.
    param = f"appliance.{named}" if named in APPLIANCE_FIELDS else named
    assert bad.value.body == {
        "message": err.value.details(),
        "type": "invalid_request_error",
        "param": "prompt" if too_long else param,
        "code": "context_length_exceeded" if too_long else None,
    }


# A chat's length sent as `max_completion_tokens` (the SDK's current field, aiperf's default):
# each refusal of the length, and of what it bounds, names that field and never `max_tokens`.
MAX_COMPLETION_REFUSALS: list[tuple[dict[str, Any], str, str]] = [
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be >= 1"),
    (
        {"max_completion_tokens": 100000},
        "max_completion_tokens",
        "max_completion_tokens 100000 exceeds this model's limit",
    ),
    (
        {"max_completion_tokens": 4, "min_tokens": 8},
        "min_tokens",
        "min_tokens must be between 0 and max_completion_tokens (4)",
    ),
    (
        {"max_completion_tokens": 2000, "messages": [{"role": "user", "content": "word " * 300}]},
        "messages",
        "lower max_completion_tokens or shorten the prompt",
    ),
]


@pytest.mark.parametrize(("body", "param", "message"), MAX_COMPLETION_REFUSALS)
async def test_refusals_name_max_completion_tokens_when_sent(
    gateway: RunningGateway, body: dict[str, Any], param: str, message: str
) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    status, _, answer = await _post(gateway, "/v1/chat/completions", json.dumps(chat).encode())
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert message in answer["error"]["message"]
    assert "max_tokens" not in answer["error"]["message"]
    # The same refusal of a request that sent max_tokens names max_tokens, as the gRPC API does.
    chat["max_tokens"] = chat.pop("max_completion_tokens")
    status, _, answer = await _post(gateway, "/v1/chat/completions", json.dumps(chat).encode())
    assert status == 400, answer
    assert answer["error"]["param"] == param.replace("max_completion_tokens", "max_tokens")
    assert message.replace("max_completion_tokens", "max_tokens") in answer["error"]["message"]


async def test_unknown_model_and_chat_role(client: AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        await client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}]
        )
    assert isinstance(err.value.body, dict)
    assert err.value.body["message"] == "unknown model 'gpt-9'; known models: tiny"
    assert (err.value.body["param"], err.value.body["code"]) == ("model", "model_not_found")
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role is 'robot'"):
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "robot", "content": "hi"}],  # type: ignore[list-item,misc]
        )


TOO_MANY_MESSAGES = json.dumps({"model": "tiny", "messages": [{"role": "user"}] * 2049}).encode()
TOO_MANY_CALLS = json.dumps(
    {"model": "tiny", "messages": [{"role": "assistant", "tool_calls": [{}] * 1025}] * 2},
    separators=(",", ":"),
).encode()  # refused by their count, before one is read (each here is malformed)
REFUSED: list[tuple[bytes, str]] = [
    (b'{"model": "tiny", "messages": [], "temperature": 1' + b"0" * 400 + b"}", "out of range"),
    (b'{"model": "tiny", "messages": [], "top_p": 1' + b"0" * 400 + b"}", "top_p is out of range"),
    (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 2.5}',
        "temperature must be 0 (greedy) or between 0.01 and 2",
    ),
    (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "appliance": {"request_id": "a\\r\\nSet-Cookie: x"}}',
        "request_id must be 1 to 128 visible ASCII characters",
    ),
    (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "appliance": {"request_id": "a\\u001b[31m"}}',
        "request_id must be",
    ),
    (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "appliance": {"request_id": "caf\\u00e9"}}',
        "request_id must be",
    ),
    (TOO_MANY_MESSAGES, "messages holds 2049 messages; at most 2048 are accepted"),
    (TOO_MANY_CALLS, "messages hold 2050 tool calls; at most 2048 are accepted"),
    (b"{not json", "the request body is not valid JSON"),
    # Parsers disagree on which of two same-named fields wins: neither is guessed at.
    (b'{"model": "tiny", "model": "x", "messages": []}', 'names "model" twice in one object'),
    (
        b'{"model": "tiny", "messages": [{"role": "user", "role": "system", "content": "x"}]}',
        'names "role" twice in one object',
    ),
    (b"[1, 2]", "must be a JSON object, got an array"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[" * 50_000, "nested too deeply"),
    (b'{"model": "tiny", "max_tokens": ' + b"9" * 5000 + b"}", "of more than 4300 digits"),
    (b'{"model": "tiny"}', "messages is required"),
    (b'{"model": 5, "messages": []}', "model must be a string, got a number"),
    (b'{"model": "tiny", "messages": "hi"}', "messages must be an array, got a string"),
    (b'{"model": "tiny", "messages": [[]]}', "messages[0] must be an object"),
    (b'{"model": "tiny", "messages": [], "max_tokens": "5"}', "max_tokens must be an integer"),
    (b'{"model": "tiny", "messages": [], "max_tokens": 1e40}', "max_tokens must be between"),
    (b'{"model": "tiny", "messages": [], "max_tokens": 2.5}', "max_tokens must be an integer"),
    (b'{"model": "tiny", "messages": [], "seed": -1}', "seed must be between 0 and"),
    (b'{"model": "tiny", "messages": [], "temperature": true}', "temperature must be a number"),
    (b'{"model": "tiny", "messages": [], "stop": [1]}', "stop must be a string or a list"),
    (b'{"model": "tiny", "messages": [], "n": 2}', "n is not supported"),
    (b'{"model": "tiny", "messages": [], "n": true}', "n is not supported"),
    (b'{"model": "tiny", "messages": [], "presence_penalty": false}', "not supported"),
    (b'{"model": "tiny", "messages": [], "best_of": 2}', "best_of is not supported"),
    (b'{"model": "tiny", "messages": [], "bogus": 1}', "Unrecognized request argument"),
    # vLLM's top-level top_k (benchmarks' extra inputs) is the appliance object's here.
    (b'{"model": "tiny", "messages": [], "top_k": 1}', "send it as appliance.top_k"),
    (b'{"model": "tiny", "messages": [], "stream_options": {}}', "only allowed when stream"),
    (b'{"model": "tiny", "messages": [], "appliance": {"x": 1}}', "unknown field appliance.x"),
    (
        b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
        "only text parts are supported",
    ),
    (b'{"model": "tiny", "messages": [], "max_tokens": 1, "max_completion_tokens": 2}', "differ"),
    (b'{"model": "tiny", "messages": []}', "messages is empty: send at least one message"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "unpaired"),
    (b'{"model": "ti\\udfffny", "messages": []}', "unpaired surrogate '\\udfff'"),
    (b'{"model": "tiny", "messages": [], "\\ud800": 1}', "Unrecognized request argument"),
    # Python's json reads these; JSON has no such values (a strict proxy refuses the body).
    (b'{"model": "tiny", "messages": [], "metadata": {"a": NaN}}', "NaN is no JSON value"),
    (b'{"model": "tiny", "messages": [], "temperature": Infinity}', "Infinity is no JSON"),
    (b'{"model": "tiny", "messages": [], "top_p": -Infinity}', "-Infinity is no JSON value"),
]


@pytest.mark.parametrize(("body", "message"), REFUSED)
async def test_malformed_bodies_are_400_in_openai_shape(
    gateway: RunningGateway, body: bytes, message: str
) -> None:
    status, _, reply = await _post(gateway, "/v1/chat/completions", body)
    assert status == 400
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert message in reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"


def _nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize(
    "field",
    [
        b'"metadata":' + _nested(300),
        b'"metadata":' + _nested(900),
        b'"tools":[{"type":"function","function":{"name":"f","parameters":' + _nested(900) + b"}}]",
    ],
    ids=["ignored", "ignored-deeper", "tools"],
)
async def test_a_deeply_nested_body_is_400_decoded_inline_or_in_the_worker(
    tiny: Tiny, engine: Engine, field: bytes
) -> None:
    """A body past INLINE_BYTES is decoded in a worker process, whose stack is shallow: nesting
    that decodes there failed as its result was pickled back, or as the gateway wrote a schema
    out (RecursionError: 500). Both paths refuse the same nesting, before anything reads it."""
    config = _config(tiny, engine.address)
    config = dataclasses.replace(
        config, http=dataclasses.replace(config.http, max_body_bytes=4 * INLINE_BYTES)
    )
    running = await _gateway(config)
    try:
        head = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
        for pad in (b"", b'"user": "' + b"u" * INLINE_BYTES + b'", '):
            body = head + pad + field + b"}"
            status, _, reply = await _post(running, "/v1/chat/completions", body)
            assert status == 400, reply
            assert "nested too deeply" in reply["error"]["message"]
    finally:
        await running.drain(0.1)


async def test_huge_body_is_413_and_unknown_routes_404(gateway: RunningGateway) -> None:
    body = json.dumps({"model": "tiny", "prompt": "x" * 100_000}).encode()
    status, _, reply = await _post(gateway, "/v1/completions", body)
    assert status == 413 and "larger than 65536 bytes" in reply["error"]["message"]
    # The limit holds for the decompressed body: 20 MB of gzip-compressed text is 19 KB.
    bomb = gzip.compress(b'{"model": "tiny", "prompt": "' + b"x" * 20_000_000 + b'"}')
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            _url(gateway) + "/v1/completions", data=bomb, headers={"Content-Encoding": "gzip"}
        ) as r,
    ):
        assert r.status == 413
    status, _, reply = await _post(gateway, "/v1/embeddings", b"{}")
    assert status == 404 and "POST /v1/chat/completions" in reply["error"]["message"]
    async with (
        aiohttp.ClientSession() as session,
        session.get(_url(gateway) + "/v1/completions") as r,
    ):
        assert r.status == 405 and "error" in await r.json()
        assert r.headers["Allow"] == "POST"  # a 405 names the methods the route takes


# Requests aiohttp's parser refuses before any handler runs, each with bytes it used to echo.
UNPARSED: list[tuple[bytes, str]] = [
    (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Secret: "
        + b"s3cret" * 2000
        + b"\r\nContent-Length: 2\r\n\r\n{}",
        "its URL or a header line is too long",
    ),
    (
        b"GET /v1/models/" + b"s3cret" * 2000 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n",
        "its URL or a header line is too long",
    ),
    (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\ns3cret\r\n",
        "Transfer-Encoding or chunks",
    ),
    (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: s3cret\r\n\r\n",
        "not valid HTTP/1.1",
    ),
    (b"S3CRET /v1/completions HTTP/1.1\r\nHost: localhost\r\n\r\n", "its method is not one"),
    (
        b"POST /v1/completions HTTP/1.0\r\nHost: localhost\r\n\r\n" + b'{"s3cret": 1}',
        "it is not valid HTTP/1.1",
    ),
]


@pytest.mark.parametrize(
    ("request_bytes", "message"),
    UNPARSED,
    ids=["long-header", "long-url", "bad-chunk", "bad-length", "bad-method", "after-close"],
)
async def test_a_request_the_http_parser_refuses_is_answered_in_openai_shape(
    gateway: RunningGateway, request_bytes: bytes, message: str
) -> None:
    assert gateway.http is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.http.port)
    writer.write(request_bytes)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)  # the connection is closed after it
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0]
    assert b"Content-Type: application/json" in head
    error = json.loads(body)["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"
    assert b"s3cret" not in answer.lower()  # nothing the client sent comes back


async def test_overload_is_429_with_retry_after(tiny: Tiny, engine: Engine) -> None:
    running = await _gateway(_config(tiny, engine.address, max_queue=0))
    try:
        async with _client(running) as client:
            busy = await client.completions.create(**LONG_ARGS, stream=True)
            await anext(aiter(busy))  # the only slot is generating
            with pytest.raises(openai.RateLimitError) as err:
                await client.completions.create(model="tiny", prompt="me too", max_tokens=4)
            headers = err.value.response.headers
            assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1
            assert isinstance(err.value.body, dict)
            assert err.value.body["type"] == "rate_limit_error"
            await busy.close()
    finally:
        await running.drain(0.5)


async def test_deadline_is_504(client: AsyncOpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        await client.completions.create(
            model="tiny",
            prompt=LONG,
            max_tokens=1500,
            temperature=0,
            extra_body={"appliance": {"deadline_ms": 50, "cache_policy": "bypass"}},
        )
    assert err.value.status_code == 504
    assert isinstance(err.value.body, dict) and err.value.body["type"] == "timeout_error"
    assert "deadline" in err.value.body["message"]


async def test_engine_down_is_503(tiny: Tiny, engine_repo: Path) -> None:
    address, stop_engine = await engine_to_stop(engine_repo)
    running = await _gateway(_config(tiny, address))
    try:
        await stop_engine()
        async with _client(running) as client:
            with pytest.raises(openai.InternalServerError) as err:
                await client.completions.create(model="tiny", prompt="hi", max_tokens=4)
        assert err.value.status_code == 503
        assert f"inference server at {address}" in str(err.value.body)
    finally:
        await running.drain(0.1)


# -- cancellation and draining -----------------------------------------------------------------


async def test_client_disconnect_mid_stream_cancels_the_engine_request(
    engine: Engine, gateway: RunningGateway
) -> None:
    stats: EngineStats = engine.models["tensorrt_llm"].runner.stats
    cancelled, tokens = stats.cancelled, stats.tokens_generated
    async with _client(gateway) as client:
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": LONG}],
            max_tokens=1500,
            temperature=0,
            stream=True,
            extra_body=BYPASS,
        )
        seen = 0
        async for chunk in stream:
            seen += bool(chunk.choices and chunk.choices[0].delta.content)
            if seen >= 3:
                break
        await stream.close()
    await until_engine(stats, lambda: stats.cancelled > cancelled and stats.running is None)
    assert stats.tokens_generated - tokens < 1500


async def test_a_write_to_a_client_gone_ends_the_stream_as_a_disconnect(
    tiny: Tiny, engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that disconnects as a token arrives: the handler writes before its cancellation
    is delivered, and aiohttp refuses the write to the closing transport. That is the client
    gone, as a cancelled handler is (the engine request cancelled, reported CANCELLED), not a
    failure of the server's logged as one."""
    written = 0
    write = web.StreamResponse.write

    async def closing(response: web.StreamResponse, data: bytes) -> None:
        nonlocal written
        written += 1
        if written == 3:
            raise ClientConnectionResetError("Cannot write to closing transport")
        await write(response, data)

    monkeypatch.setattr(web.StreamResponse, "write", closing)
    sink = RecordingSink()
    config = _config(tiny, engine.address)
    running = await start_server(config, await load_models(config), sink)
    stats: EngineStats = engine.models["tensorrt_llm"].runner.stats
    cancelled = stats.cancelled
    try:
        body = {**LONG_ARGS, "stream": True, "appliance": {"cache_policy": "bypass"}}
        del body["extra_body"]
        async with (
            aiohttp.ClientSession() as session,
            session.post(_url(running) + "/v1/completions", json=body) as r,
        ):
            assert r.status == 200
            with contextlib.suppress(aiohttp.ClientPayloadError):  # what it got is no matter
                await r.read()
        (report,) = await sink.wait_for(1)
        await until_engine(stats, lambda: stats.cancelled > cancelled and stats.running is None)
    finally:
        await running.drain(0.5)
    assert report.status == "CANCELLED"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_disconnect_while_queued_leaves_the_line(tiny: Tiny, engine: Engine) -> None:
    running = await _gateway(_config(tiny, engine.address))
    try:
        async with _client(running) as client:
            busy = await client.completions.create(**LONG_ARGS, stream=True)
            await anext(aiter(busy))
            waiting = asyncio.ensure_future(
                client.completions.create(model="tiny", prompt="queued", max_tokens=4)
            )
            await until_async(lambda: _waiting(running) == 1, "the request never queued", 10.0)
            waiting.cancel()
            await until_async(lambda: _waiting(running) == 0, "the queue never emptied", 10.0)
            await busy.close()
    finally:
        await running.drain(0.5)


def _waiting(running: RunningGateway) -> int:
    admission = running.pipeline.admission
    assert isinstance(admission, GatedAdmission)
    return len(admission.gates["tiny"].waiting)


async def test_drain_ends_an_http_stream_as_aborted(tiny: Tiny, engine: Engine) -> None:
    running = await _gateway(_config(tiny, engine.address))
    async with _client(running) as client:
        stream = await client.completions.create(**LONG_ARGS, stream=True)
        chunks = [await anext(aiter(stream))]
        drained = asyncio.ensure_future(running.drain(0.2))
        chunks += [c async for c in stream]
        await drained
    # vLLM's and SGLang's finish reason for a generation the server ended ("cancelled" over gRPC).
    assert chunks[-1].choices[0].finish_reason == "abort"


async def test_slow_and_silent_clients_are_cut_off(tiny: Tiny, engine: Engine) -> None:
    config = _config(tiny, engine.address)
    config = dataclasses.replace(
        config, http=dataclasses.replace(config.http, client_timeout_s=0.3)
    )
    running = await _gateway(config)
    assert running.http is not None
    try:
        # A body that never completes: 408 in OpenAI's shape, and nothing reaches the pipeline.
        reader, writer = await asyncio.open_connection("127.0.0.1", running.http.port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model"'
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 408 ")
        writer.close()
        # A connection that never sends a complete request head is closed.
        reader, writer = await asyncio.open_connection("127.0.0.1", running.http.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        assert running.pipeline.in_flight == {"tiny": 0}
    finally:
        await running.drain(0.5)


async def test_an_error_after_the_stream_began_is_an_event_the_sdk_raises(
    client: AsyncOpenAI,
) -> None:
    stream = await client.completions.create(
        model="tiny",
        prompt=LONG,
        max_tokens=1500,
        temperature=0,
        stream=True,
        extra_body={"appliance": {"deadline_ms": 300, "cache_policy": "bypass"}},
    )
    texts: list[str] = []
    with pytest.raises(openai.APIError, match="deadline") as err:
        async for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts  # the stream had begun: the status line said 200
    assert isinstance(err.value.body, dict) and err.value.body["type"] == "timeout_error"


async def test_a_stream_that_ends_in_an_error_still_ends_with_done(
    gateway: RunningGateway,
) -> None:
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 1500, "temperature": 0, "stream": True}
    body["appliance"] = {"deadline_ms": 300, "cache_policy": "bypass"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(_url(gateway) + "/v1/completions", json=body) as r,
    ):
        assert r.status == 200
        events = (await r.text()).split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert json.loads(events[-3].removeprefix("data: "))["error"]["type"] == "timeout_error"


async def test_http_requests_are_reported_like_grpc_ones(tiny: Tiny, engine: Engine) -> None:
    sink = RecordingSink()
    config = _config(tiny, engine.address)
    running = await start_server(config, await load_models(config), sink)
    try:
        body = {"model": "tiny", "prompt": "Report me", "max_tokens": 4, "temperature": 0}
        body["appliance"] = {"request_id": "h1"}
        status, headers, reply = await _post(running, "/v1/completions", json.dumps(body).encode())
        assert status == 200 and headers["X-Request-Id"] == "h1" and reply["id"] == "cmpl-h1"
        status, _, _ = await _post(running, "/v1/completions", b"{oops")
        assert status == 400
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            await pb_grpc.InferenceStub(channel).Complete(
                pb.GenerateRequest(model="tiny", prompt="Report me", max_tokens=4, request_id="g1")
            )
        good, bad, via_grpc = await sink.wait_for(3)
    finally:
        await running.drain(0.5)
    assert (good.request_id, good.model, good.status, good.tier) == ("h1", "tiny", "OK", "miss")
    assert good.completion_tokens == reply["usage"]["completion_tokens"]
    assert (bad.model, bad.status) == ("unknown", "INVALID_ARGUMENT")
    assert (good.front_end, bad.front_end) == ("http", "http")
    assert (via_grpc.request_id, via_grpc.front_end) == ("g1", "grpc")


@pytest.mark.parametrize(
    ("encoding", "status"),
    [("gzip", 400), ("deflate", 400), ("br", 415), ("zstd", 415), ("x-unknown", 415)],
)
async def test_a_body_not_in_its_content_encoding_or_in_another_is_refused_in_json(
    gateway: RunningGateway, encoding: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    body = b'{"model": "tiny", "prompt": "plain text, not compressed"}'
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            _url(gateway) + "/v1/completions", data=body, headers={"Content-Encoding": encoding}
        ) as r,
    ):
        assert r.status == status, await r.text()
        assert "Content-Encoding" in (await r.json())["error"]["message"]
    assert "plain text" not in caplog.text


async def test_a_gzip_body_of_many_members_is_refused_before_it_is_inflated(
    gateway: RunningGateway,
) -> None:
    """Each member costs a pass over the rest of the body: 4 MiB of empty members held the event
    loop for 30 s. A body of more members than a client splits one into is refused."""
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode()
    members = gzip.compress(b"") * 1000 + gzip.compress(body)
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            _url(gateway) + "/v1/completions", data=members, headers={"Content-Encoding": "gzip"}
        ) as r,
    ):
        reply = await r.json()
    assert r.status == 400, reply
    assert "more than 16 gzip members" in reply["error"]["message"]


async def _head(port: int, request: bytes) -> bytes:
    """The status line of the first response to `request`, sent as is over a new connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return (await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)).rstrip()
    finally:
        writer.close()


async def test_a_body_declared_too_large_is_413_before_it_is_sent(
    tiny: Tiny, engine: Engine, tmp_path: Path
) -> None:
    write_secret(tmp_path / "pepper")
    keys = Keys(tmp_path / "keys.json", tmp_path / "pepper")
    token = keys.add(["*"], ["generate"])
    running = await _gateway(_config(tiny, engine.address, auth=keys.auth()))
    assert running.http is not None
    port = running.http.port
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    key = f"Authorization: Bearer {token}\r\n".encode()
    try:
        # Refused by its Content-Length alone, not after client_timeout_s waiting for its bytes.
        assert await _head(port, head + key + b"Content-Length: 1000000000\r\n\r\n") == (
            b"HTTP/1.1 413 Request Entity Too Large"
        )
        # A client that waits for 100 Continue is not asked for a body the gateway will refuse
        # (too large, or without a valid key), and is for one it will read.
        expect = head + b"Expect: 100-continue\r\n"
        assert await _head(port, expect + key + b"Content-Length: 1000000000\r\n\r\n") == (
            b"HTTP/1.1 413 Request Entity Too Large"
        )
        assert await _head(port, expect + b"Content-Length: 10\r\n\r\n") == (
            b"HTTP/1.1 401 Unauthorized"
        )
        assert await _head(port, expect + key + b"Content-Length: 10\r\n\r\n") == (
            b"HTTP/1.1 100 Continue"
        )
    finally:
        await running.drain(0.5)


async def test_bodies_being_read_are_bounded_in_bytes(gateway: RunningGateway) -> None:
    """Each body being read is held whole: clients that each start one (up to max_body_bytes)
    and send it slowly could hold any amount of memory. Past BODY_BUDGET bodies of the largest
    size, the next is refused at once as an overload; the reads already started go on."""
    http = gateway.http
    assert http is not None
    port, limit = http.port, http.config.max_body_bytes
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n"
    held = []
    try:
        # All of the budget but 1,000 bytes, in bodies that have begun to arrive.
        for size in [limit] * (BODY_BUDGET - 1) + [limit - 1000]:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head % size + b"{")
            held.append(writer)
        await until_async(lambda: http.reading == BODY_BUDGET * limit - 1000)
        assert await _head(port, head % limit) == b"HTTP/1.1 429 Too Many Requests"
        # A small body still fits beside them: the budget is bytes, not requests.
        small = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
        status, _, _ = await _post(gateway, "/v1/completions", small)
        assert status == 200
    finally:
        for writer in held:
            writer.close()
    await until_async(lambda: http.reading == 0)


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("application/x-www-form-urlencoded", 415),  # what `curl -d` sends without -H
        ("multipart/form-data; boundary=x", 415),
        ("text/plain;charset=UTF-8", 415),  # what a browser's fetch of a string body sends
        ("application/json; charset=utf-8", 200),
        ("application/vnd.api+json", 200),
        ("application/octet-stream", 200),
        (None, 200),
    ],
)
async def test_a_body_declared_as_a_form_or_text_is_415(
    gateway: RunningGateway, content_type: str | None, status: int
) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    headers = {} if content_type is None else {"Content-Type": content_type}
    async with (
        aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as session,
        session.post(_url(gateway) + "/v1/completions", data=body, headers=headers) as r,
    ):
        reply = await r.json()
    assert r.status == status, reply
    if status == 415:
        assert (
            "send the body as JSON with Content-Type: application/json"
            in (reply["error"]["message"])
        )


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),  # as HTTP defines deflate: zlib-wrapped
        ("deflate", lambda b: zlib.compress(b, wbits=-zlib.MAX_WBITS)),  # raw, as some send it
        ("gzip", lambda b: gzip.compress(b[:9]) + gzip.compress(b[9:])),  # two members
    ],
    ids=["gzip", "deflate", "raw-deflate", "gzip-members"],
)
async def test_a_compressed_body_is_inflated(
    gateway: RunningGateway, encoding: str, compress: Callable[[bytes], bytes]
) -> None:
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            _url(gateway) + "/v1/completions",
            data=compress(body),
            headers={"Content-Encoding": encoding},
        ) as r,
    ):
        assert r.status == 200, await r.text()
        assert (await r.json())["usage"]["completion_tokens"] > 0


async def test_openai_error_codes_name_the_field_and_the_reason(gateway: RunningGateway) -> None:
    too_long = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 3000}]}
    status, _, reply = await _post(gateway, "/v1/chat/completions", json.dumps(too_long).encode())
    assert status == 400
    assert (reply["error"]["code"], reply["error"]["param"]) == (
        "context_length_exceeded",
        "messages",
    )
    prompt = {"model": "tiny", "prompt": "x" * 60_000}
    status, _, reply = await _post(gateway, "/v1/completions", json.dumps(prompt).encode())
    assert (status, reply["error"]["code"], reply["error"]["param"]) == (
        400,
        "context_length_exceeded",
        "prompt",
    )
    # An unknown model is the same error on every endpoint.
    unknown = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    _, _, generating = await _post(gateway, "/v1/chat/completions", json.dumps(unknown).encode())
    async with (
        aiohttp.ClientSession() as session,
        session.get(_url(gateway) + "/v1/models/gpt-9") as r,
    ):
        listing = await r.json()
        assert r.status == 404
    for reply in (generating, listing):
        error = reply["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error",
            "model_not_found",
            "model",
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("top_p", 0),
        ("max_tokens", 100_000),
        ("stop", ["s"] * 17),
        ("messages", [{"role": "assistant", "content": "last"}]),
    ],
)
async def test_a_refused_value_names_its_field_as_param(
    gateway: RunningGateway, field: str, value: object
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], field: value}
    status, _, reply = await _post(gateway, "/v1/chat/completions", json.dumps(body).encode())
    assert (status, reply["error"]["param"]) == (400, field), reply


async def test_the_clients_x_request_id_is_the_request_id_when_usable(
    gateway: RunningGateway,
) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    for sent, used in (("trace-42.a:b", True), ("has space", False), ("é", False)):
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                _url(gateway) + "/v1/completions", data=body, headers={"X-Request-Id": sent}
            ) as r,
        ):
            reply = await r.json()
            assert r.status == 200
            assert (r.headers["X-Request-Id"] == sent) is used
            assert (reply["appliance"]["request_id"] == sent) is used


async def test_the_sdks_fields_that_change_no_answer_are_accepted(client: AsyncOpenAI) -> None:
    """The SDK's successors of `user` and its stream option for padding, which change no answer."""
    await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=2,
        safety_identifier="user-7",
        prompt_cache_key="shared-prefix",
    )
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=2,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("user", 5),
        ("safety_identifier", ["x"]),
        ("prompt_cache_key", {}),
        ("metadata", "x"),
        ("store", "no"),
        ("service_tier", 1),
    ],
)
async def test_an_ignored_field_of_the_wrong_type_is_refused(
    gateway: RunningGateway, field: str, value: object
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], field: value}
    status, _, reply = await _post(gateway, "/v1/chat/completions", json.dumps(body).encode())
    assert (status, reply["error"]["param"]) == (400, field), reply
    assert reply["error"]["message"].startswith(f"{field} must be")


async def test_response_format_text_is_free_text(gateway: RunningGateway) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "response_format": {"type": "text"}}
    status, _, _ = await _post(gateway, "/v1/completions", json.dumps(body).encode())
    assert status == 200


BAD_GUIDES: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "xml"}}, "response_format.type 'xml' is not one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema is required"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
        "the JSON Schema is not valid at type: 5 is not valid",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": [], "x": 1}}},
        "unknown field response_format.json_schema.x",
    ),
    ({"appliance": {"guide": {"type": "regex", "guide": "a(b"}}}, "not a valid regular expression"),
    ({"appliance": {"guide": {"type": "lark"}}}, "appliance.guide.type 'lark' is not one of"),
    ({"appliance": {"guide": {"type": "ebnf_grammar"}}}, "the ebnf_grammar guide needs its text"),
    ({"appliance": {"guide": {"type": "regex", "guide": "x" * 70_000}}}, "longer than 65536"),
    (
        {"response_format": {"type": "json_object"}, "appliance": {"guide": {"type": "json"}}},
        "send response_format or appliance.guide, not both",
    ),
]


@pytest.mark.parametrize(("fields", "message"), BAD_GUIDES)
async def test_a_bad_guide_is_400_before_the_engine(
    tiny: Tiny, engine: Engine, fields: dict[str, Any], message: str
) -> None:
    config = _config(tiny, engine.address)
    config = dataclasses.replace(
        config, http=dataclasses.replace(config.http, max_body_bytes=1 << 20)
    )
    running = await _gateway(config)
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}
        before = engine.stats().started
        status, _, reply = await _post(running, "/v1/completions", json.dumps(body).encode())
        assert status == 400, reply
        assert message in reply["error"]["message"]
        # `param` is the field the guide came from.
        sent = "response_format" if "response_format" in fields else "appliance.guide"
        assert reply["error"]["param"].startswith(sent)
        assert engine.stats().started == before
    finally:
        await running.drain(0.5)
