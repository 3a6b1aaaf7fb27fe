"""Structured output and tools end to end: clients nobody here wrote (the openai SDK, LangChain) ask
the gateway for JSON under a schema or a tool call, the engine server decodes under the guide, and
the answer parses. The tiny model's weights are random: only the grammar makes its answers valid."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import jsonschema
import openai
import pydantic
import pytest
from openai import omit
from openai.types.chat import (
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
)
from openai.types.shared_params import ResponseFormatJSONSchema

from appliance.config import HttpConfig, ServerConfig
from appliance.gateway.models import load_models
from appliance.gateway.server import RunningGateway, start_server
from engine_build.repo import write_hf_repository
from tests.conftest import Engine, Tiny
from tests.support import gateway_config

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "rank"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS: dict[str, object] = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
async def served(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    from appliance.engine.server import load_repository, start_engine

    repo = write_hf_repository(tiny.model_dir, tmp_path_factory.mktemp("guided") / "repo")
    models = load_repository(repo)
    server, _, port = await start_engine(models, "127.0.0.1:0")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)
        for m in models.values():
            m.runner.close()


@pytest.fixture(scope="module")
async def gateway(tiny: Tiny, served: str, engine: Engine) -> AsyncIterator[RunningGateway]:
    """`tiny` decodes under guides; `plain` is the shared engine's model, without them."""
    config = gateway_config(
        tiny.tokenizer_dir,
        {"tiny": served, "plain": engine.address},
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
def client(gateway: RunningGateway) -> openai.AsyncOpenAI:
    assert gateway.http is not None
    base = f"http://127.0.0.1:{gateway.http.port}/v1"
    return openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)


def _schema_format(schema: dict[str, object]) -> ResponseFormatJSONSchema:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


async def test_every_sampled_answer_under_a_schema_validates(client: openai.AsyncOpenAI) -> None:
    for seed in range(8):
        reply = await client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=256,
            temperature=1.0,
            seed=seed,
            response_format=_schema_format(SCHEMA),
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


async def test_json_object_and_a_streamed_schema(client: openai.AsyncOpenAI) -> None:
    # Any object: random weights may write one string until max_tokens ends it (length); every
    # answer that ends by itself is an object.
    finishes = []
    for seed in range(8):
        reply = await client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=256,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_object"},
        )
        choice = reply.choices[0]
        finishes.append(choice.finish_reason)
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content or ""), dict)
    assert finishes.count("stop") >= 4, finishes
    stream = await client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=256,
        temperature=0.7,
        seed=3,
        stream=True,
        response_format=_schema_format(SCHEMA),
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    jsonschema.validate(json.loads(text), SCHEMA)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^[A-Za-z]{1,10}$")
    population: int = pydantic.Field(ge=0, le=1000)


async def test_the_sdks_parse_helper_gets_its_model(client: openai.AsyncOpenAI) -> None:
    reply = await client.beta.chat.completions.parse(
        model="tiny",
        messages=CHAT,
        max_tokens=256,
        temperature=0,
        response_format=City,
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, City)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_required_tool_choice_is_always_a_call(
    client: openai.AsyncOpenAI, stream: bool
) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather?"}]
    if stream:
        chunks = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=128,
            temperature=1.0,
            seed=11,
            tools=[WEATHER],
            tool_choice="required",
            stream=True,
        )
        calls: dict[int, dict[str, str]] = {}
        finish = None
        async for chunk in chunks:
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(delta_call.index, {"name": "", "arguments": ""})
                assert delta_call.function is not None
                entry["name"] += delta_call.function.name or ""
                entry["arguments"] += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and len(calls) == 1
        name, arguments = calls[0]["name"], calls[0]["arguments"]
    else:
        reply = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=128,
            temperature=1.0,
            seed=11,
            tools=[WEATHER],
            tool_choice="required",
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert isinstance(call, ChatCompletionMessageFunctionToolCall), call
        name, arguments = call.function.name, call.function.arguments
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
        ({"appliance": {"guide": {"type": "json"}}}, "appliance.guide"),
    ],
)
async def test_a_guide_for_a_model_without_guided_decoding_is_400(
    client: openai.AsyncOpenAI, fields: dict[str, object], param: str
) -> None:
    """The refusal names the model the client asked for (not the engine's) and the field the
    guide came from."""
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="plain", messages=CHAT, max_tokens=8, extra_body=fields
        )
    assert isinstance(err.value.body, dict)
    assert err.value.body["message"].startswith("model 'plain' has no guided decoding"), err
    assert err.value.body["param"] == param


@pytest.mark.parametrize(
    ("guide", "says"),
    [
        (
            {"type": "ebnf_grammar", "guide": "root ::= undefined"},
            'Rule "undefined" is not defined',
        ),
        ({"type": "ebnf_grammar", "guide": 'x ::= "a"'}, 'root rule with name "root"'),
        ({"type": "json_schema", "guide": '{"type": "foo"}'}, "not valid"),
    ],
)
async def test_a_guide_the_engine_cannot_compile_is_400_saying_why(
    client: openai.AsyncOpenAI, guide: dict[str, str], says: str
) -> None:
    """A grammar only the engine's compiler checks is the client's fault, never a 500."""
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=8, extra_body={"appliance": {"guide": guide}}
        )
    assert isinstance(err.value.body, dict)
    assert says in err.value.body["message"], err.value.body
    assert err.value.body["param"] == "appliance.guide"


async def test_a_guided_answer_is_cached_under_its_guide(client: openai.AsyncOpenAI) -> None:
    replies = [
        await client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=64, temperature=0, response_format=guide
        )
        for guide in (omit, _schema_format(SCHEMA), _schema_format(SCHEMA))
    ]
    tiers = []
    for reply in replies:
        assert reply.model_extra is not None
        tiers.append(reply.model_extra["appliance"]["cache_tier"])
    assert tiers == ["miss", "miss", "l1"]
    jsonschema.validate(json.loads(replies[2].choices[0].message.content or ""), SCHEMA)


def langchain_chat(gateway: RunningGateway, max_tokens: int) -> ChatOpenAI:
    """LangChain's OpenAI chat model, greedy, on the gateway's HTTP API."""
    from langchain_openai import ChatOpenAI

    assert gateway.http is not None
    return ChatOpenAI(
        model="tiny",
        base_url=f"http://127.0.0.1:{gateway.http.port}/v1",
        api_key=pydantic.SecretStr("unused"),
        max_retries=0,
        temperature=0,
        max_completion_tokens=max_tokens,
    )


async def test_langchain_structured_output_and_tools(gateway: RunningGateway) -> None:
    llm = langchain_chat(gateway, 256)
    city = await llm.with_structured_output(City).ainvoke("A city?")
    assert isinstance(city, City)
    message = await llm.bind_tools([dict(WEATHER)], tool_choice="required").ainvoke("Weather?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
