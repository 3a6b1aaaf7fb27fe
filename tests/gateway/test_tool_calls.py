"""Tools at the HTTP edge: checked, turned into a guide and a system message, the history written
for any chat template, and an answer read back as a call."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.gateway import openai_wire as wire
from appliance.gateway.tool_calls import HeldText, ToolCall, parse_call, plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields: Any) -> wire.HttpRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return wire.parse_request(body, chat=True)


def test_auto_adds_a_system_message_and_no_guide() -> None:
    http = chat(tools=[WEATHER, TIME])
    assert http.tools is not None and http.tools.choice == "auto"
    assert http.request.messages is not None
    role, content = http.request.messages[0]
    assert role == "system" and '"name": "get_weather"' in content
    assert http.request.guide is None


def test_a_forced_choice_constrains_the_answer_to_a_call() -> None:
    http = chat(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert http.request.guide is not None and http.request.guide.kind == "json_schema"
    schema = json.loads(http.request.guide.text)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"]["required"] == ["city"]
    required = chat(tools=[WEATHER, TIME], tool_choice="required")
    assert required.request.guide is not None
    assert len(json.loads(required.request.guide.text)["anyOf"]) == 2


def test_an_existing_system_message_keeps_its_text_after_the_tools() -> None:
    http = chat(
        tools=[TIME],
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    )
    messages = http.request.messages
    assert messages is not None and [role for role, _ in messages] == ["system", "user"]
    assert messages[0][1].endswith("\n\nBe brief.")


def test_none_leaves_the_tools_out() -> None:
    http = chat(tools=[WEATHER], tool_choice="none")
    assert http.tools is None and http.request.messages is not None
    assert len(http.request.messages) == 1


def test_the_history_is_written_for_any_template() -> None:
    http = chat(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "4 C, rain"},
        ],
    )
    assert http.request.messages is not None
    roles = list(http.request.messages)
    assert roles[2] == ("assistant", '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert roles[3] == ("user", "Result of tool call call_1:\n4 C, rain")


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": {"x": 1}}, "tools must be an array"),
    ({"tools": [{"type": "function"}]}, "tools[0].function must be an object"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
        "tools[0].function.parameters: the JSON Schema is not valid",
    ),
    ({"tools": [TIME, TIME]}, "the same function twice"),
    ({"tools": [TIME], "tool_choice": "always"}, "tool_choice 'always' is not one of"),
    (
        {"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice names 'nope', which is not in tools",
    ),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [TIME] * 129}, "at most 128"),
    (
        {"tools": [TIME], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "drop response_format",
    ),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_bad_tools_are_refused_with_what_to_fix(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(wire.HttpError) as err:
        chat(**fields)
    assert err.value.status == 400 and message in err.value.message


def test_an_answer_is_a_call_only_as_one_object_naming_a_listed_tool() -> None:
    tools = plan([WEATHER], "auto")
    assert tools is not None
    assert parse_call(
        ' {"name": "get_weather", "arguments": {"city": "Oslo"}} ', tools
    ) == ToolCall("get_weather", {"city": "Oslo"})
    for text in (
        "It is sunny.",
        '{"name": "other", "arguments": {}}',
        '{"name": "get_weather", "arguments": "x"}',
        '{"name": "get_weather", "arguments": {}, "extra": 1}',
        '{"name": "get_weather", "arguments": {',
    ):
        assert parse_call(text, tools) is None, text


def test_streamed_text_is_held_only_while_it_may_be_a_call() -> None:
    auto = plan([WEATHER], "auto")
    assert auto is not None
    held = HeldText(auto)
    assert held.feed("  ") == ""
    assert held.feed("It") == "  It"
    assert held.feed(" is") == " is"
    assert held.finish() == ("", None)

    held = HeldText(auto)
    assert held.feed('{"name": "get_weather", ') == ""
    assert held.feed('"arguments": {"city": "Oslo"}}') == ""
    assert held.finish() == ("", ToolCall("get_weather", {"city": "Oslo"}))

    held = HeldText(auto)
    assert held.feed("{not a call") == ""
    assert held.finish() == ("{not a call", None)
