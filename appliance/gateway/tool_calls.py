"""OpenAI tool calling over a model that answers in text: at the HTTP edge, the tools become a guide
and a system message, and the answer becomes tool calls. Nothing behind the edge knows of tools.

- `tool_choice` "none" (or no tools): the tools are left out; the answer is text.
- "required", or a named function: decoding is constrained (a `json_schema` guide) to one JSON
  object `{"name": NAME, "arguments": {...}}` whose arguments follow that tool's `parameters`
  schema, so the answer is always one call of a listed tool (unless `max_tokens` cuts it short).
- "auto": the model chooses. A system message lists the tools and asks for such an object when a
  tool is wanted; an answer that is one such object naming a listed tool is a tool call, any
  other answer is text.

The tools are described to the model in a system message of this module's wording (the fallback
for chat templates without tool support, which is what every template gets here). In the history,
an assistant message's `tool_calls` are written as the objects the model would have produced, and a
`tool` message becomes a user message that names the call it answers, so any chat template renders
the conversation. The gRPC API has no tools: a gRPC client sends the guide and the prompt itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from appliance.gateway.errors import RequestError, invalid
from appliance.gateway.request import check_json_schema

# OpenAI's limits: tools per request and a function name's form.
MAX_TOOLS = 128
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
    """The request's `tools` and `tool_choice` checked; None when the answer is plain text."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice needs tools: send the tools it may call", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be an array of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are accepted", "tools")
    checked = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t.name for t in checked]
    if len(set(names)) != len(names):
        raise _bad("tools name the same function twice", "tools")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad(
                'tool_choice must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": NAME}}',
                "tool_choice",
            )
        if name not in names:
            raise _bad(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return ToolPlan(checked, name)
    if choice not in CHOICES:
        raise _bad(f"tool_choice {choice!r} is not one of {', '.join(CHOICES)}", "tool_choice")
    return ToolPlan(checked, str(choice))


def _tool(tool: object, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _bad(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{where}.function must be an object", where)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _bad(f"{where}.function.name must be 1 to 64 letters, digits, _ or -", where)
    description = function.get("description", "")
    if not isinstance(description, str):
        raise _bad(f"{where}.function.description must be a string", where)
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise _bad(f"{where}.function.parameters must be a JSON Schema object", where)
    try:
        check_json_schema(json.dumps(parameters))
    except RequestError as exc:
        raise _bad(f"{where}.function.parameters: {exc.message}", where) from None
    return Tool(name, description, parameters)


# -- history -------------------------------------------------------------------------------------


def assistant_content(message: dict[str, Any], text: str, i: int) -> str:
    """An assistant message's text with its `tool_calls` written as the model writes calls."""
    calls = message.get("tool_calls")
    if calls is None:
        return text
    if not isinstance(calls, list):
        raise _bad(f"messages[{i}].tool_calls must be an array", f"messages[{i}].tool_calls")
    written = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise _bad(
                f"messages[{i}].tool_calls[{j}] must be "
                '{"type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}',
                f"messages[{i}].tool_calls",
            )
        try:
            parsed = json.loads(arguments) if arguments else {}
        except ValueError:
            parsed = arguments  # written as the client sent it
        written.append(json.dumps({"name": name, "arguments": parsed}, ensure_ascii=False))
    return "\n".join(filter(None, [text, *written]))


def tool_result(message: dict[str, Any], text: str, i: int) -> str:
    """A `tool` message as a user message naming the call it answers."""
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        raise _bad(f"messages[{i}].tool_call_id must be a string", f"messages[{i}]")
    return f"Result of tool call {call_id}:\n{text}"


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


def call_entry(call: ToolCall, call_id: str, index: int | None = None) -> dict[str, Any]:
    """The call in OpenAI's shape (`index` for a streamed delta)."""
    entry: dict[str, Any] = {} if index is None else {"index": index}
    entry.update(
        {
            "id": call_id,
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
