"""A bare grpc.aio unary echo server: the floor any gRPC hop costs on this machine. With
`--relay-to PORT` it answers each call by making the same call to the echo server there, over one
channel opened at start: what a gateway that did nothing but forward would add to a call."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable

import grpc
import uvloop

METHOD = "/bench.Echo/Echo"

Handler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


def _relay(channel: grpc.aio.Channel) -> Handler:
    forward = channel.unary_unary(METHOD)

    async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        reply: bytes = await forward(request, wait_for_ready=True)
        return reply

    return relay


async def serve(port: int, relay_to: int | None) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{relay_to}") if relay_to else None
    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(_relay(channel) if channel else _echo)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--relay-to", type=int, default=None)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.relay_to))
