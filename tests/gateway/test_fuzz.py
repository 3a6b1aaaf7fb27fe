"""A seeded, bounded fuzz of the public API against real processes: engine server ← gateway ← client.

Thousands of generated requests (out-of-range numbers, NaN and infinite floats, empty, huge, unicode
and control-character strings, enum values outside the enum, odd chat messages, random bytes sent
as the body of a generic call; cache administration and health checks among them), many in flight at once. Whatever they are, none may end INTERNAL or
UNKNOWN, the gateway logs no error, and it still answers a normal request afterwards.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest

from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Tiny
from tests.gateway.stack import MODEL, Stack, engine_and_gateway

SEED = 20240611
REQUESTS = 10_000
IN_FLIGHT = 32
MAX_TOKENS = 4


def _small_limits(config: str) -> str:
    """Small output limits keep the valid requests cheap while their bounds are still crossed."""
    config = config.replace("max_output_tokens = 512", f"max_output_tokens = {MAX_TOKENS}")
    return config.replace("default_max_tokens = 64", "default_max_tokens = 2")


@pytest.fixture(scope="module")
def gateway(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Over the engine's stream socket: the other gateway stacks reach the engine over gRPC.
    with engine_and_gateway(
        tiny, tmp_path_factory.mktemp("fuzz"), _small_limits, stream_socket=True
    ) as stack:
        yield stack


class Fuzzer:
    """Request fields drawn from values at and beyond every limit the API states."""

    WORDS = ("The", "gateway", "streams", "tokens", "hello", "cache", "é", "日本", "🙂", "\n")
    INTS = (0, 1, -1, 2, MAX_TOKENS, MAX_TOKENS + 1, 2047, 2048, 2**31 - 1, -(2**31))
    FLOATS = (
        0.0,
        -0.0,
        1e-45,
        1e-3,
        0.01,
        0.5,
        1.0,
        1.0000001,
        100.0,
        100.5,
        1e9,
        -1.0,
        math.nan,
        math.inf,
        -math.inf,
        3.4e38,
    )
    SEEDS = (0, 1, 42, 2**32, 2**63 - 1, 2**63, 2**64 - 1)

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        # A few prompts that recur, so valid greedy requests hit the cache as real traffic does.
        self.prompts = [self.words(1, 6) for _ in range(8)]

    def words(self, low: int, high: int) -> str:
        return " ".join(self.rng.choices(self.WORDS, k=self.rng.randint(low, high)))

    def text(self) -> str:
        r = self.rng
        kind = r.random()
        if kind < 0.3:
            return ""
        if kind < 0.6:
            return self.words(1, 8)
        if kind < 0.8:  # any code point a string may hold, controls and combining marks included
            chars = [chr(r.choice((r.randint(0, 0x7F), r.randint(0x80, 0x2FFF)))) for _ in range(8)]
            return "".join(c for c in chars if not 0xD800 <= ord(c) <= 0xDFFF)
        if kind < 0.95:
            return "x\nFORGED\r\x1b[2K\x00" * r.randint(1, 4)
        return r.choice("ab\u0301 ") * r.choice((129, 257, 5000, 100_000))

    def request(self) -> pb.GenerateRequest:
        r = self.rng
        req = pb.GenerateRequest()
        req.model = MODEL if r.random() < 0.85 else self.text()
        if r.random() < 0.3:
            req.request_id = self.text()
        if r.random() < 0.3:
            req.namespace = self.text()
        which = r.random()
        if which < 0.55:
            req.prompt = r.choice(self.prompts) if r.random() < 0.7 else self.text()
        elif which < 0.9:
            for _ in range(r.choice((0, 1, 1, 2, 3, 40))):
                role = r.choice(("system", "user", "assistant", "user", "robot", "", "USER"))
                req.messages.messages.add(role=role, content=self.text())
            if r.random() < 0.1:
                req.messages.SetInParent()
        if r.random() < 0.8:
            req.max_tokens = r.choice(self.INTS) if r.random() < 0.4 else r.randint(1, 3)
        if r.random() < 0.6:
            req.temperature = r.choice(self.FLOATS) if r.random() < 0.6 else 0.0
        if r.random() < 0.3:
            req.top_p = r.choice(self.FLOATS)
        if r.random() < 0.3:
            req.top_k = r.choice(self.INTS)
        if r.random() < 0.3:
            req.seed = r.choice(self.SEEDS)
        if r.random() < 0.2:
            req.stop.extend(self.text() for _ in range(r.choice((1, 2, 17))))
        if r.random() < 0.2:
            req.cache_policy = r.choice((0, 1, 2, 3, 4, -1, 2**31 - 1))  # type: ignore[assignment]
        return req

    def body(self) -> bytes:
        """Random bytes, or a valid request with some of its bytes flipped or cut off."""
        r = self.rng
        if r.random() < 0.5:
            return r.randbytes(r.randint(0, 300))
        data = bytearray(self.request().SerializeToString())
        for _ in range(r.randint(1, 4)):
            if data:
                data[r.randrange(len(data))] = r.randrange(256)
        return bytes(data[: r.randint(0, len(data))])

    def admin(self) -> tuple[str, bytes]:
        """A CacheAdmin call: Stats, or Invalidate of any namespace and model, or a bad body."""
        r = self.rng
        if r.random() < 0.2:
            return "Stats", r.randbytes(r.randint(0, 8))
        request = pb.InvalidateRequest(namespace=self.text(), model=self.text())
        request.all = r.random() < 0.1
        body = request.SerializeToString()
        return "Invalidate", body if r.random() < 0.8 else r.randbytes(len(body) or 3)


async def _call(channel: grpc.aio.Channel, fuzzer: Fuzzer) -> tuple[grpc.StatusCode, str]:
    r = fuzzer.rng
    streaming = r.random() < 0.3
    method = "/appliance.v1.Inference/" + ("Generate" if streaming else "Complete")
    raw = r.random() < 0.15
    body = fuzzer.body() if raw else fuzzer.request().SerializeToString()
    other = r.random()
    if other < 0.05:
        streaming = False
        name, body = fuzzer.admin()
        method = f"/appliance.v1.CacheAdmin/{name}"
    elif other < 0.07:  # health checks: a service name of any bytes, or any body
        streaming = False
        method = "/grpc.health.v1.Health/Check"
        body = fuzzer.body()
    try:
        if streaming:
            async for _ in channel.unary_stream(method)(body, timeout=60):
                pass
        else:
            await channel.unary_unary(method)(body, timeout=60)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), f"{method} {body[:200]!r}: {exc.details()}"
    return grpc.StatusCode.OK, ""


async def test_fuzzed_requests_never_end_internal_or_unknown(gateway: Stack) -> None:
    fuzzer = Fuzzer(SEED)
    codes: Counter[grpc.StatusCode] = Counter()
    bad: list[str] = []
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def one(channel: grpc.aio.Channel) -> None:
        async with slots:
            code, what = await _call(channel, fuzzer)
        codes[code] += 1
        if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            bad.append(f"{code.name} {what}")

    async with grpc.aio.insecure_channel(gateway.address) as channel:
        await asyncio.gather(*(one(channel) for _ in range(REQUESTS)))
        assert sum(codes.values()) == REQUESTS
        assert not bad, f"{len(bad)} of {REQUESTS}: " + "\n".join(bad[:20])
        # Both kinds were exercised: refusals and generated answers.
        assert codes[grpc.StatusCode.INVALID_ARGUMENT] > REQUESTS // 4, codes
        assert codes[grpc.StatusCode.OK] > REQUESTS // 20, codes
        reply = await pb_grpc.InferenceStub(channel).Complete(
            pb.GenerateRequest(
                model=MODEL, prompt="after the fuzz", max_tokens=4, request_id="after-the-fuzz"
            ),
            timeout=60,
        )
        assert reply.final.usage.completion_tokens > 0
    log = await asyncio.to_thread(gateway.log_through, "after-the-fuzz")
    assert not [line for line in log if " ERROR " in line or line.startswith("Traceback")]
    assert not [line for line in log if line.startswith("FORGED")]
