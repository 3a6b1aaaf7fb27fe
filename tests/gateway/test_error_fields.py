"""A refusal of the prompt or the chat names the body field at fault, over HTTP as the OpenAI error's
`param` (a message by its index where one message is at fault) and over gRPC in the message."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from appliance.gateway.server import RunningGateway
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.gateway.test_http_api import _post, gateway, stub  # noqa: F401

HI = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", {"prompt": ""}, "prompt", "prompt is empty"),
        # The tiny model's chat template refuses a system message after the first.
        (
            "/v1/chat/completions",
            {"messages": [HI, {"role": "system", "content": "late"}, HI]},
            "messages",
            "a system message may only come first",
        ),
        (
            "/v1/chat/completions",
            {"messages": [HI, {"role": "robot", "content": "hi"}]},
            "messages[1].role",
            "messages[1].role is 'robot'",
        ),
        # Only an assistant message may leave its content out: a misspelt key is not an empty turn.
        (
            "/v1/chat/completions",
            {
                "messages": [
                    HI,
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "contnet": "x"},
                ]
            },
            "messages[2].content",
            "messages[2].content is required in a user message",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": None}, HI]},
            "messages[0].content",
            "messages[0].content is required in a system message",
        ),
        # With tools the gateway writes a system message first; the index is still the body's.
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "hi"}, HI], "tools": [TOOL]},
            "messages[0].role",
            "messages[0].role is 'robot'",
        ),
    ],
)
async def test_http_param_names_the_field(
    gateway: RunningGateway,  # noqa: F811
    path: str,
    body: dict[str, Any],
    param: str,
    words: str,
) -> None:
    sent = json.dumps({"model": "tiny", "max_tokens": 2, **body}).encode()
    status, _, reply = await _post(gateway, path, sent)
    assert (status, reply["error"]["param"]) == (400, param), reply
    assert words in reply["error"]["message"], reply


async def test_grpc_messages_name_the_field(stub: pb_grpc.InferenceStub) -> None:  # noqa: F811
    late = pb.GenerateRequest(
        model="tiny",
        max_tokens=2,
        messages=pb.ChatMessages(
            messages=[
                pb.ChatMessage(role="user", content="hi"),
                pb.ChatMessage(role="system", content="late"),
                pb.ChatMessage(role="user", content="hi"),
            ]
        ),
    )
    for request, field in ((pb.GenerateRequest(model="tiny"), "prompt"), (late, "messages")):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Complete(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (refused.value.details() or ""), refused.value.details()
