"""A request refused on a tokenizer thread leaves no reference cycle behind: its token ids and
checked request are freed when the refusal is answered, not by a later garbage collection that
holds the event loop (freeing millions of token ids) on whatever request triggers it."""

from __future__ import annotations

import gc
import json
from types import FrameType
from typing import Any

import grpc
import pytest

from appliance.gateway.models import load_models
from appliance.gateway.server import RunningGateway, start_server
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Engine, Tiny
from tests.gateway.test_client_deadlines import BYPASS
from tests.gateway.test_http_api import _config, _post

LONG = "word " * 4000  # tokenized on a worker thread; longer than the tiny model's input
REFUSAL = "tokens; this model accepts at most"


async def _refused(running: RunningGateway, api: str, chat: bool) -> None:
    """A request too long for the tiny model sent and refused."""
    if api == "grpc":
        if chat:
            request = pb.GenerateRequest(
                model="tiny",
                messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=LONG)]),
                max_tokens=4,
                cache_policy=BYPASS,
            )
        else:
            request = pb.GenerateRequest(
                model="tiny", prompt=LONG, max_tokens=4, cache_policy=BYPASS
            )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.InferenceStub(channel).Complete(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert REFUSAL in (refused.value.details() or "")
        return
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 4}
    if chat:
        body["messages"] = [{"role": "user", "content": LONG}]
    else:
        body["prompt"] = LONG
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, _, reply = await _post(running, path, json.dumps(body).encode())
    assert status == 400, reply
    assert REFUSAL in reply["error"]["message"]


@pytest.mark.parametrize("api", ["grpc", "http"])
@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat"])
async def test_a_refusal_on_a_tokenizer_thread_leaves_no_cyclic_garbage(
    tiny: Tiny, engine: Engine, api: str, chat: bool
) -> None:
    config = _config(tiny, engine.address)
    running = await start_server(config, await load_models(config))
    gc.collect()
    gc.disable()
    drained = False
    try:
        await _refused(running, api, chat)
        # Every handler ended (the server's own frames included) before the collector looks.
        await running.drain(0.5)
        drained = True
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        stages = [
            o.f_code.co_name
            for o in gc.garbage
            if isinstance(o, FrameType) and o.f_code.co_filename.endswith("pipeline.py")
        ]
        token_lists = [
            o for o in gc.garbage if isinstance(o, list) and len(o) > 2048 and type(o[0]) is int
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        if not drained:
            await running.drain(0)
    assert not token_lists, "the refused prompt's token ids were left to the collector"
    assert not stages, f"the pipeline's frames were left to the collector: {stages}"
