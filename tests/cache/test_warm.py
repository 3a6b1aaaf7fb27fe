"""`appliance cache warm` against real gateways sharing a real redis-server: the warmed answers are
L2 hits on another gateway, a second run skips what is cached, and a warm-up request yields to a
client that holds the engine."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from appliance.tools.warm import Tally, read_prompts, warm_one
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.cache.redis_server import RedisServer
from tests.cache.test_cache_e2e import Gateway, cache_config, gateway, settle, started
from tests.conftest import Engine, Tiny

L2 = pb.CACHE_TIER_EXACT_L2
PROMPTS = [
    "What is the capital of France?",
    "How do I reset my password?",
    "Summarize the return policy.",
    '{"messages": {"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens": 6}',
    '{"prompt": "Seeded", "temperature": 0.8, "seed": 7}',
]


@pytest.fixture
async def two(
    tiny: Tiny,
    engine: Engine,
    redis_server: RedisServer,
) -> AsyncIterator[tuple[Gateway, Gateway]]:
    redis_server.client().flushall()
    a = await gateway(tiny, engine, cache_config(redis_server))
    b = await gateway(tiny, engine, cache_config(redis_server))
    yield a, b
    await a.close()
    await b.close()


async def warm_cli(gw: Gateway, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "appliance",
        "cache",
        "--gateway",
        f"127.0.0.1:{gw.running.port}",
        "warm",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_warmed_answers_are_l2_hits_on_another_gateway(
    two: tuple[Gateway, Gateway], engine: Engine, tmp_path: Path
) -> None:
    a, b = two
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(PROMPTS) + "\n\n")
    args = ("--prompts", str(prompts), "--model", "tiny", "--max-tokens", "8")
    code, out, err = await warm_cli(a, *args)
    assert code == 0, err
    assert out.splitlines()[-1].startswith("5/5: 5 warmed, 0 already cached, 0 failed"), out
    await settle()

    before = started(engine)
    code, out, err = await warm_cli(a, *args)  # an interrupted run is run again: nothing is redone
    assert code == 0, err
    assert out.splitlines()[-1].startswith("5/5: 0 warmed, 5 already cached"), out
    assert started(engine) == before

    for request in read_prompts(prompts, "tiny", 8):
        reply = await b.stub.Complete(request)
        assert reply.final.cache_tier == L2, request
    assert started(engine) == before


async def test_a_warm_up_request_waits_for_the_client_holding_the_engine(
    two: tuple[Gateway, Gateway],
) -> None:
    a, _ = two
    gate = a.running.pipeline.admission.gates["tiny"]  # type: ignore[attr-defined]
    # A client's long generation holds the engine's one slot.
    ticket = await gate.admit(10, 2000, None)
    refused = threading.Event()
    released = threading.Event()

    def sleep(seconds: float) -> None:  # the warm-up's back-off: wait for the client instead
        refused.set()
        released.wait(60)

    request = pb.GenerateRequest(model="tiny", prompt="warm me", max_tokens=4, temperature=0)
    tally = Tally(1)
    channel = grpc.insecure_channel(f"127.0.0.1:{a.running.port}")
    stub = pb_grpc.InferenceStub(channel)
    warming = asyncio.ensure_future(
        asyncio.to_thread(warm_one, stub, request, 50, 30.0, tally, sleep)
    )
    try:
        assert await asyncio.to_thread(refused.wait, 30)
        assert tally.warmed == 0
    finally:
        ticket.release(0)
        released.set()
    assert await warming == ""
    channel.close()
    assert (tally.warmed, tally.refused) == (1, 1)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x", "temperature": 0.7}', ":1: a sampled request"),
        ('{"prompt": "x", "cache_policy": "CACHE_POLICY_BYPASS"}', ":1: cache_policy is chosen"),
        ('{"prompt": ', ":1: not a GenerateRequest"),
    ],
)
async def test_a_bad_prompts_file_is_refused_before_anything_is_sent(
    two: tuple[Gateway, Gateway], tmp_path: Path, line: str, message: str
) -> None:
    a, _ = two
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(line + "\n")
    code, out, err = await warm_cli(a, "--prompts", str(prompts), "--model", "tiny")
    assert code == 2 and out == ""
    assert err.startswith(f"appliance cache warm: {prompts}{message}"), err
    assert len(err.splitlines()) == 1
