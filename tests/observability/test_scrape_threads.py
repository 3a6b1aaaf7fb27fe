"""A scrape runs on prometheus-client's HTTP thread while the event loop changes what it reads:
the admission gauges read the gate's line while requests join and leave it, and the scrape still
answers. The gateway runs in the test's event loop against engine server processes (the fixtures
of test_latency_discipline); the engine is stopped so that the line holds still between steps.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
import pytest

from appliance.gateway.server import RunningGateway
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.gateway.test_latency_discipline import (  # noqa: F401  (fixtures)
    EngineProcess,
    channel,
    engines,
    gateway,
    req,
)
from tests.support import until_async

BYPASS = pb.CACHE_POLICY_BYPASS


def scrape(port: int) -> tuple[int, str]:
    """The /metrics page's status and text."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


@pytest.mark.parametrize("gateway", [({"max_in_flight": 1}, {})], indirect=True)
async def test_a_scrape_answers_while_a_request_joins_the_line(
    gateway: RunningGateway,  # noqa: F811
    channel: grpc.aio.Channel,  # noqa: F811
    engines: tuple[EngineProcess, ...],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stub = pb_grpc.InferenceStub(channel)
    gate = gateway.pipeline.admission.gates["primary"]  # type: ignore[attr-defined]
    port = gateway.metrics.serve("127.0.0.1:0")
    # The scrape's thread stops in the middle of reading the line (where the interpreter may
    # switch threads) until a request has joined it on the event loop.
    loop_thread = threading.get_ident()
    reading, joined = threading.Event(), threading.Event()
    service_s: Callable[[int, int], float] = gate.estimate.service_s

    def paused(prompt_tokens: int, max_tokens: int) -> float:
        if threading.get_ident() != loop_thread and not reading.is_set():
            reading.set()
            joined.wait(30)
        return service_s(prompt_tokens, max_tokens)

    monkeypatch.setattr(gate.estimate, "service_s", paused)
    engines[0].signal(signal.SIGSTOP)
    calls = []
    try:
        calls.append(stub.Complete(req(prompt="holds the slot", cache_policy=BYPASS)))
        await until_async(lambda: bool(gate.running), "the first request never got the slot")
        calls.append(stub.Complete(req(prompt="waits", cache_policy=BYPASS)))
        await until_async(lambda: len(gate.waiting) == 1, "the second request never waited")
        scraped = asyncio.ensure_future(asyncio.to_thread(scrape, port))
        assert await asyncio.to_thread(reading.wait, 30), "the scrape never read the line"
        calls.append(stub.Complete(req(prompt="joins", cache_policy=BYPASS)))
        await until_async(lambda: len(gate.waiting) == 2, "the third request never waited")
        joined.set()
        status, page = await scraped
    finally:
        joined.set()
        engines[0].signal(signal.SIGCONT)
        for call in calls:
            call.cancel()
    assert status == 200, page[-500:]
    assert 'appliance_requests_waiting{model="primary"}' in page
