"""Request bodies that are not the message a method takes: INVALID_ARGUMENT, not UNKNOWN.

grpc.aio calls a method's request deserializer before the servicer runs; when it raises, the call
ends UNKNOWN ("Unexpected <class 'DecodeError'>") and grpc logs an ERROR with a traceback, one per
request, which any client can cause at will. Services registered through `add_service` decode with a
deserializer that cannot raise: a body that does not parse becomes an `Undecodable`, and the
method, before the servicer sees it, ends the call INVALID_ARGUMENT naming the message type it
expected. Such refusals are logged once per interval with a count.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

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


def _bidi(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """A stream of requests (server reflection's one method): the call ends INVALID_ARGUMENT at
    the first body that does not decode; the ones before it were answered."""

    async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        async for request in requests:
            if isinstance(request, Undecodable):
                await _refuse(request, context, method)
            yield request

    async def bidi(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        async with (
            aclosing(checked(requests, context)) as decoded,
            aclosing(behavior(decoded, context)) as messages,
        ):
            async for message in messages:
                await context.write(message)

    return bidi


def _tolerant(service: str, name: str, handler: Any) -> Any:
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
            request_deserializer=deserialize, stream_stream=_bidi(handler.stream_stream, method)
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
) -> None:
    """Registers `servicer` as its generated `add_*_to_server` would, but tolerant of bodies
    that do not decode; `also_as` names further services whose messages are the same on the
    wire (a protocol's newer package name) that the same methods answer."""
    collected = _Collector()
    add_to_server(servicer, collected)
    service = collected.service
    handlers = {
        name: _tolerant(service, name, handler) for name, handler in collected.handlers.items()
    }
    for name in (service, *also_as):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)
