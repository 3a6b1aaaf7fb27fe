"""Tools at the HTTP edge: checked, turned into a guide and a system message, the history written
for any chat template; an answer read back as a call by the pipeline's reader, and that call in
both front ends' wire formats."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

from appliance.gateway import json_steps, messages, tool_calls
from appliance.gateway import openai_wire as wire
from appliance.gateway.call_reader import CallReader
from appliance.gateway.errors import CONTEXT_LENGTH_EXCEEDED, RequestError
from appliance.gateway.generation import Delta
from appliance.gateway.models import load_models
from appliance.gateway.reply import Final, Reply
from appliance.gateway.request import IncomingRequest, Limits, check
from appliance.gateway.server import start_server
from appliance.gateway.tool_calls import HeldText, ToolCall, parse_call, plan
from appliance.text.tokenizer import INLINE_CHARS
from appliance.v1 import inference_pb2 as pb
from tests.conftest import Engine, Tiny
from tests.gateway.test_http_api import _config, _post

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


def written(http: wire.HttpRequest) -> list[tuple[str, str]]:
    """The chat as the check stage writes it for any template."""
    assert http.request.messages is None and http.request.tool_chat is not None
    return http.request.tool_chat.fallback()


def test_auto_adds_a_system_message_and_no_guide() -> None:
    http = chat(tools=[WEATHER, TIME])
    tool_chat = http.request.tool_chat
    assert tool_chat is not None and tool_chat.plan is not None
    assert tool_chat.plan.choice == "auto"
    role, content = written(http)[0]
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
    messages = written(http)
    assert [role for role, _ in messages] == ["system", "user"]
    assert messages[0][1].endswith("\n\nBe brief.")


def test_none_leaves_the_tools_out() -> None:
    http = chat(tools=[WEATHER], tool_choice="none")
    assert http.request.tool_chat is None and http.request.messages is not None
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
    roles = written(http)
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


# -- the pipeline's reader, translated by both front ends ----------------------------------------

CALL_TEXT = ['{"name": "get_', 'weather", "arguments": ', '{"city": "Oslo"}}']


def _final(request_id: str = "r1") -> Final:
    return Final(request_id, "stop", 5, 3, 1, 2, 3, "miss", "tiny", False, 0.0, "")


def _read(reader: CallReader, texts: list[str]) -> list[Reply]:
    out: list[Reply] = []
    for i, text in enumerate(texts):
        out += reader.read(Delta(text, [i]))
    return out + list(reader.read(_final()))


def _reader(hold: bool, choice: str = "auto", request_id: str = "r1") -> CallReader:
    http = chat(tools=[WEATHER, TIME], tool_choice=choice)
    assert http.request.tool_chat is not None
    reader = CallReader.of(http.request.tool_chat, request_id, hold)
    assert reader is not None
    return reader


def test_no_tools_no_reader() -> None:
    assert CallReader.of(None, "r1", hold=True) is None
    none = chat(tools=[WEATHER], tool_choice="none").request.tool_chat
    assert CallReader.of(none, "r1", hold=True) is None


@pytest.mark.parametrize("hold", [False, True])
def test_one_answer_is_the_same_call_in_both_wire_formats(hold: bool) -> None:
    """The reader's Final, translated by the gRPC messages and by the HTTP answer, names the same
    call with the same arguments and id; held or not, token ids all come through."""
    replies = _read(_reader(hold), CALL_TEXT)
    final = replies[-1]
    assert isinstance(final, Final)
    assert final.tool_call == ToolCall("get_weather", {"city": "Oslo"}, "call_r1_0")
    deltas = [r for r in replies if isinstance(r, Delta)]
    assert [t for d in deltas for t in d.token_ids] == [0, 1, 2]
    text = "".join(d.text for d in deltas)
    assert text == ("" if hold else "".join(CALL_TEXT))

    grpc_call = messages.final(final).final.tool_call
    answer = wire.Answer(chat(tools=[WEATHER]), "r1", 1).whole(text, final)
    (http_call,) = answer["choices"][0]["message"]["tool_calls"]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert answer["choices"][0]["message"]["content"] is None
    assert (grpc_call.name, grpc_call.id) == (http_call["function"]["name"], http_call["id"])
    assert json.loads(grpc_call.arguments) == json.loads(http_call["function"]["arguments"])


def test_held_text_that_is_no_call_comes_before_the_final() -> None:
    shared = Delta("{not", [0])
    replies = _read(_reader(hold=True), ["  ", "It", " is"])
    assert [r.text for r in replies if isinstance(r, Delta)] == ["", "  It", " is"]
    reader = _reader(hold=True)
    replies = [*reader.read(shared), *reader.read(Delta(" a call", [1])), *reader.read(_final())]
    assert shared.text == "{not"  # a delta other clients follow is never changed
    assert [r.text for r in replies if isinstance(r, Delta)] == ["", "", "{not a call"]
    final = replies[-1]
    assert isinstance(final, Final) and final.tool_call is None
    assert not messages.final(final).final.HasField("tool_call")


def test_a_forced_call_cut_short_is_text() -> None:
    for hold in (False, True):
        replies = _read(_reader(hold, "required"), CALL_TEXT[:2])
        final = replies[-1]
        assert isinstance(final, Final) and final.tool_call is None
        assert "".join(r.text for r in replies if isinstance(r, Delta)) == "".join(CALL_TEXT[:2])


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [TIME], "tool_choice": "x" * 100_000},
        {"tools": [TIME], "tool_choice": ["x" * 1000] * 100},
        {"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "y" * 100_000}}},
    ],
)
def test_a_refusal_repeats_at_most_a_short_piece_of_what_the_client_sent(
    fields: dict[str, Any],
) -> None:
    with pytest.raises(wire.HttpError) as err:
        chat(**fields)
    assert err.value.status == 400 and err.value.param == "tool_choice"
    assert len(err.value.message) < 400, len(err.value.message)


# -- past calls: parsed once, and only once the chat's size is known to fit -----------------------


class CountingJson:
    """json_steps' `json` (what parses a past call's arguments), counting the characters it is
    given to parse."""

    def __init__(self) -> None:
        self.parsed = 0

    def loads(self, text: str) -> Any:
        self.parsed += len(text)
        return json.loads(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(json, name)


ARGUMENTS = json.dumps({"rows": list(range(2000))})


def long_history(calls: int) -> tuple[dict[str, Any], pb.GenerateRequest]:
    """An assistant turn of `calls` calls with the same arguments, as an HTTP body and a gRPC
    message."""
    body = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": "Sum them"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": f"c{i}", "function": {"name": "f", "arguments": ARGUMENTS}}
                    for i in range(calls)
                ],
            },
            {"role": "tool", "tool_call_id": "c0", "content": "done"},
        ],
    }
    grpc_calls = [pb.ToolCall(name="f", arguments=ARGUMENTS, id=f"c{i}") for i in range(calls)]
    message = pb.GenerateRequest(
        model="tiny",
        messages=pb.ChatMessages(
            messages=[
                pb.ChatMessage(role="user", content="Sum them"),
                pb.ChatMessage(role="assistant", tool_calls=grpc_calls),
                pb.ChatMessage(role="tool", tool_call_id="c0", content="done"),
            ]
        ),
    )
    return body, message


def received(
    body: dict[str, Any], message: pb.GenerateRequest
) -> list[Callable[[], IncomingRequest]]:
    """Each front end's reading of the same chat."""
    return [
        lambda: wire.parse_request(body, chat=True).request,
        lambda: messages.request_of(message),
    ]


def test_past_calls_over_the_input_bound_are_refused_before_any_is_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each past call's arguments are parsed to be written into the chat: a history over what the
    model can take is refused for its size before any of them is parsed, on both front ends."""
    counting = CountingJson()
    monkeypatch.setattr(json_steps, "json", counting)
    limits = Limits(
        max_input_tokens=100,
        max_output_tokens=16,
        default_max_tokens=16,
        context_length=128,
        max_input_chars=10_000,
    )
    for receive in received(*long_history(50)):
        with pytest.raises(RequestError) as err:
            check(receive(), limits)
        assert err.value.reason == CONTEXT_LENGTH_EXCEEDED
        assert counting.parsed == 0


def test_each_past_call_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chat is written for any template and keyed for the cache from one parse of each."""
    counting = CountingJson()
    monkeypatch.setattr(json_steps, "json", counting)
    limits = Limits(
        max_input_tokens=100_000,
        max_output_tokens=16,
        default_max_tokens=16,
        context_length=200_000,
    )
    for receive in received(*long_history(3)):
        counting.parsed = 0
        checked = check(receive(), limits)
        assert checked.tool_chat is not None and checked.tool_chat.key
        assert checked.messages[1] == (
            "assistant",
            "\n".join([f'{{"name": "f", "arguments": {ARGUMENTS}}}'] * 3),
        )
        assert counting.parsed == 3 * len(ARGUMENTS)


async def test_a_long_tool_chat_is_written_on_a_worker_thread(
    tiny: Tiny, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing a chat's past calls (parsing their arguments, writing them back, keying the chat)
    costs in proportion to the arguments: a long tool chat is written on the tokenizer threads,
    and the event loop answers other requests meanwhile."""
    rendering, may_finish = threading.Event(), threading.Event()
    threads: dict[str, str] = {}
    answered_meanwhile: list[bool] = []
    fallback, with_text = tool_calls.ToolChat.fallback, tool_calls.ToolChat.with_text

    def held_fallback(chat: tool_calls.ToolChat) -> list[tuple[str, str]]:
        threads["fallback"] = threading.current_thread().name
        rendering.set()
        # Released once another request was answered; a loop held here answers none (the
        # timeout only ends the test's wait on today's failure).
        answered_meanwhile.append(may_finish.wait(timeout=10))
        return fallback(chat)

    def recorded_with_text(
        chat: tool_calls.ToolChat, normalize: Callable[[str], str]
    ) -> tool_calls.ToolChat:
        threads["with_text"] = threading.current_thread().name
        return with_text(chat, normalize)

    monkeypatch.setattr(tool_calls.ToolChat, "fallback", held_fallback)
    monkeypatch.setattr(tool_calls.ToolChat, "with_text", recorded_with_text)
    config = _config(tiny, engine.address)
    running = await start_server(config, await load_models(config))
    try:
        arguments = json.dumps({"text": "word " * 1700})  # fits the tiny model's input
        assert len(arguments) > INLINE_CHARS
        body = {
            "model": "tiny",
            "messages": [
                {"role": "user", "content": "Count them"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c0", "function": {"name": "f", "arguments": arguments}}],
                },
                {"role": "tool", "tool_call_id": "c0", "content": "done"},
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "max_tokens": 4,
        }
        posting = asyncio.ensure_future(
            _post(running, "/v1/chat/completions", json.dumps(body).encode())
        )
        await asyncio.to_thread(rendering.wait)
        short = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, _, reply = await _post(running, "/v1/chat/completions", json.dumps(short).encode())
        assert status == 200, reply
        may_finish.set()
        status, _, reply = await posting
        assert status == 200, reply
    finally:
        may_finish.set()
        await running.drain(0.5)
    assert answered_meanwhile == [True]
    loop_thread = threading.current_thread().name
    assert threads["fallback"] != loop_thread and threads["fallback"].startswith("tokenize")
    assert threads["with_text"] == threads["fallback"]
