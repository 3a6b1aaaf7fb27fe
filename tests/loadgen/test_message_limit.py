"""The largest request `appliance bench` sends is what the gateway and the engine server take: a
message of MAX_REQUEST_BYTES reaches each server's handler, one a byte over is refused by gRPC
(RESOURCE_EXHAUSTED), so a change of the limit, or of gRPC's default, moves all three together."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2 as ts

from appliance.grpc_limits import MAX_REQUEST_BYTES
from appliance.v1 import inference_pb2 as pb
from tests.conftest import Engine, Tiny
from tests.security.conftest import running
from tests.support import gateway_config

TOO_LARGE = "larger than max"  # gRPC's refusal: "Received message larger than max (N vs. M)"


def sized(make: Callable[[str], Message], size: int) -> bytes:
    """A message of exactly `size` bytes, its string field padded."""
    pad = size - make("").ByteSize()
    while (data := make("x" * pad).SerializeToString()) and len(data) > size:
        pad -= len(data) - size  # the field's length prefix grew
    assert len(data) == size, len(data)
    return data


async def answer(address: str, method: str, data: bytes, stream: bool) -> grpc.StatusCode | str:
    """The status of a call with these bytes as its request (TOO_LARGE: gRPC refused them)."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            if stream:
                async for _ in channel.unary_stream(method)(data, timeout=30):
                    pass
            else:
                await channel.unary_unary(method)(data, timeout=30)
        except grpc.aio.AioRpcError as exc:
            return TOO_LARGE if TOO_LARGE in (exc.details() or "") else exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("over", [0, 1])
async def test_the_gateway_and_the_engine_take_the_largest_request_and_no_larger(
    over: int, tiny: Tiny, engine: Engine
) -> None:
    size = MAX_REQUEST_BYTES + over
    gateway_request = sized(lambda text: pb.GenerateRequest(model="nope", prompt=text), size)
    engine_request = sized(lambda text: ts.ModelInferRequest(model_name="nope", id=text), size)
    async with running(gateway_config(tiny.tokenizer_dir, engine.address)) as gw:
        said = await answer(
            f"127.0.0.1:{gw.port}", "/appliance.v1.Inference/Generate", gateway_request, True
        )
    assert (said == TOO_LARGE) == bool(over), said
    said = await answer(
        engine.address, "/inference.GRPCInferenceService/ModelInfer", engine_request, False
    )
    assert (said == TOO_LARGE) == bool(over), said
