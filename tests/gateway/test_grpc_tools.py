"""Tools over the gRPC API, and chats with tools rendered by a chat template that takes them.

The tiny model's weights are random: a forced call is a call only because the engine decodes under
the call's schema. `tiny` has the tiny model's template (no tool support: the fallback system
message); `tooled` is the same engine behind a tokenizer whose template renders `tools` itself."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import jsonschema
import pytest

from appliance.config import HttpConfig, ServerConfig
from appliance.gateway import openai_wire as wire
from appliance.gateway import tool_calls
from appliance.gateway.models import load_models
from appliance.gateway.request import Limits, check, check_json_schema, tokenize
from appliance.gateway.server import RunningGateway, start_server
from appliance.text.tokenizer import ModelText
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc
from tests.conftest import Tiny
from tests.gateway.test_structured_output import served  # noqa: F401
from tests.support import gateway_config

# A template in the style of Hugging Face's templates with tool support: the tools as JSON after a
# marker, an assistant's calls inside <tool_call> tags, tool results in their own role.
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|tools|>\\n' }}{% for tool in tools %}"
    "{{ tool['function'] | tojson }}{{ '\\n' }}{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>' + call['function']['name'] + ' ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '</tool_call>' }}{% endfor %}"
    "{% elif message['role'] == 'tool' %}{{ 'for ' + message['tool_call_id'] + ': ' }}"
    "{{ message['content'] }}{% else %}{{ message['content'] }}{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = pb.Tool(
    name="get_weather",
    description="Weather of a city",
    parameters=json.dumps(WEATHER_PARAMETERS),
)
TIME = pb.Tool(name="get_time")
LIMITS = Limits(
    max_input_tokens=4096, max_output_tokens=64, default_max_tokens=16, context_length=8192
)


def tooled_dir(tiny: Tiny, root: Path) -> Path:
    """The tiny tokenizer with TOOLS_TEMPLATE as its chat template (beside the engine's
    fingerprint, as a model directory holds them)."""
    target = root / "tokenizer"
    shutil.copytree(tiny.tokenizer_dir, target)
    shutil.copy(tiny.tokenizer_dir.parent / "engine_fingerprint", root)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def tooled(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tooled_dir(tiny, tmp_path_factory.mktemp("tooled"))


@pytest.fixture(scope="module")
async def gateway(
    tiny: Tiny,
    served: str,  # noqa: F811
    tooled: Path,
) -> AsyncIterator[RunningGateway]:
    config = gateway_config(
        tiny.tokenizer_dir,
        {"tiny": served, "tooled": served},
        per_model={"tooled": {"tokenizer_dir": tooled}},
        server=ServerConfig(listen="127.0.0.1:0", access_log=False),
        http=HttpConfig(listen="127.0.0.1:0"),
        max_output_tokens=512,
        ready_timeout_s=30.0,
    )
    running = await start_server(config, await load_models(config))
    try:
        yield running
    finally:
        await running.drain(0.5)


@pytest.fixture
async def stub(gateway: RunningGateway) -> AsyncIterator[pb_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield pb_grpc.InferenceStub(channel)


def chat(model: str = "tiny", **fields: Any) -> pb.GenerateRequest:
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Weather in Oslo?")])
    return pb.GenerateRequest(model=model, messages=messages, **{"max_tokens": 128, **fields})


@pytest.mark.parametrize("model", ["tiny", "tooled"])
async def test_a_named_function_is_always_called(stub: pb_grpc.InferenceStub, model: str) -> None:
    tools = pb.Tools(tools=[WEATHER, TIME], function_name="get_weather")
    for seed in range(3):
        reply = await stub.Complete(chat(model, tools=tools, temperature=1.0, seed=seed))
        call = reply.final.tool_call
        assert call.name == "get_weather", reply.text
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
        assert call.id == f"call_{reply.request_id}_0"
        # The text is the call as generated.
        assert json.loads(reply.text)["arguments"] == json.loads(call.arguments)


async def test_required_streams_the_text_and_ends_with_the_call(
    stub: pb_grpc.InferenceStub,
) -> None:
    tools = pb.Tools(tools=[WEATHER, TIME], choice=pb.TOOL_CHOICE_REQUIRED)
    replies = [r async for r in stub.Generate(chat(tools=tools, temperature=0.8, seed=7))]
    text = "".join(r.text for r in replies)
    call = replies[-1].final.tool_call
    assert call.name in ("get_weather", "get_time")
    assert json.loads(text) == {"name": call.name, "arguments": json.loads(call.arguments)}


async def test_auto_text_is_no_call_and_none_leaves_tools_out(
    stub: pb_grpc.InferenceStub,
) -> None:
    # Random weights under auto almost never write a call: the answer is text, no call.
    reply = await stub.Complete(chat(tools=pb.Tools(tools=[WEATHER]), max_tokens=8))
    assert not reply.final.HasField("tool_call")
    with_tools = reply.final.usage.prompt_tokens
    none = pb.Tools(tools=[WEATHER], choice=pb.TOOL_CHOICE_NONE)
    reply = await stub.Complete(chat(tools=none, max_tokens=8))
    assert not reply.final.HasField("tool_call")
    # The fallback system message lists the tools; with "none" there is none.
    assert reply.final.usage.prompt_tokens < with_tools


async def test_the_template_renders_tools_and_history(
    stub: pb_grpc.InferenceStub, tooled: Path
) -> None:
    history = [
        pb.ChatMessage(role="user", content="Weather in Oslo?"),
        pb.ChatMessage(
            role="assistant",
            tool_calls=[pb.ToolCall(name="get_weather", arguments='{"city": "oslo"}', id="c1")],
        ),
        pb.ChatMessage(role="tool", tool_call_id="c1", content="4 C, rain"),
    ]
    request = pb.GenerateRequest(
        model="tooled",
        messages=pb.ChatMessages(messages=history),
        tools=pb.Tools(tools=[WEATHER]),
        max_tokens=4,
    )
    reply = await stub.Complete(request)
    text = ModelText.load(tooled)
    assert text.takes_tools
    spec = {"name": "get_weather", "description": "Weather of a city"}
    expected = text.encode_chat(
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "oslo"}},
                    }
                ],
            },
            {"role": "tool", "content": "4 C, rain", "tool_call_id": "c1"},
        ],
        tools=[{"type": "function", "function": {**spec, "parameters": WEATHER_PARAMETERS}}],
    )
    assert reply.final.usage.prompt_tokens == len(expected)


async def test_one_engine_answer_is_the_same_call_on_both_apis(
    stub: pb_grpc.InferenceStub, gateway: RunningGateway
) -> None:
    """One seeded answer, generated and replayed from the cache, read as a call by the pipeline:
    gRPC's Final.tool_call (text streamed as generated) and the HTTP API's tool_calls (no text),
    whole and streamed, name the same call with the same arguments."""
    question = "Weather in Bergen, once for each API?"
    grpc_ask = pb.GenerateRequest(
        model="tiny",
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=question)]),
        tools=pb.Tools(tools=[WEATHER, TIME], function_name="get_weather"),
        max_tokens=128,
        temperature=1.0,
        seed=5,
    )
    http_tools: list[dict[str, Any]] = [
        {"type": "function", "function": {"name": t.name, "description": t.description}}
        for t in (WEATHER, TIME)
    ]
    http_tools[0]["function"]["parameters"] = WEATHER_PARAMETERS
    http_ask: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": question}],
        "tools": http_tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 128,
        "temperature": 1.0,
        "seed": 5,
    }
    calls: list[tuple[str, Any]] = []
    tiers: list[str] = []

    generated = await stub.Complete(grpc_ask)
    call = generated.final.tool_call
    assert json.loads(generated.text) == {
        "name": call.name,
        "arguments": json.loads(call.arguments),
    }
    calls.append((call.name, json.loads(call.arguments)))
    tiers.append(generated.final.cache_tier_name)
    streamed = [r async for r in stub.Generate(grpc_ask)]
    call = streamed[-1].final.tool_call
    assert "".join(r.text for r in streamed) == generated.text
    calls.append((call.name, json.loads(call.arguments)))
    tiers.append(streamed[-1].final.cache_tier_name)

    assert gateway.http is not None
    url = f"http://127.0.0.1:{gateway.http.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        for policy in ("bypass", "default"):
            body = {**http_ask, "appliance": {"cache_policy": policy}}
            async with session.post(url, json=body) as r:
                whole = await r.json()
            choice = whole["choices"][0]
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
            (entry,) = choice["message"]["tool_calls"]
            assert entry["id"] == f"call_{whole['appliance']['request_id']}_0"
            calls.append((entry["function"]["name"], json.loads(entry["function"]["arguments"])))
            tiers.append(whole["appliance"]["cache_tier"])
        async with session.post(url, json={**http_ask, "stream": True}) as r:
            events = [
                json.loads(line[6:])
                for line in (await r.text()).split("\n\n")
                if line.startswith("data: {")
            ]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert not "".join(d.get("content") or "" for d in deltas)  # the call's text is held back
    (entry,) = [c for d in deltas for c in d.get("tool_calls") or ()]
    calls.append((entry["function"]["name"], json.loads(entry["function"]["arguments"])))
    tiers.append(events[-1]["appliance"]["cache_tier"])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

    assert tiers == ["miss", "l1", "miss", "l1", "l1"]
    assert calls == [calls[0]] * 5 and calls[0][0] == "get_weather"


BAD: list[tuple[pb.Tools, str]] = [
    (pb.Tools(tools=[pb.Tool()]), "tools.tools[0].name must be 1 to 64 letters"),
    (
        pb.Tools(tools=[pb.Tool(name="f", parameters='{"type": 3}')]),
        "tools.tools[0].parameters: the JSON Schema is not valid",
    ),
    (pb.Tools(tools=[pb.Tool(name="f", parameters="{")]), "tools.tools[0].parameters is not valid"),
    (pb.Tools(tools=[TIME] * 129), "at most 128"),
    (pb.Tools(tools=[TIME, TIME]), "the same function twice"),
    (
        pb.Tools(
            tools=[
                pb.Tool(
                    name=f"f{i}",
                    parameters=json.dumps({"type": "object", "description": "x" * 40_000}),
                )
                for i in range(2)
            ]
        ),
        "parameters schemas are",
    ),
    (pb.Tools(tools=[TIME], function_name="nope"), "names 'nope', which is not in tools.tools"),
    (pb.Tools(choice=pb.TOOL_CHOICE_REQUIRED), "needs tools"),
    (
        pb.Tools(tools=[TIME], choice=pb.TOOL_CHOICE_NONE, function_name="get_time"),
        "TOOL_CHOICE_NONE",
    ),
]


@pytest.mark.parametrize(("tools", "words"), BAD)
async def test_bad_tools_are_invalid_argument_saying_what_is_wrong(
    stub: pb_grpc.InferenceStub, tools: pb.Tools, words: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(chat(tools=tools))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (err.value.details() or "")


async def test_the_tools_schemas_are_bounded_before_every_one_is_checked(
    stub: pb_grpc.InferenceStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each schema is parsed and checked against its draft's metaschema: a message of many large
    ones is refused once those read pass the bound on them all, not after every one was checked."""
    checked: list[int] = []

    def counted(text: str) -> None:
        checked.append(len(text))
        check_json_schema(text)

    monkeypatch.setattr(tool_calls, "check_json_schema", counted)
    schema = json.dumps({"type": "object", "description": "x" * 30_000})
    tools = pb.Tools(tools=[pb.Tool(name=f"f{i}", parameters=schema) for i in range(128)])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(chat(tools=tools))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameters schemas are" in (err.value.details() or "")
    assert len(checked) <= 3  # 30 kB each: the third passes 64 KiB


async def test_tools_with_a_prompt_or_a_guide_are_refused(stub: pb_grpc.InferenceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(
            pb.GenerateRequest(model="tiny", prompt="hi", tools=pb.Tools(tools=[TIME]))
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "send messages" in (err.value.details() or "")
    forced = pb.Tools(tools=[TIME], choice=pb.TOOL_CHOICE_REQUIRED)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Complete(chat(tools=forced, guide=pb.Guide(type=pb.GUIDE_TYPE_JSON)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "drop the guide" in (err.value.details() or "")


# -- rendering, without servers --------------------------------------------------------------


def _prompt(text: ModelText, body: dict[str, Any]) -> str:
    http = wire.parse_request({"model": "m", **body}, chat=True)
    ids = tokenize(check(http.request, LIMITS), text, LIMITS).prompt_ids
    return str(text.tokenizer.decode(ids, skip_special_tokens=False))


HTTP_HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "4 C, rain"},
]
HTTP_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS},
}


def test_a_template_with_tools_renders_them_and_the_history(tiny: Tiny, tmp_path: Path) -> None:
    text = ModelText.load(tooled_dir(tiny, tmp_path))
    rendered = _prompt(text, {"messages": HTTP_HISTORY, "tools": [HTTP_TOOL]})
    assert "<|tools|>" in rendered and '"name": "get_weather"' in rendered
    assert '<tool_call>get_weather {"city": "oslo"}</tool_call>' in rendered
    assert "<|tool|>\nfor c1: 4 C, rain" in rendered
    assert "You can call tools" not in rendered  # no fallback system message


def test_a_template_without_tools_gets_the_fallback(tiny: Tiny) -> None:
    text = ModelText.load(tiny.tokenizer_dir)
    assert not text.takes_tools
    rendered = _prompt(text, {"messages": HTTP_HISTORY, "tools": [HTTP_TOOL]})
    assert rendered.count("<|system|>") == 1 and "You can call tools" in rendered
    assert '{"name": "get_weather", "arguments": {"city": "oslo"}}' in rendered
    assert "Result of tool call c1:\n4 C, rain" in rendered


def test_the_cache_key_tells_a_tool_message_from_its_fallback_text() -> None:
    """A user message written like the fallback's tool result is not the tool message: a template
    that takes tools renders the two differently, so their keys differ."""
    from appliance.gateway.pipeline import sampling_key

    tool = wire.parse_request({"model": "m", "messages": HTTP_HISTORY}, chat=True).request
    assert tool.tool_chat is not None
    written = tool.tool_chat.fallback()
    imitation = wire.parse_request(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": role_content[1]}
                if role_content[0] == "user"
                else {"role": role_content[0], "content": role_content[1]}
                for role_content in written
            ],
        },
        chat=True,
    ).request
    checked, imitated = check(tool, LIMITS), check(imitation, LIMITS)
    assert checked.messages == imitated.messages
    assert sampling_key(checked) != sampling_key(imitated)
