"""How the gateway's gRPC methods are served: request bodies that are not the message a method
takes end INVALID_ARGUMENT, not UNKNOWN; a gated method checks the call's credentials before it
reads its request.

grpc.aio calls a method's request deserializer before the servicer runs; when it raises, the call
ends UNKNOWN ("Unexpected <class 'DecodeError'>") and grpc logs an ERROR with a traceback, one per
request, which any client can cause at will. Services registered through `add_service` decode with a
deserializer that cannot raise: a body that does not parse becomes an `Undecodable`, and the
method, before the servicer sees it, ends the call INVALID_ARGUMENT naming the message type it
expected. Such refusals are logged once per interval with a count.

Gated methods (`add_service(gate=...)`): grpc.aio reads a unary-request method's message before
its handler runs, and gRPC's core keeps up to 4 MiB (the receive limit) of what a call sent for as
long as its stream is open; a caller without a key that never finished its message held that for
as long as it kept the call open. A gated method is registered as a stream-request method instead
(the wire is the same: generated stubs and grpcurl call it as the unary method it is): the gate
sees the call's metadata first and ends the call when it refuses it, so a refused call's stream is
closed before its message is read, and only then is the one message read. A caller without a
valid key is thus answered UNAUTHENTICATED before anything about its message counts: one whose
message is over the receive limit gets UNAUTHENTICATED too, not gRPC's RESOURCE_EXHAUSTED. A call
that ends its requests without a message (grpc.aio's own unary handling answers it nothing until
its deadline) gets INVALID_ARGUMENT; messages after the first are never read, as grpc.aio's unary
handling ignores them. `read_s` bounds the wait for the message of a method that is not gated
(health, which probes without keys): a call whose message has not arrived by then ends
DEADLINE_EXCEEDED, and what it sent of it is dropped.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf import descriptor_pool

from appliance.logline import Throttled

log = logging.getLogger(__name__)
_throttled = Throttled(log)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request body that did not parse as `expected`."""

    expected: str
    size: int

    @property
    def message(self) -> str:
        return (
            f"the request body ({self.size} bytes) is not a valid {self.expected}: encode it "
            "with the service's proto (server reflection serves it)"
        )


def _deserializer(parse: Callable[[bytes], Any], expected: str) -> Callable[[bytes], Any]:
    def deserialize(body: bytes) -> Any:
        try:
            return parse(body)
        except Exception:  # protobuf says only "Error parsing message": nothing more to tell
            return Undecodable(expected, len(body))

    return deserialize


async def _refuse(request: Undecodable, context: grpc.aio.ServicerContext, method: str) -> None:
    _throttled.warning("%s: refused an undecodable body: %s", method, request.message)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


class Held(Protocol):
    """What a gate let through (the caller's grant); released when the call ends before the
    method runs, else by the method."""

    def release(self) -> None: ...


# Checks the call's metadata for the method named; ends the call (context.abort) when it refuses.
Gate = Callable[[str, grpc.aio.ServicerContext], Awaitable[Held]]

_held: ContextVar[Held | None] = ContextVar("held", default=None)


def held() -> Held | None:
    """What the gate let through for the call this method serves (None: the method is not
    gated)."""
    return _held.get()


async def _one_request(
    context: grpc.aio.ServicerContext,
    method: str,
    expected: str,
    gate: Gate | None,
    read_s: float | None,
) -> Any:
    """The call's one request message, read (context.read: grpc's request iterator, which the
    handler is also given, stays unused) once the gate let the call through."""
    let_through = None if gate is None else await gate(method.rpartition("/")[2], context)
    try:
        if read_s is None:
            request = await context.read()
        else:
            try:
                request = await asyncio.wait_for(context.read(), read_s)
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the request message did not arrive within {read_s:g} s of the call",
                )
        if request is grpc.aio.EOF:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the call ended without a request message: {method} takes one {expected}",
            )
    except BaseException:
        if let_through is not None:
            let_through.release()
        raise
    _held.set(let_through)
    return request


def _gated(
    checked: Callable[..., Any],
    method: str,
    expected: str,
    gate: Gate | None,
    read_s: float | None,
) -> Callable[..., Any]:
    """`checked` (a method as `_unary` or `_stream` wraps it) served as a stream-request method:
    its one request is read once the gate let the call through."""

    async def gated(_requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        request = await _one_request(context, method, expected, gate, read_s)
        return await checked(request, context)

    return gated


def _unary(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(request, context, method)
        return await behavior(request, context)

    return unary


def _stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):  # a servicer that writes with context.write
        return _unary(behavior, method)

    # A coroutine that writes (grpc's reader/writer form) rather than a wrapping generator: the
    # messages take the same path through grpc as the servicer's own generator would.
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, Undecodable):
            await _refuse(request, context, method)
        async with aclosing(behavior(request, context)) as messages:
            async for message in messages:
                await context.write(message)

    return stream


def _bidi(behavior: Callable[..., Any], method: str, gate: Gate | None) -> Callable[..., Any]:
    """A stream of requests (server reflection's one method): the call ends INVALID_ARGUMENT at
    the first body that does not decode; the ones before it were answered. A gate sees the call
    before its first request is read."""

    async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        async for request in requests:
            if isinstance(request, Undecodable):
                await _refuse(request, context, method)
            yield request

    async def bidi(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        if gate is not None:
            (await gate(method.rpartition("/")[2], context)).release()
        async with (
            aclosing(checked(requests, context)) as decoded,
            aclosing(behavior(decoded, context)) as messages,
        ):
            async for message in messages:
                await context.write(message)

    return bidi


def _tolerant(
    service: str, name: str, handler: Any, gate: Gate | None, read_s: float | None
) -> Any:
    method = f"/{service}/{name}"
    expected = (
        descriptor_pool.Default()
        .FindServiceByName(service)
        .methods_by_name[name]
        .input_type.full_name
    )
    deserialize = _deserializer(handler.request_deserializer, expected)
    if handler.request_streaming:
        if not handler.response_streaming or not inspect.isasyncgenfunction(handler.stream_stream):
            raise TypeError(f"{method}: only a bidirectional async-generator method is wrapped")
        return handler._replace(
            request_deserializer=deserialize,
            stream_stream=_bidi(handler.stream_stream, method, gate),
        )
    if gate is not None or read_s is not None:
        # Served as a stream-request method, so that nothing of the message is read before the
        # gate has seen the call.
        if handler.response_streaming:
            behavior = _gated(_stream(handler.unary_stream, method), method, expected, gate, read_s)
            return handler._replace(
                request_streaming=True,
                request_deserializer=deserialize,
                unary_stream=None,
                stream_stream=behavior,
            )
        return handler._replace(
            request_streaming=True,
            request_deserializer=deserialize,
            unary_unary=None,
            stream_unary=_gated(
                _unary(handler.unary_unary, method), method, expected, gate, read_s
            ),
        )
    if handler.response_streaming:
        return handler._replace(
            request_deserializer=deserialize, unary_stream=_stream(handler.unary_stream, method)
        )
    return handler._replace(
        request_deserializer=deserialize, unary_unary=_unary(handler.unary_unary, method)
    )


class _Collector:
    """Stands in for the server in a generated add_*_to_server call to see its method handlers."""

    service = ""
    handlers: dict[str, Any] = {}  # noqa: RUF012 (always replaced)

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service, self.handlers = service, handlers


def add_service(
    add_to_server: Callable[[Any, Any], None],
    servicer: object,
    server: grpc.aio.Server,
    also_as: tuple[str, ...] = (),
    gate: Gate | None = None,
    read_s: float | None = None,
) -> None:
    """Registers `servicer` as its generated `add_*_to_server` would, but tolerant of bodies
    that do not decode; `also_as` names further services whose messages are the same on the
    wire (a protocol's newer package name) that the same methods answer. `gate`: checks every
    call's metadata before its request is read (the module's docstring); `read_s`: how long a
    unary-request method waits for its message."""
    collected = _Collector()
    add_to_server(servicer, collected)
    service = collected.service
    handlers = {
        name: _tolerant(service, name, handler, gate, read_s)
        for name, handler in collected.handlers.items()
    }
    for name in (service, *also_as):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)
