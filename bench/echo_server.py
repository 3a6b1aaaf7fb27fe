"""A bare grpc.aio unary echo server: the floor any gRPC hop costs on this machine."""

from __future__ import annotations

import argparse

import grpc
import uvloop

METHOD = "/bench.Echo/Echo"


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def serve(port: int) -> None:
    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(_echo)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    uvloop.run(serve(parser.parse_args().port))
