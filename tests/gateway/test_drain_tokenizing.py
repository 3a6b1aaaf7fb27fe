"""The drain's grace ends for requests still waiting for a tokenizer thread as for those waiting for
the engine: refused with UNAVAILABLE (HTTP 503) and the retry hint of every drain refusal, for each
front end; and a request that reaches the HTTP edge while it drains is refused the same way."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable

import aiohttp
import grpc
import pytest

from appliance.gateway.models import load_models
from appliance.gateway.pipeline import STOPPING, UNAVAILABLE_RETRY_MS, Pipeline
from appliance.gateway.server import start_server
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny
from tests.gateway.test_client_deadlines import BYPASS
from tests.gateway.test_http_api import _config, _post
from tests.gateway.test_inprocess import RecordingSink
from tests.support import until_async

LONG = "word " * 2000  # tokenized on a worker thread


@contextlib.asynccontextmanager
async def busy_tokenizers(pipeline: Pipeline) -> AsyncIterator[Callable[[], int]]:
    """Every tokenizer thread is busy until the block ends; yields how many long inputs wait."""
    busy = threading.Event()
    pool = pipeline._tokenizers
    held = [pool.submit(busy.wait) for _ in range(pool._max_workers)]
    try:
        yield pool._work_queue.qsize
    finally:
        busy.set()
        await asyncio.gather(*(asyncio.wrap_future(h) for h in held))


async def test_a_request_waiting_for_a_tokenizer_when_the_grace_ends_gets_a_retry_hint(
    tiny: Tiny, engine: Engine
) -> None:
    config = _config(tiny, engine.address)
    running = await start_server(config, await load_models(config))
    body = {
        "model": "tiny",
        "prompt": LONG,
        "max_tokens": 4,
        "appliance": {"cache_policy": "bypass"},
    }
    draining = None
    try:
        async with (
            busy_tokenizers(running.pipeline) as waiting,
            grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
        ):
            call = pb_grpc.InferenceStub(channel).Complete(
                pb.GenerateRequest(model="tiny", prompt=LONG, max_tokens=4, cache_policy=BYPASS),
                timeout=60,
            )
            posting = asyncio.ensure_future(
                _post(running, "/v1/completions", json.dumps(body).encode())
            )
            await until_async(lambda: waiting() == 2, "the requests never waited")
            draining = asyncio.ensure_future(running.drain(0.05))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            status, headers, reply = await posting
    finally:
        await (draining or running.drain(0))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    assert refused.value.details() == STOPPING
    trailers = dict(refused.value.trailing_metadata() or ())
    assert trailers["grpc-retry-pushback-ms"] == str(UNAVAILABLE_RETRY_MS)
    assert status == 503, reply
    assert reply["error"]["message"] == STOPPING
    assert headers["retry-after-ms"] == str(UNAVAILABLE_RETRY_MS)
    assert running.pipeline.in_flight == {"tiny": 0}


async def test_a_request_on_an_open_http_connection_during_the_drain_gets_a_retry_hint(
    tiny: Tiny, engine: Engine
) -> None:
    config = _config(tiny, engine.address)
    sink = RecordingSink()
    running = await start_server(config, await load_models(config), sink)
    assert running.http is not None
    url = f"http://127.0.0.1:{running.http.port}"
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4}
    draining = None
    try:
        # The drain lasts while a request waits for a tokenizer thread.
        async with busy_tokenizers(running.pipeline) as waiting, aiohttp.ClientSession() as session:
            async with session.get(f"{url}/v1/models") as r:  # the connection stays open
                assert r.status == 200
            long = json.dumps({**body, "prompt": LONG}).encode()
            posting = asyncio.ensure_future(_post(running, "/v1/completions", long))
            await until_async(lambda: waiting() == 1, "it never waited")
            draining = asyncio.ensure_future(running.drain(30))
            await until_async(lambda: running.http is not None and running.http.draining)
            async with session.post(f"{url}/v1/completions", json=body) as r:
                status, headers, reply = r.status, r.headers, await r.json()
        answered, _, answer = await posting  # the tokenizer threads are free again
    finally:
        await (draining or running.drain(0))
    assert answered == 200, answer
    assert status == 503, reply
    assert reply["error"]["message"] == STOPPING
    assert headers["retry-after-ms"] == str(UNAVAILABLE_RETRY_MS)
    assert headers["retry-after"] == str(UNAVAILABLE_RETRY_MS // 1000)
    # Counted in the metrics and the access log like any refusal.
    assert sorted(r.status for r in sink.reports) == ["OK", "UNAVAILABLE"]
