"""A small Python client of the public API that also measures what a client sees.

Timings follow genai-perf: TTFT = first non-empty response − request sent;
inter-token latency = (request latency − TTFT) / (output tokens − 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc


@dataclass
class StreamResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    final: pb.Final = field(default_factory=pb.Final)
    request_id: str = ""
    messages: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    # Gap before every message after the first non-empty one (vLLM's ITL samples).
    gaps_s: list[float] = field(default_factory=list)

    @property
    def inter_token_s(self) -> float:
        itl = inter_token_latency(self.latency_s, self.ttft_s, len(self.token_ids))
        return 0.0 if itl is None else itl


def inter_token_latency(latency_s: float, ttft_s: float, tokens: int) -> float | None:
    """genai-perf's inter-token latency of one answer; None when it has fewer than two tokens."""
    return (latency_s - ttft_s) / (tokens - 1) if tokens > 1 else None


async def generate(
    stub: pb_grpc.InferenceStub, request: pb.GenerateRequest, timeout: float | None = 60.0
) -> StreamResult:
    """Streams one request to completion and measures it."""
    result = StreamResult()
    parts: list[str] = []
    sent = time.perf_counter()
    last = 0.0
    async for message in stub.Generate(request, timeout=timeout):
        now = time.perf_counter()
        result.messages += 1
        result.request_id = message.request_id
        if message.text or message.token_ids:
            if not result.ttft_s:
                result.ttft_s = now - sent
            else:
                result.gaps_s.append(now - last)
            last = now
        parts.append(message.text)
        result.token_ids.extend(message.token_ids)
        if message.HasField("final"):
            result.final = message.final
    result.latency_s = time.perf_counter() - sent
    result.text = "".join(parts)
    return result


def connect(address: str) -> tuple[grpc.aio.Channel, pb_grpc.InferenceStub]:
    channel = grpc.aio.insecure_channel(address)
    return channel, pb_grpc.InferenceStub(channel)
