"""Keys of a chat message or a tool's function that the appliance does not read are ignored, as
vLLM's OpenAI server and OpenAI's chat completions ignore them (vLLM refused them until clients
broke: vllm-project/vllm#10463): the openai SDK sends an answer back as history with `refusal`,
`annotations`, `audio` and `function_call`, LangChain sends `name`, editors their own ids. A key at
the top of the body is refused (test_http_api.py); one inside a message changes nothing."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessage

from appliance.gateway.server import RunningGateway
from tests.gateway.test_http_api import _client, gateway  # noqa: F401
from tests.gateway.test_structured_output import langchain_chat

TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
}


async def _answer(client: AsyncOpenAI, messages: list[Any], tools: list[Any]) -> str:
    reply = await client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=tools,
        max_tokens=8,
        temperature=0,
        extra_body={"appliance": {"cache_policy": "bypass"}},
    )
    return reply.choices[0].message.content or ""


async def test_sdk_history_extras_are_accepted_and_change_nothing(
    gateway: RunningGateway,  # noqa: F811
) -> None:
    said = ChatCompletionMessage(role="assistant", content="Hello there")
    plain = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Go on"},
    ]
    extras = [
        {"role": "user", "content": "Hi", "name": "alice", "id": 7, "opts": {"visible": False}},
        said.model_dump(),  # refusal, annotations, audio, function_call, tool_calls: null
        {"role": "user", "content": "Go on", "name": "alice"},
    ]
    strict = {**TOOL, "function": {**TOOL["function"], "strict": True, "x-origin": "editor"}}
    async with _client(gateway) as client:
        assert await _answer(client, extras, [strict]) == await _answer(client, plain, [TOOL])


async def test_langchain_history_is_accepted(gateway: RunningGateway) -> None:  # noqa: F811
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    llm = langchain_chat(gateway, 8)
    call = {"name": "f", "args": {}, "id": "call_1", "type": "tool_call"}
    history = [
        SystemMessage("Be brief"),
        HumanMessage("Hi", name="alice"),
        AIMessage("", tool_calls=[call], name="bot"),
        ToolMessage("42", tool_call_id="call_1", name="f"),
        HumanMessage("And?", name="alice"),
    ]
    answer = await llm.bind_tools([TOOL]).ainvoke(history)
    assert isinstance(answer, AIMessage)
