"""Calls of the gRPC port that do not send their request message, against a gateway with keys: a
caller without a valid key (or over its rate) is refused from its metadata alone, before anything
of its message is read, so its stream is closed and holds nothing; a caller with one is served as
before, whenever its message comes; health, open to probes, waits a bounded time for its message."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from appliance.gateway import health as gateway_health
from appliance.gateway import server as gateway_server
from appliance.gateway.server import MAX_STREAMS_PER_CONNECTION, RunningGateway
from appliance.grpc_limits import MAX_REQUEST_BYTES
from appliance.security.api_keys import RateLimits
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny
from tests.gateway.hostile_client import HTTP2_PREFACE, _frame, _literal
from tests.security.conftest import Keys, bearer, running
from tests.security.conftest import keys as keys  # the fixture
from tests.support import gateway_config, until_async

# A wait that only a hang reaches: a refusal comes in milliseconds.
ANSWER_S = 30.0
COMPLETE = "/appliance.v1.Inference/Complete"
GENERATE = "/appliance.v1.Inference/Generate"
INVALIDATE = "/appliance.v1.CacheAdmin/Invalidate"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"


@pytest.fixture
async def gateway(tiny: Tiny, engine: Engine, keys: Keys) -> AsyncIterator[RunningGateway]:
    keys.add(["t"], ["generate"])  # a keys file with a key in it: every call needs one
    async with running(gateway_config(tiny.tokenizer_dir, engine.address, auth=keys.auth())) as gw:
        yield gw


def _channel(gw: RunningGateway) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}")


def _request(**kw: Any) -> pb.GenerateRequest:
    fields: dict[str, Any] = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "namespace": "t"}
    return pb.GenerateRequest(**(fields | kw))


async def _never(unblock: asyncio.Event) -> AsyncIterator[Any]:
    """A request stream whose message never comes (until the test ends it)."""
    await unblock.wait()
    return
    yield


async def _then(unblock: asyncio.Event, *messages: Any) -> AsyncIterator[Any]:
    """A request stream that sends its messages once `unblock` is set."""
    await unblock.wait()
    for message in messages:
        yield message


def _multicallable(channel: grpc.aio.Channel, path: str) -> Any:
    """A request-streaming call of `path` (the server cannot tell it from a unary call)."""
    serializer: Callable[[Any], bytes] = bytes
    if path in (COMPLETE, INVALIDATE):
        de = (pb.CompleteResponse if path == COMPLETE else pb.InvalidateResponse).FromString
        return channel.stream_unary(path, request_serializer=serializer, response_deserializer=de)
    de = {
        GENERATE: pb.GenerateResponse,
        REFLECTION: reflection_pb2.ServerReflectionResponse,
        HEALTH_WATCH: health_pb2.HealthCheckResponse,
        HEALTH_CHECK: health_pb2.HealthCheckResponse,
    }[path].FromString
    if path == HEALTH_CHECK:
        return channel.stream_unary(path, request_serializer=serializer, response_deserializer=de)
    return channel.stream_stream(path, request_serializer=serializer, response_deserializer=de)


def _serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


async def _status(call: Any) -> tuple[grpc.StatusCode, str]:
    code = await asyncio.wait_for(call.code(), ANSWER_S)
    return code, await call.details()


@pytest.mark.parametrize("path", [COMPLETE, GENERATE, INVALIDATE, REFLECTION])
async def test_a_call_without_a_valid_key_is_refused_before_its_message(
    gateway: RunningGateway, path: str
) -> None:
    """Every method of the appliance's services, and server reflection: UNAUTHENTICATED while
    the message has not come (before, the call waited for it, holding what had come of it)."""
    unblock = asyncio.Event()
    async with _channel(gateway) as channel:
        call = _multicallable(channel, path)
        for metadata in ((), bearer("ak_000000000000_not-a-key")):
            refused = call(_never(unblock), metadata=metadata, timeout=2 * ANSWER_S)
            code, details = await _status(refused)
            assert code == grpc.StatusCode.UNAUTHENTICATED, details
        unblock.set()


async def test_a_key_over_its_rate_is_refused_before_its_message(
    gateway: RunningGateway, keys: Keys
) -> None:
    slow = keys.add(["t"], ["generate"], limits=RateLimits(rate_per_s=0.01, burst=1))
    assert gateway.access is not None and gateway.access.keys is not None
    gateway.access.keys.reload()
    unblock = asyncio.Event()
    async with _channel(gateway) as channel:
        await pb_grpc.InferenceStub(channel).Complete(_request(), metadata=bearer(slow))
        call = _multicallable(channel, COMPLETE)(
            _never(unblock), metadata=bearer(slow), timeout=2 * ANSWER_S
        )
        code, details = await _status(call)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert int(dict(await call.trailing_metadata())["grpc-retry-pushback-ms"]) > 0
        unblock.set()


async def test_a_caller_with_a_key_is_served_whenever_its_message_comes(
    gateway: RunningGateway, keys: Keys
) -> None:
    """The same call shape with a key: its message read once the call is let through; a call
    that ends its requests without one is INVALID_ARGUMENT; a second message is never read (as
    grpc's own unary handling does)."""
    token = keys.add(["t"], ["generate", "admin"])
    assert gateway.access is not None and gateway.access.keys is not None
    gateway.access.keys.reload()
    async with _channel(gateway) as channel:
        complete = _multicallable(channel, COMPLETE)
        unblock = asyncio.Event()
        call = complete(
            _then(unblock, _serialize(_request())), metadata=bearer(token), timeout=ANSWER_S
        )
        unblock.set()
        reply = await asyncio.wait_for(call, ANSWER_S)
        assert reply.final.finish_reason
        generate = _multicallable(channel, GENERATE)
        unblock = asyncio.Event()
        stream = generate(
            _then(unblock, _serialize(_request())), metadata=bearer(token), timeout=ANSWER_S
        )
        unblock.set()
        replies = [r async for r in stream]
        assert replies[-1].HasField("final"), replies
        two = complete(
            _then(unblock, _serialize(_request(max_tokens=2)), b"\xff"),
            metadata=bearer(token),
            timeout=ANSWER_S,
        )
        assert (await asyncio.wait_for(two, ANSWER_S)).final.usage.completion_tokens == 2
        for path in (COMPLETE, GENERATE, INVALIDATE):
            none = _multicallable(channel, path)(
                _then(unblock), metadata=bearer(token), timeout=ANSWER_S
            )
            code, details = await _status(none)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, details)
            assert "without a request message" in details, details
        # Reflection with the key, as grpcurl -H sends it.
        info = _multicallable(channel, REFLECTION)(
            iter([_serialize(reflection_pb2.ServerReflectionRequest(list_services=""))]),
            metadata=bearer(token),
            timeout=ANSWER_S,
        )
        names = [s.name async for r in info for s in r.list_services_response.service]
        assert "appliance.v1.Inference" in names


async def test_an_oversized_message_is_unauthenticated_without_a_key(
    gateway: RunningGateway, keys: Keys
) -> None:
    """The key is checked before the message is read: over the receive limit, a caller without a
    key hears that it needs one; a caller with one, gRPC's RESOURCE_EXHAUSTED."""
    token = keys.add(["t"], ["generate"])
    assert gateway.access is not None and gateway.access.keys is not None
    gateway.access.keys.reload()
    large = _request(prompt="x" * (MAX_REQUEST_BYTES + 1))
    async with _channel(gateway) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for metadata, status in (
            ((), grpc.StatusCode.UNAUTHENTICATED),
            (bearer(token), grpc.StatusCode.RESOURCE_EXHAUSTED),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Complete(large, metadata=metadata, timeout=ANSWER_S)
            assert err.value.code() == status, err.value.details()


async def _frames(reader: asyncio.StreamReader) -> AsyncIterator[tuple[int, int, bytes]]:
    """The server's frames as (type, stream id, payload), until it closes the connection."""
    while header := await asyncio.wait_for(reader.read(9), ANSWER_S):
        header += await asyncio.wait_for(reader.readexactly(9 - len(header)), ANSWER_S)
        length, kind = int.from_bytes(header[:3], "big"), header[3]
        stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
        yield kind, stream, await asyncio.wait_for(reader.readexactly(length), ANSWER_S)


def _headers(path: str) -> bytes:
    return b"".join(
        [
            b"\x83\x86",  # :method POST, :scheme http
            _literal(b":path", path.encode()),
            _literal(b":authority", b"localhost"),
            _literal(b"content-type", b"application/grpc"),
            _literal(b"te", b"trailers"),
        ]
    )


async def test_no_stream_of_a_caller_without_a_key_stays_open(gateway: RunningGateway) -> None:
    """A connection's every stream, each a Complete whose first bytes announce a message of the
    whole receive limit and that sends 512 bytes of it (all of them within HTTP/2's first 64 KiB
    connection window): the gateway ends each one UNAUTHENTICATED, so none holds what it was or
    will be sent. Before, every one stayed open, its window open to the 4 MiB announced."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    prefix = b"\x00" + struct.pack(">I", MAX_REQUEST_BYTES)
    streams = range(1, 2 * MAX_STREAMS_PER_CONNECTION, 2)
    writer.write(HTTP2_PREFACE + _frame(0x4, 0, 0, b""))
    for stream in streams:
        writer.write(_frame(0x1, 0x4, stream, _headers(COMPLETE)))
        writer.write(_frame(0x0, 0, stream, prefix + b"x" * 512))
    await writer.drain()
    ended: dict[int, bytes] = {}
    async for kind, stream, payload in _frames(reader):
        if kind == 0x4 and payload:
            writer.write(_frame(0x4, 0x1, 0, b""))  # the SETTINGS ack
        if kind in (0x1, 0x3) and stream in streams:  # trailers (or a reset) end the stream
            ended[stream] = ended.get(stream, b"") + payload
            if len(ended) == len(streams):
                break
    writer.close()
    assert sorted(ended) == list(streams)
    # Trailers-only, HPACK-indexed after the first: each carries the status.
    assert b"grpc-status" in ended[1] and b"16" in ended[1], ended[1]


@pytest.mark.parametrize("path", [HEALTH_CHECK, HEALTH_WATCH])
async def test_health_waits_a_bounded_time_for_its_message(
    gateway: RunningGateway, path: str
) -> None:
    """Health stays open without a key, and its message is read before anything is known of the
    caller: a call whose message has not come by HEALTH_READ_S ends (before, it waited for it for
    as long as the client kept the call open)."""
    assert gateway_server.HEALTH_READ_S < ANSWER_S
    unblock = asyncio.Event()
    async with _channel(gateway) as channel:
        call = _multicallable(channel, path)
        check = _serialize(health_pb2.HealthCheckRequest())
        if path == HEALTH_CHECK:
            reply = await call(iter([check]), timeout=ANSWER_S)
        else:
            answered = call(iter([check]), timeout=ANSWER_S)
            reply = await answered.read()
            answered.cancel()
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        code, details = await _status(call(_never(unblock), timeout=2 * ANSWER_S))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
        assert "did not arrive" in details, details
        unblock.set()


async def test_one_connection_holds_a_bounded_number_of_health_watches(
    gateway: RunningGateway,
) -> None:
    """An open Watch's stream can take up to the receive limit of bytes nothing reads, and health
    answers callers without a key: a connection gets MAX_WATCHES_PER_CONNECTION of them at once,
    another connection its own, and an ended one frees its place."""
    bound = gateway_health.MAX_WATCHES_PER_CONNECTION
    watch = health_pb2_grpc.HealthStub

    async def opened(stub: Any) -> Any:
        call = stub.Watch(health_pb2.HealthCheckRequest(), timeout=ANSWER_S)
        reply = await asyncio.wait_for(call.read(), ANSWER_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        return call

    # A channel of its own subchannel pool: its own connection (channels to one target share one).
    own = [("grpc.use_local_subchannel_pool", 1)]
    async with (
        _channel(gateway) as channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}", options=own) as other,
    ):
        stub = watch(channel)
        calls = [await opened(stub) for _ in range(bound)]
        refused = stub.Watch(health_pb2.HealthCheckRequest(), timeout=ANSWER_S)
        code, details = await _status(refused)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert f"at most {bound} health Watch calls" in details, details
        calls.append(await opened(watch(other)))  # another connection: its own count
        calls.pop(0).cancel()
        replaced = await until_async(lambda: _watch_opens(stub))
        calls.append(replaced)
        for call in calls:
            call.cancel()


async def _watch_opens(stub: Any) -> Any:
    """A Watch call on `stub`'s connection that got its first answer, else None."""
    call = stub.Watch(health_pb2.HealthCheckRequest(), timeout=ANSWER_S)
    try:
        await asyncio.wait_for(call.read(), ANSWER_S)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        return None
    return call


async def test_a_call_let_through_frees_its_stream_when_no_message_comes(
    gateway: RunningGateway, keys: Keys
) -> None:
    """The gate counts a key's call among its open ones before the message is read: one that
    ends without a message, or is cancelled waiting for it, no longer counts."""
    token = keys.add(["t"], ["generate"], limits=RateLimits(rate_per_s=1000.0, max_streams=1))
    assert gateway.access is not None and gateway.access.keys is not None
    gateway.access.keys.reload()
    principal = gateway.access.keys.by_token(token)
    assert principal is not None
    limiter = gateway.access.limiter
    unblock = asyncio.Event()
    async with _channel(gateway) as channel:
        complete = _multicallable(channel, COMPLETE)
        waiting = complete(_never(unblock), metadata=bearer(token), timeout=2 * ANSWER_S)
        # Its one stream is taken while it waits for its message.
        await until_async(
            lambda: not limiter.has_room(principal.key_id, principal.limits), timeout=ANSWER_S
        )
        code, details = await _status(
            complete(_then(unblock), metadata=bearer(token), timeout=ANSWER_S)
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        waiting.cancel()
        unblock.set()
        await until_async(lambda: _completes(channel, token), "the slot was never freed", ANSWER_S)
        # Freed before its status is sent.
        code, details = await _status(complete(_then(unblock), metadata=bearer(token)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert await _completes(channel, token)


async def _completes(channel: grpc.aio.Channel, token: str) -> bool:
    try:
        await pb_grpc.InferenceStub(channel).Complete(
            _request(), metadata=bearer(token), timeout=ANSWER_S
        )
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
        return False
    return True
