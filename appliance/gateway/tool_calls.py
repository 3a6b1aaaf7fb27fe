"""OpenAI tool calling over a model that answers in text. The front ends translate their tools into
a ToolPlan and their messages into a ToolChat (both front ends through `plan` and `turn`); the
answer is read back as a call once, in the pipeline. Behind the edges a tool chat is only a chat
to render.

- `tool_choice` "none" (or no tools): the tools are left out; the answer is text.
- "required", or a named function: decoding is constrained (a `json_schema` guide) to one JSON
  object `{"name": NAME, "arguments": {...}}` whose arguments follow that tool's `parameters`
  schema, so the answer is always one call of a listed tool (unless `max_tokens` cuts it short).
- "auto": the model chooses; an answer that is one such object naming a listed tool is a tool
  call, any other answer is text.

Reading (the pipeline's, for every front end: call_reader.py): an answer that is one call comes
back in the Final with its id; text that may still be a call is held back (HeldText) for a front
end whose wire format replaces a call's text (OpenAI's), and streams as generated for one that
sends both (the gRPC API's).

Rendering: a chat template that takes `tools` (its source names them, as Hugging Face templates
with tool support do) gets the tools as `tools=[{"type": "function", "function": {...}}]` and the
history as it came, at the tokenize stage with the model that generates: assistant messages with
`tool_calls`, `tool` messages with their `tool_call_id`. Any other template gets the fallback,
written at the check stage (where the cache key is made of it): a system message of this module's
wording that lists the tools and asks for the JSON object above, an assistant message's calls
written as the objects the model would have produced, and a `tool` message as a user message that
names the call it answers.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.gateway import json_steps
from appliance.gateway.errors import RequestError, invalid
from appliance.gateway.request import check_json_schema, check_role, echo, echo_value

# OpenAI's limits: tools per request and a function name's form.
MAX_TOOLS = 128
# Tool calls in a chat's history, all its messages together: each is parsed and written into the
# rendered chat before the prompt's length is known, so the count is checked before any is read.
MAX_PAST_CALLS = 2048
# Bytes of all the tools' parameters schemas together (JSON): a forced choice's guide holds them
# all, and a guide is bounded to this size.
MAX_SCHEMA_BYTES = 64 * 1024
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the answer."""

    tools: tuple[Tool, ...]
    # "auto", "required", or the one function's name that must be called.
    choice: str

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def forced(self) -> bool:
        """The answer must be a call (required or named): decoding is constrained to one."""
        return self.choice != "auto"

    def guide_schema(self) -> str | None:
        """The JSON Schema of the one call a forced choice allows (None for auto)."""
        if not self.forced:
            return None
        chosen = [t for t in self.tools if self.choice in ("required", t.name)]
        calls = [_call_schema(t) for t in chosen]
        return json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})

    def specs(self) -> list[dict[str, Any]]:
        """The tools as chat templates with tool support take them (OpenAI's shape)."""
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                },
            }
            for t in self.tools
        ]

    def system_message(self) -> str:
        listed = "\n".join(
            json.dumps(
                {"name": t.name, "description": t.description, "parameters": t.parameters},
                ensure_ascii=False,
            )
            for t in self.tools
        )
        when = (
            "You must call one of these tools."
            if self.forced
            else "When one of these tools would help, call it; otherwise answer normally."
        )
        return (
            f"You can call tools. {when} To call a tool, reply with only a JSON object "
            '{"name": <tool name>, "arguments": <arguments object>} and nothing else. '
            f"Tools:\n{listed}"
        )


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    # The id a later "tool" message names (call_id); "" until the answer's reader gives it one.
    id: str = ""


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _bad(message: str, param: str) -> RequestError:
    return invalid(message, field=param)


def plan(tools: object, choice: object) -> ToolPlan | None:
    """OpenAI's `tools` and `tool_choice` (JSON values) checked; None when the answer is plain
    text."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice needs tools: send the tools it may call", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be an array of function tools", "tools")
    check_count(len(tools), "tools")
    checked = within_schema_bytes((_tool(t, i) for i, t in enumerate(tools)), "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad(
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": NAME}}',
                "tool_choice",
            )
        return plan_of(checked, name, "tools", "tool_choice")
    if choice not in (*CHOICES, "none"):
        raise _bad(
            f"tool_choice {echo_value(choice)} is not one of {', '.join(CHOICES)}", "tool_choice"
        )
    return plan_of(checked, str(choice), "tools", "tool_choice")


def plan_of(tools: Sequence[Tool], choice: str, where: str, choice_field: str) -> ToolPlan | None:
    """Checked tools and a choice ("none", "auto", "required" or a tool's name) as a plan; None
    for "none". `where` and `choice_field` name the request's fields in a refusal."""
    check_count(len(tools), where)
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise _bad(f"{where} name the same function twice", where)
    within_schema_bytes(tools, where)
    if choice == "none":
        return None
    if choice not in CHOICES and choice not in names:
        raise _bad(f"{choice_field} names {echo(choice)}, which is not in {where}", choice_field)
    return ToolPlan(tuple(tools), choice)


def within_schema_bytes(tools: Iterable[Tool], where: str) -> list[Tool]:
    """The tools, each read (checked) only while those before it leave room under
    MAX_SCHEMA_BYTES: a request of many large schemas is refused once the bound is passed, not
    after every schema was parsed and checked."""
    read: list[Tool] = []
    size = 0
    for tool in tools:
        read.append(tool)
        size += len(json.dumps(tool.parameters))
        if size > MAX_SCHEMA_BYTES:
            raise _bad(
                f"the tools' parameters schemas are more than {MAX_SCHEMA_BYTES} bytes in all "
                f"({size} in the first {len(read)}); at most {MAX_SCHEMA_BYTES} are accepted",
                where,
            )
    return read


def check_count(count: int, where: str) -> None:
    if count > MAX_TOOLS:
        raise _bad(f"{where} holds {count} tools; at most {MAX_TOOLS} are accepted", where)


def check_past_calls(count: int) -> None:
    """Refuses a chat whose messages hold `count` tool calls in all, before any is read."""
    if count > MAX_PAST_CALLS:
        raise _bad(
            f"messages hold {count} tool calls; at most {MAX_PAST_CALLS} are accepted", "messages"
        )


def _tool(tool: object, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _bad(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{where}.function must be an object", where)
    name = function.get("name")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise _bad(f"{where}.function.description must be a string", where)
    return tool_of(name, description, function.get("parameters"), f"{where}.function")


def tool_of(name: object, description: str, parameters: object, where: str) -> Tool:
    """One tool checked: its name's form, its parameters a valid JSON Schema object (None: an
    object with any properties)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _bad(f"{where}.name must be 1 to 64 letters, digits, _ or -", where)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise _bad(f"{where}.parameters must be a JSON Schema object", where)
    try:
        check_json_schema(json.dumps(parameters))
    except RequestError as exc:
        raise _bad(f"{where}.parameters: {exc.message}", where) from None
    return Tool(name, description, parameters)


# -- history -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PastCall:
    """A call in the history (an assistant message's), as the client sent it."""

    name: str
    # JSON text as the client sent it (written as is where it does not parse).
    arguments: str
    id: str = ""

    def parsed_arguments(self) -> Any:
        """The arguments as a JSON value, or as the text they are where it does not parse;
        parsed anew at each call (the template's rendering is the only reader), in steps when
        long (json_steps), the event loop running between them."""
        try:
            return json_steps.loads(self.arguments) if self.arguments else {}
        except (ValueError, RecursionError):
            return self.arguments

    @functools.cached_property
    def _texts(self) -> tuple[str, str]:
        """The arguments as json.dumps writes their value: as parsed, and with sorted keys (the
        fallback's text and the key's), from one parse in steps that holds no large value."""
        if not self.arguments:
            return "{}", "{}"
        try:
            return json_steps.rewrite(self.arguments)
        except (ValueError, RecursionError):
            text = json_steps.string(self.arguments)
            return text, text

    def written(self) -> str:
        """The call as the fallback writes it: json.dumps of {"name", "arguments"}."""
        arguments = self._texts[0]
        return f'{{"name": {json.dumps(self.name, ensure_ascii=False)}, "arguments": {arguments}}}'

    def key_text(self) -> str:
        """The call as the chat's key writes it: json.dumps(sort_keys=True) of the call
        template_messages makes of it."""
        function = json_steps.sorted_object(
            {
                "name": json.dumps(self.name, ensure_ascii=False),
                "arguments": self._texts[1],
            }
        )
        return json_steps.sorted_object(
            {
                "id": json.dumps(self.id, ensure_ascii=False),
                "type": '"function"',
                "function": function,
            }
        )


@dataclass(frozen=True)
class Turn:
    """One message of a chat with tools: its role ("system", "user", "assistant" or "tool"), its
    text, an assistant message's calls, a tool message's call id."""

    role: str
    content: str
    calls: tuple[PastCall, ...] = ()
    call_id: str = ""


def turn(role: str, content: str, calls: Sequence[PastCall], call_id: str | None, i: int) -> Turn:
    """A message checked for its tool parts: a tool message names the call it answers."""
    if role == "tool":
        if not call_id:
            raise _bad(
                f"messages[{i}].tool_call_id is required: a tool message names the call it answers",
                f"messages[{i}]",
            )
        return Turn(role, content, call_id=call_id)
    check_role(i, role, ("tool",))
    if calls and role != "assistant":
        raise _bad(f"messages[{i}] has tool_calls; only an assistant message may", f"messages[{i}]")
    for j, call in enumerate(calls):
        if not call.name:
            raise _bad(
                f"messages[{i}].tool_calls[{j}] needs the name of the function",
                f"messages[{i}].tool_calls",
            )
    return Turn(role, content, tuple(calls))


def has_tool_parts(turns: Sequence[Turn]) -> bool:
    return any(t.calls or t.role == "tool" for t in turns)


@dataclass(frozen=True)
class ToolChat:
    """A chat request with tools or a history of tool calls: rendered with the model's chat
    template by the tokenize stage when the template takes tools, else as `fallback()` (written
    by the check stage)."""

    plan: ToolPlan | None
    turns: tuple[Turn, ...]
    # The canonical text of everything above (what the cache key holds).
    key: str = field(default="", compare=False)

    def chars(self) -> int:
        """Characters of the chat as the client sent it: its messages' text, its calls' names and
        arguments, the call ids its tool messages name. Counted before any call's arguments are
        parsed (fallback, with_text parse them all), to bound the chat's size first."""
        return sum(
            len(t.content) + len(t.call_id) + sum(len(c.name) + len(c.arguments) for c in t.calls)
            for t in self.turns
        )

    def fallback(self) -> list[tuple[str, str]]:
        """The chat for any template: (role, content) with roles system, user and assistant."""
        pairs: list[tuple[str, str]] = []
        for t in self.turns:
            if t.role == "tool":
                pairs.append(("user", f"Result of tool call {t.call_id}:\n{t.content}"))
            elif t.calls:
                written = [c.written() for c in t.calls]
                pairs.append((t.role, "\n".join(filter(None, [t.content, *written]))))
            else:
                pairs.append((t.role, t.content))
        if self.plan is not None and pairs:
            if pairs[0][0] == "system":
                pairs[0] = ("system", self.plan.system_message() + "\n\n" + pairs[0][1])
            else:
                pairs.insert(0, ("system", self.plan.system_message()))
        return pairs

    def template_messages(self) -> list[dict[str, Any]]:
        """The chat as Hugging Face chat templates with tool support take it."""
        messages: list[dict[str, Any]] = []
        for t in self.turns:
            message: dict[str, Any] = _message_fields(t)
            if t.calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.parsed_arguments()},
                    }
                    for c in t.calls
                ]
            messages.append(message)
        return messages

    def tool_specs(self) -> list[dict[str, Any]] | None:
        return self.plan.specs() if self.plan is not None else None

    def with_text(self, normalize: Callable[[str], str]) -> ToolChat:
        """The chat with every message's text normalized (the check stage's NFC), and its key."""
        turns = tuple(Turn(t.role, normalize(t.content), t.calls, t.call_id) for t in self.turns)
        chat = ToolChat(self.plan, turns)
        return ToolChat(self.plan, turns, chat._key())

    def _key(self) -> str:
        """json.dumps(sort_keys=True) of the tools, the choice and template_messages(), written a
        message and a past call at a time (each call's arguments from their one parse, in steps
        when long), so that no one call holds the event loop long."""
        messages = []
        for t in self.turns:
            written = {name: json_steps.string(value) for name, value in _message_fields(t).items()}
            if t.calls:
                written["tool_calls"] = "[" + ", ".join(c.key_text() for c in t.calls) + "]"
            messages.append(json_steps.sorted_object(written))
        return json_steps.sorted_object(
            {
                "tools": json.dumps(self.tool_specs(), ensure_ascii=False, sort_keys=True),
                "choice": json.dumps(self.plan.choice if self.plan else "none"),
                "messages": "[" + ", ".join(messages) + "]",
            }
        )


def _message_fields(t: Turn) -> dict[str, str]:
    """A message's fields as template_messages writes them, but its calls."""
    fields = {"role": t.role, "content": t.content}
    if t.role == "tool":
        fields["tool_call_id"] = t.call_id
    return fields


# -- answer --------------------------------------------------------------------------------------


def parse_call(text: str, tool_plan: ToolPlan) -> ToolCall | None:
    """The call an answer makes: one JSON object naming a listed tool with object arguments."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        return None
    try:
        value = json.loads(stripped)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    name, arguments = value["name"], value["arguments"]
    if name not in tool_plan.names or not isinstance(arguments, dict):
        return None
    return ToolCall(name, arguments)


def call_id(request_id: str) -> str:
    """The id of the call an answer makes (one call per answer)."""
    return f"call_{request_id}_0"


def call_entry(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """The call in OpenAI's shape (`index` for a streamed delta)."""
    entry: dict[str, Any] = {} if index is None else {"index": index}
    entry.update(
        {
            "id": call.id,
            "type": "function",
            "function": {
                "name": call.name,
                "arguments": json.dumps(call.arguments, ensure_ascii=False),
            },
        }
    )
    return entry


class HeldText:
    """A streamed answer's text held back while it may still be a tool call: all of it when a call
    is forced; under auto, until its first visible character shows it is not a JSON object."""

    def __init__(self, tool_plan: ToolPlan) -> None:
        self.plan = tool_plan
        self._held: list[str] = []
        self._holding = True

    def feed(self, text: str) -> str:
        """The text to send now ("" while held)."""
        if not self._holding:
            return text
        self._held.append(text)
        if self.plan.forced:
            return ""
        seen = "".join(self._held).lstrip()
        if not seen or seen.startswith("{"):
            return ""
        self._holding = False
        return self.release()

    def release(self) -> str:
        held, self._held = "".join(self._held), []
        return held

    def finish(self) -> tuple[str, ToolCall | None]:
        """At the end: (text still to send, the call the whole answer makes)."""
        if not self._holding:
            return "", None
        held = self.release()
        call = parse_call(held, self.plan)
        return ("", call) if call is not None else (held, None)
