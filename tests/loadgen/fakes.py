"""A stand-in for the gateway's gRPC API in a thread of the test process: it answers the bench's
first request (`PREFLIGHT_ID`) like the gateway, and every other one as the test says."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc

from appliance.loadgen.runner import PREFLIGHT_ID
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc

Answer = Callable[
    ["FakeGateway", pb.GenerateRequest, grpc.ServicerContext], Iterator[pb.GenerateResponse]
]


def final_answer(request_id: str = "fake") -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id,
        text="x",
        token_ids=[1],
        final=pb.Final(finish_reason=pb.FINISH_REASON_LENGTH, cache_tier=pb.CACHE_TIER_MISS),
    )


def answers_at_once(
    fake: FakeGateway, request: pb.GenerateRequest, context: grpc.ServicerContext
) -> Iterator[pb.GenerateResponse]:
    """An Answer: the final message at once."""
    yield final_answer()


class FakeGateway(pb_grpc.InferenceServicer):  # type: ignore[misc]
    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.released = threading.Event()  # set at teardown: ends every answer still held

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        if request.request_id == PREFLIGHT_ID:
            yield final_answer("preflight")
            return
        yield from self.answer(self, request, context)

    def hold(self, context: grpc.ServicerContext) -> None:
        """Holds an answer until the client goes away or the test ends."""
        while context.is_active() and not self.released.wait(0.05):
            pass


@contextmanager
def fake_gateway(
    answer: Answer, workers: int = 16
) -> Iterator[tuple[str, FakeGateway, grpc.Server]]:
    fake = FakeGateway(answer)
    server = grpc.server(ThreadPoolExecutor(max_workers=workers))
    pb_grpc.add_InferenceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", fake, server
    finally:
        fake.released.set()
        server.stop(grace=None)
