"""The OpenAI-compatible HTTP API's wire format: JSON bodies in, the pipeline's replies out.

Pure logic, no I/O. A request body becomes the same `IncomingRequest` the gRPC front end makes, so
the pipeline's check stage validates both front ends with the same messages; this module only checks
what JSON can get wrong and the gRPC API cannot (types, ranges of the gRPC messages' integer fields,
text that is not valid Unicode, fields the appliance does not implement). Answers are rendered with pre-encoded heads and tails, so a
streamed token costs one `json.dumps` of its text.

Field policy, documented in the README: an unknown field is refused (as OpenAI's own API does); an
OpenAI field the appliance does not implement is accepted only at its no-op value (`n: 1`,
`best_of: 1`, penalties 0, ...), since anything else would silently change the answer; `user`,
`safety_identifier`, `prompt_cache_key`, `metadata`, `store` and `service_tier` are accepted (of
their type) and ignored. Keys inside a message or a tool's function that are not read are ignored
(clients send their own: the SDK's `refusal`, `annotations`, `audio`; LangChain's `name`), as vLLM
and OpenAI's chat completions ignore them. The appliance's own fields ride in
an `"appliance"` object (the `openai` SDK sends it with `extra_body`); the answer's extras come back
in an `"appliance"` object too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from appliance.backends.base import Guide
from appliance.cache.policy import CachePolicy
from appliance.gateway import tool_calls
from appliance.gateway.errors import CONTEXT_LENGTH_EXCEEDED, MODEL_NOT_FOUND, RequestError
from appliance.gateway.generation import Delta, TokenLogprob
from appliance.gateway.reply import Final
from appliance.gateway.request import (
    ECHO_CHARS,
    GUIDE_KINDS,
    MAX_TOP_LOGPROBS,
    IncomingRequest,
    echo_name,
    echo_value,
    too_many_messages,
)
from appliance.gateway.tool_calls import ToolCall, ToolPlan, call_entry
from appliance.grpc_limits import INT32_MAX, UINT32_MAX

UINT64_MAX = 2**64 - 1
CACHE_POLICIES = {p.name.lower(): p.value for p in CachePolicy}
# Roles the chat template knows; OpenAI's "developer" role is its system role.
ROLE_ALIASES = {"developer": "system"}

# Accepted and ignored, with the JSON type each must have: they never change the answer
# (`safety_identifier` and `prompt_cache_key` are the SDK's successors of `user`).
IGNORED: dict[str, type] = {
    "user": str,
    "safety_identifier": str,
    "prompt_cache_key": str,
    "metadata": dict,
    "store": bool,
    "service_tier": str,
}
# stream_options fields: include_usage, vLLM's continuous_usage_stats (every chunk carries the
# usage so far), and OpenAI's padding of chunks against length side channels (accepted and
# ignored: no chunk here carries `obfuscation`).
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")
# OpenAI fields the appliance does not implement, with the value(s) that mean "off".
NO_OP: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None,),
    "functions": (None,),
    "function_call": (None, "none"),
    "echo": (False, None),
    "best_of": (1, None),
    "suffix": (None,),
}
COMMON = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "appliance",
        "response_format",
        "logprobs",
        "min_tokens",
        "ignore_eos",
        *IGNORED,
        *NO_OP,
    }
)
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "top_logprobs",
}
COMPLETION_FIELDS = COMMON | {"prompt"}
EXTENSION_FIELDS = frozenset(
    {
        "request_id",
        "namespace",
        "cache_policy",
        "semantic_cache",
        "top_k",
        "ttft_budget_ms",
        "deadline_ms",
        "guide",
        "speculation",
    }
)
JSON_OBJECT = json.dumps({"type": "object"})
# appliance.guide's types (the gRPC API's GuideType by its engine name).
GUIDE_TYPES = GUIDE_KINDS


def invalid(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, "invalid_request_error", message, param)


class HttpError(Exception):
    """An HTTP request refused before it reaches the pipeline (its body cannot be a request), or a
    pipeline refusal in OpenAI's terms (`error_of`)."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.param, self.code = param, code
        # When the client may retry (Retry-After); None: no hint.
        self.retry_after_ms = retry_after_ms


@dataclass(frozen=True)
class HttpRequest:
    """A decoded body: the pipeline's request and what only the HTTP answer needs."""

    request: IncomingRequest
    chat: bool
    stream: bool
    include_usage: bool
    # Seconds the client gives the request (appliance.deadline_ms); None: the model's default.
    deadline_s: float | None
    # The body's field the request's guide came from (`param` of a refused guide); None: none.
    guide_field: str | None = None
    # The body's field the answer's length came from: a chat may send `max_completion_tokens`.
    max_tokens_field: str = "max_tokens"
    # Every chunk carries the usage so far (vLLM's stream_options.continuous_usage_stats).
    continuous_usage: bool = False


# -- request -----------------------------------------------------------------------------------


def parse_request(data: dict[str, Any], chat: bool) -> HttpRequest:
    """A chat (`/v1/chat/completions`) or completion (`/v1/completions`) body as a request; a
    refusal by a check both front ends share (`tool_calls`) as its HTTP error."""
    try:
        http = _parse(data, chat)
    except RequestError as exc:
        raise error_of(exc, chat) from None
    _unicode(http)
    return http


def _unicode(http: HttpRequest) -> None:
    """JSON can escape half a UTF-16 pair ("\ud800"), which no UTF-8 text holds: the gRPC API
    cannot carry it, nor can the tokenizer or the cache key. The refusal names the body's field."""
    req = http.request
    texts = [
        ("model", req.model),
        ("appliance.request_id", req.request_id),
        ("appliance.namespace", req.namespace),
        *(("stop", s) for s in req.stop),
    ]
    if req.prompt is not None:
        texts.append(("prompt", req.prompt))
    chat = req.tool_chat
    if chat is None:
        for i, (role, content) in enumerate(req.messages or ()):
            texts += ((f"messages[{i}].role", role), (f"messages[{i}].content", content))
    else:
        for i, t in enumerate(chat.turns):
            texts += ((f"messages[{i}].content", t.content), (f"messages[{i}]", t.call_id))
            texts += (
                (f"messages[{i}].tool_calls", f"{c.name}{c.arguments}{c.id}") for c in t.calls
            )
        for j, tool in enumerate(chat.plan.tools if chat.plan is not None else ()):
            parameters = json.dumps(tool.parameters, ensure_ascii=False)
            texts.append((f"tools[{j}]", tool.description + parameters))
    if req.guide is not None:
        texts.append((http.guide_field or "response_format", req.guide.text))
    for field, text in texts:
        if text.isascii():
            continue
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise invalid(
                f"{field} holds text that is not valid Unicode: an unpaired surrogate "
                f"{exc.object[exc.start : exc.end]!a}",
                field,
            ) from None


def _parse(data: dict[str, Any], chat: bool) -> HttpRequest:
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in data:
        if name not in known:
            hint = f"; send it as appliance.{name}" if name in EXTENSION_FIELDS else ""
            shown = echo_name(name)
            raise invalid(f"Unrecognized request argument supplied: {shown}{hint}", _param(name))
    for name, kind in IGNORED.items():
        _field(data, name, kind)
    for name, allowed in NO_OP.items():
        if name in data and not _no_op(data[name], allowed):
            shown = ", ".join(json.dumps(a) for a in allowed)
            raise invalid(f"{name} is not supported by this server (accepted: {shown})", name)
    req = IncomingRequest(model=_field(data, "model", str, required=True))
    tools = None
    if chat:
        tools = _tools(data)
        _messages(data, tools, req)
    else:
        req.prompt = _prompt(data)
    max_tokens = _int(data, "max_tokens", -INT32_MAX, INT32_MAX)
    max_tokens_field = "max_tokens"
    if chat:
        other = _int(data, "max_completion_tokens", -INT32_MAX, INT32_MAX)
        if max_tokens is not None and other is not None and max_tokens != other:
            raise invalid(
                "max_tokens and max_completion_tokens differ; send one of them",
                "max_completion_tokens",
            )
        if other is not None:
            max_tokens, max_tokens_field = other, "max_completion_tokens"
    req.max_tokens = max_tokens
    req.temperature = _number(data, "temperature")
    req.top_p = _number(data, "top_p")
    req.seed = _int(data, "seed", 0, UINT64_MAX)
    req.stop = _stops(data)
    _length(req, data)
    _logprobs(req, data, chat)
    req.guide = _response_format(data)
    guide_field = "response_format" if req.guide is not None else None
    if tools is not None and tools.forced:
        if req.guide is not None:
            raise invalid(
                "a tool_choice that forces a call constrains the answer itself; drop "
                "response_format or use tool_choice auto",
                "response_format",
            )
        req.guide = Guide("json_schema", tools.guide_schema() or "")
        guide_field = "tool_choice"
    stream = bool(_field(data, "stream", bool) or False)
    include_usage, continuous_usage = _include_usage(data, stream)
    guided = req.guide is not None
    deadline_s = _extension(req, data)
    if not guided and req.guide is not None:
        guide_field = "appliance.guide"
    return HttpRequest(
        req,
        chat,
        stream,
        include_usage,
        deadline_s,
        guide_field,
        max_tokens_field,
        continuous_usage,
    )


def _no_op(value: object, allowed: tuple[object, ...]) -> bool:
    """`value` is one of a NO_OP field's accepted values (or empty); true == 1 and false == 0 in
    Python, so a boolean matches a boolean only."""
    return any(
        value == a and isinstance(value, bool) == isinstance(a, bool) for a in (*allowed, {}, [])
    )


def _length(req: IncomingRequest, data: dict[str, Any]) -> None:
    """vLLM's `min_tokens` and `ignore_eos`, top-level in the body as vLLM, SGLang and benchmark
    tools (aiperf's --extra-inputs) send them."""
    req.min_tokens = _int(data, "min_tokens", -INT32_MAX, INT32_MAX)
    req.ignore_eos = bool(_field(data, "ignore_eos", bool) or False)


def _logprobs(req: IncomingRequest, data: dict[str, Any], chat: bool) -> None:
    """Chat: `logprobs` (boolean) and `top_logprobs` (0 to 20). Completions: `logprobs` is the
    number of alternatives per token (0: the chosen token's log-probability alone; at most
    MAX_TOP_LOGPROBS, as chat's `top_logprobs`)."""
    if chat:
        req.logprobs = bool(_field(data, "logprobs", bool) or False)
        req.top_logprobs = _int(data, "top_logprobs", -INT32_MAX, INT32_MAX)
        return
    count = _int(data, "logprobs", 0, MAX_TOP_LOGPROBS)
    if count is None:
        return
    req.logprobs = True
    req.top_logprobs = count


def _tools(data: dict[str, Any]) -> ToolPlan | None:
    _field(data, "parallel_tool_calls", bool)  # one call at most is made either way
    return tool_calls.plan(data.get("tools"), data.get("tool_choice"))


def _messages(data: dict[str, Any], tools: ToolPlan | None, req: IncomingRequest) -> None:
    """The chat as (role, content), or as a ToolChat when it has tools or tool-call history; an
    empty list reaches the check stage, which names it."""
    messages = _field(data, "messages", list, required=True)
    refusal = too_many_messages(len(messages))
    if refusal is not None:
        raise invalid(refusal.message, "messages")
    listed_calls = (m.get("tool_calls") for m in messages if isinstance(m, dict))
    tool_calls.check_past_calls(sum(len(c) for c in listed_calls if isinstance(c, list)))
    turns: list[tool_calls.Turn] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}] must be an object, got {_kind(m)}", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str):
            raise invalid(f"messages[{i}].role must be a string", f"messages[{i}].role")
        content = _content(m.get("content"), i)
        call_id = m.get("tool_call_id") if role == "tool" else None
        if call_id is not None and not isinstance(call_id, str):
            raise invalid(f"messages[{i}].tool_call_id must be a string", f"messages[{i}]")
        turns.append(
            tool_calls.turn(ROLE_ALIASES.get(role, role), content, _past_calls(m, i), call_id, i)
        )
        if m.get("content") is None and role != "assistant":
            # OpenAI's schema: only an assistant message (one that calls tools) may leave it out;
            # read as empty, a misspelt key would be a silent empty turn.
            raise invalid(
                f"messages[{i}].content is required in a {role} message", f"messages[{i}].content"
            )
    if tools is None and not tool_calls.has_tool_parts(turns):
        req.messages = [(t.role, t.content) for t in turns]
        return
    req.tool_chat = tool_calls.ToolChat(tools, tuple(turns))  # written by the check stage


def _past_calls(message: dict[str, Any], i: int) -> list[tool_calls.PastCall]:
    """An assistant message's `tool_calls`, as the client sent them."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise invalid(f"messages[{i}].tool_calls must be an array", f"messages[{i}].tool_calls")
    past = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        call_id = call.get("id", "") if isinstance(call, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise invalid(
                f"messages[{i}].tool_calls[{j}] must be "
                '{"type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}',
                f"messages[{i}].tool_calls",
            )
        if not isinstance(call_id, str):
            raise invalid(
                f"messages[{i}].tool_calls[{j}].id must be a string", f"messages[{i}].tool_calls"
            )
        past.append(tool_calls.PastCall(name, arguments, call_id))
    return past


def _content(content: object, i: int) -> str:
    """A message's text: a string, or a list of text parts (joined); other parts are refused."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise invalid(
                    f"messages[{i}].content[{j}]: only text parts are supported",
                    f"messages[{i}].content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(
                    f"messages[{i}].content[{j}].text must be a string", f"messages[{i}].content"
                )
            texts.append(text)
        return "".join(texts)
    raise invalid(
        f"messages[{i}].content must be a string or a list of text parts, got {_kind(content)}",
        f"messages[{i}].content",
    )


def _prompt(data: dict[str, Any]) -> str:
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid(
            "prompt must be a string (one prompt per request; token ids are not accepted)",
            "prompt",
        )
    return prompt


def _response_format(data: dict[str, Any]) -> Guide | None:
    """OpenAI's `response_format`: `text` (free text), `json_object` (any JSON object: a schema
    that says so) or
    `json_schema` (`json_schema.schema`, enforced whether `strict` is set or not) as a guide."""
    form = _field(data, "response_format", dict)
    if form is None:
        return None
    guide = None
    kind = _field(form, "type", str, required=True, prefix="response_format.")
    if kind == "text":
        known = {"type"}
    elif kind == "json_object":
        known = {"type"}
        # The engine's `json` guide is any JSON value; OpenAI's json_object is an object.
        guide = Guide("json_schema", JSON_OBJECT)
    elif kind == "json_schema":
        known = {"type", "json_schema"}
        spec = _field(form, "json_schema", dict, required=True, prefix="response_format.")
        p = "response_format.json_schema."
        for name in spec:
            if name not in ("name", "schema", "strict", "description"):
                raise invalid(f"unknown field {p}{echo_name(name)}", "response_format")
        _field(spec, "name", str, prefix=p)
        _field(spec, "strict", bool, prefix=p)
        _field(spec, "description", str, prefix=p)
        schema = _field(spec, "schema", dict, prefix=p)
        # No schema: OpenAI's default, an object with any properties.
        guide = Guide(
            "json_schema", json.dumps(schema if schema is not None else {"type": "object"})
        )
    else:
        raise invalid(
            f"response_format.type {echo_value(kind)} is not one of text, json_object, json_schema",
            "response_format",
        )
    for name in form:
        if name not in known:
            raise invalid(f"unknown field response_format.{echo_name(name)}", "response_format")
    return guide


def _stops(data: dict[str, Any]) -> list[str]:
    stop = data.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise invalid("stop must be a string or a list of strings", "stop")


def _include_usage(data: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of stream_options. As vLLM takes them: per-chunk
    usage comes only with the usage chunk, and where the options leave include_usage out
    continuous_usage_stats true turns both on (vLLM's include_usage defaults to true; OpenAI's,
    without continuous_usage_stats, to false)."""
    options = _field(data, "stream_options", dict)
    if options is None:
        return False, False
    if not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    for name in options:
        if name not in STREAM_OPTIONS:
            raise invalid(
                f"Unrecognized stream_options argument: {echo_name(name)}", "stream_options"
            )
    _field(options, "include_obfuscation", bool, prefix="stream_options.")
    continuous = bool(
        _field(options, "continuous_usage_stats", bool, prefix="stream_options.") or False
    )
    include = _field(options, "include_usage", bool, prefix="stream_options.")
    if include is None:
        include = continuous
    return bool(include), bool(include) and continuous


def _extension(req: IncomingRequest, data: dict[str, Any]) -> float | None:
    ext = _field(data, "appliance", dict)
    if ext is None:
        return None
    for name in ext:
        if name not in EXTENSION_FIELDS:
            known = ", ".join(sorted(EXTENSION_FIELDS))
            raise invalid(
                f"unknown field appliance.{echo_name(name)}; known fields: {known}",
                f"appliance.{_param(name)}",
            )
    p = "appliance."
    req.request_id = _field(ext, "request_id", str, prefix=p) or ""
    req.namespace = _field(ext, "namespace", str, prefix=p) or ""
    policy = _field(ext, "cache_policy", str, prefix=p)
    if policy is not None:
        if policy.lower() not in CACHE_POLICIES:
            raise invalid(
                f"appliance.cache_policy must be one of {', '.join(CACHE_POLICIES)}, got "
                f"{json.dumps(policy)[:64]}",
                "appliance.cache_policy",
            )
        req.cache_policy = CACHE_POLICIES[policy.lower()]
    req.semantic_cache = _field(ext, "semantic_cache", bool, prefix=p)
    req.speculation = _field(ext, "speculation", bool, prefix=p)
    req.top_k = _int(ext, "top_k", -INT32_MAX, INT32_MAX, prefix=p)
    req.ttft_budget_ms = _int(ext, "ttft_budget_ms", 0, UINT32_MAX, prefix=p)
    guide = _field(ext, "guide", dict, prefix=p)
    if guide is not None:
        if req.guide is not None:
            raise invalid("send response_format or appliance.guide, not both", "response_format")
        kind = _field(guide, "type", str, required=True, prefix=p + "guide.")
        if kind not in GUIDE_TYPES:
            raise invalid(
                f"{p}guide.type {echo_value(kind)} is not one of {', '.join(GUIDE_TYPES)}",
                p + "guide",
            )
        for name in guide:
            if name not in ("type", "guide"):
                raise invalid(f"unknown field {p}guide.{echo_name(name)}", p + "guide")
        req.guide = Guide(kind, _field(guide, "guide", str, prefix=p + "guide.") or "")
    deadline_ms = _int(ext, "deadline_ms", 1, UINT32_MAX, prefix=p)
    return None if deadline_ms is None else deadline_ms / 1000


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


_KIND_NAMES = {str: "a string", bool: "a boolean", list: "an array", dict: "an object"}


def _field(
    data: dict[str, Any], name: str, kind: type, required: bool = False, prefix: str = ""
) -> Any:
    value = data.get(name)
    if value is None:
        if required:
            raise invalid(f"{prefix}{name} is required", prefix + name)
        return None
    if not isinstance(value, kind):
        raise invalid(
            f"{prefix}{name} must be {_KIND_NAMES[kind]}, got {_kind(value)}", prefix + name
        )
    return value


def _param(name: str) -> str:
    """A field name a client sent, as the error's `param`: printable ASCII, cut."""
    return name[:ECHO_CHARS] if name.isascii() and name.isprintable() else "(not printable)"


def _int(data: dict[str, Any], name: str, low: int, high: int, prefix: str = "") -> int | None:
    """An integer field within the wire's range (beyond it no gRPC client could send it either)."""
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(f"{prefix}{name} must be an integer, got {_kind(value)}", prefix + name)
    if not low <= value <= high:
        raise invalid(
            f"{prefix}{name} must be between {low} and {high}, got {echo_value(value)}",
            prefix + name,
        )
    return value


def _number(data: dict[str, Any], name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise invalid(f"{name} must be a number, got {_kind(value)}", name)
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise invalid(f"{name} is out of range: {len(str(value))} digits", name) from None


# -- errors ------------------------------------------------------------------------------------

# Every gRPC status a refusal can carry (all but OK), as OpenAI's HTTP status and error type; none
# is a 500.
STATUS = {
    grpc.StatusCode.CANCELLED: (499, "cancelled_error"),
    grpc.StatusCode.UNKNOWN: (502, "server_error"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_denied_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.INTERNAL: (502, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DATA_LOSS: (502, "server_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
}
# An unknown model is the request's fault, whichever endpoint names it (as OpenAI answers).
MODEL_NOT_FOUND_KIND = "invalid_request_error"


# The check stage's fields (the gRPC API's names) that an HTTP body holds in its "appliance" object.
EXTENSION_PARAMS = {
    name: f"appliance.{name}"
    for name in (
        "top_k",
        "speculation",
        "request_id",
        "namespace",
        "ttft_budget_ms",
        "cache_policy",
    )
}


# The checks' word for the answer's length, in the refusals of it and of what it bounds.
_MAX_TOKENS_WORD = re.compile(r"\bmax_tokens\b")


def error_of(
    exc: RequestError,
    chat: bool = True,
    guide_field: str | None = None,
    max_tokens_field: str = "max_tokens",
) -> HttpError:
    """A pipeline refusal as its HTTP status, OpenAI error type, `param` and `code`; `param` is
    the body's field: the alternatives per token are chat's `top_logprobs` and completions'
    `logprobs`, a guide is the field it came from (`guide_field`), the answer's length the field
    it came from (`max_tokens_field`), which the refusals of the length, of `min_tokens` and of
    the context's size also name in their message."""
    status, kind = STATUS.get(exc.code, (502, "server_error"))
    if exc.reason == MODEL_NOT_FOUND:
        kind = MODEL_NOT_FOUND_KIND
    param = exc.field
    message = exc.message
    if max_tokens_field != "max_tokens" and (
        param in ("max_tokens", "min_tokens") or exc.reason == CONTEXT_LENGTH_EXCEEDED
    ):
        # These messages hold numbers and field names only, never the client's text.
        message = _MAX_TOKENS_WORD.sub(max_tokens_field, message)
        if param == "max_tokens":
            param = max_tokens_field
    if not chat and param == "top_logprobs":
        param = "logprobs"
    elif param == "guide" and guide_field is not None:
        param = guide_field
    elif param is not None:
        param = EXTENSION_PARAMS.get(param, param)
    return HttpError(status, kind, message, param, exc.reason)


def unknown_model(known: list[str]) -> HttpError:
    return HttpError(
        404,
        MODEL_NOT_FOUND_KIND,
        f"unknown model; known models: {', '.join(known)}",
        "model",
        MODEL_NOT_FOUND,
    )


def error_body(err: HttpError) -> dict[str, Any]:
    return {
        "error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}
    }


def dumps(value: object) -> bytes:
    """Compact UTF-8 JSON; an unpaired surrogate echoed from a client stays a JSON escape."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode(
        errors="backslashreplace"
    )


# -- answers -----------------------------------------------------------------------------------


def extension(request_id: str, final: Final) -> dict[str, Any]:
    """The appliance's facts about an answer: which tier and model answered, and its timings; the
    key a cached or cacheable answer is stored under (to audit or drop it), for a semantic hit
    the similarity, and for a generated answer its speculative draft tokens, proposed and
    accepted (0 without drafts)."""
    f = final
    facts: dict[str, Any] = {
        "request_id": request_id,
        "cache_tier": f.tier,
        "model": f.model,
        "degraded": f.degraded,
        "timings": {"queue_us": f.queue_us, "ttft_us": f.ttft_us, "total_us": f.total_us},
    }
    if final.similarity is not None:
        facts["similarity"] = round(final.similarity, 4)
    if final.cache_entry:
        facts["cache_entry"] = final.cache_entry
    if f.tier == "miss":
        facts["draft_tokens"] = f.draft_tokens
        facts["accepted_draft_tokens"] = f.accepted_draft_tokens
    return facts


def usage(final: Final) -> dict[str, Any]:
    """OpenAI's usage of an answer: its token counts and, as OpenAI always sends them, the prompt
    tokens the engine took from its prefix cache (`prompt_tokens_details.cached_tokens`; 0 when
    it reused none, and for an answer the gateway's own cache served)."""
    p, c = final.prompt_tokens, final.completion_tokens
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


# The finish reason of an answer the gateway ended early (a drain; the gRPC API's "cancelled").
# OpenAI defines none: its SDK types list stop, length, tool_calls, content_filter and
# function_call, and parse any other string as it is. vLLM and SGLang send "abort" for a
# generation aborted server-side (vLLM's FinishReason.ABORT), so clients written for them know it;
# TGI has no such reason. "length" would claim max_tokens was reached, "stop" that the model ended.
ABORTED = "abort"


def finish_reason(final: Final) -> str:
    """OpenAI's "stop" and "length", "tool_calls" when the answer is a call; ABORTED when the
    gateway ended the answer early."""
    if final.tool_call is not None:
        return "tool_calls"
    return ABORTED if final.finish_reason == "cancelled" else final.finish_reason


# OpenAI's log-probability of a token "very unlikely": JSON has no -Infinity (Python's json
# writes it; orjson, JavaScript's JSON.parse and Go refuse it) and vLLM writes -inf as this too.
LOGPROB_FLOOR = -9999.0


class Answer:
    """One request's answer in OpenAI's shapes: chunk by chunk for SSE, or whole."""

    def __init__(self, http: HttpRequest, request_id: str, created: int) -> None:
        self.chat = http.chat
        self.include_usage = http.include_usage
        # With continuous usage, every chunk's usage so far: the prompt's tokens (from the
        # replies, once one says) and the completion tokens of the replies counted so far.
        self.continuous_usage = http.continuous_usage
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.model = http.request.model
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.request_id = request_id
        self.created = created
        self.logprobs = http.request.logprobs
        self.top_logprobs = http.request.top_logprobs or 0
        # Characters of completion text before the next token (completions' text_offset).
        self._offset = 0
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        head = dumps({"id": self.id, "object": kind, "created": created, "model": self.model})
        # Every chunk is `data: {head,"choices":[{"index":0,<part>...}]}\n\n`.
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":0,'
        self._text: Callable[[str], bytes]
        if self.chat:
            tail = b'},"logprobs":null,"finish_reason":null}]'
            self._text = lambda text: (
                self._head + b'"delta":{"content":' + dumps(text) + tail + self._end()
            )
        else:
            tail = b',"logprobs":null,"finish_reason":null}]'
            self._text = lambda text: self._head + b'"text":' + dumps(text) + tail + self._end()

    def count(self, delta: Delta) -> None:
        """Counts a reply's tokens in the usage so far (whether or not a chunk carries it)."""
        self.prompt_tokens = delta.prompt_tokens or self.prompt_tokens
        self.completion_tokens += len(delta.token_ids)

    def _end(self) -> bytes:
        """The end of a chunk after its choices: with continuous usage, the usage so far."""
        if not self.continuous_usage:
            return b"}\n\n"
        p, c = self.prompt_tokens, self.completion_tokens
        return b',"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}\n\n' % (
            p,
            c,
            p + c,
        )

    def first_chunk(self, first: Delta | Final) -> bytes:
        """Chat streams open with the assistant's role (what OpenAI's clients expect); `first`,
        the first reply, says the prompt's tokens for the usage so far."""
        self.prompt_tokens = first.prompt_tokens or self.prompt_tokens
        if not self.chat:
            return b""
        return (
            self._head
            + b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
            + self._end()
        )

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob] = ()) -> bytes:
        """A text delta; with log-probabilities, those of the tokens its message added (the text
        of a token may come in a later chunk: a character or a possible stop string can lag)."""
        if not logprobs:
            return self._text(text)
        choice: dict[str, Any] = {"index": 0}
        choice["delta" if self.chat else "text"] = {"content": text} if self.chat else text
        choice["logprobs"] = self.render_logprobs(logprobs)
        choice["finish_reason"] = None
        return self._chunk_of([choice])

    def render_logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """OpenAI's `logprobs` of a choice: chat's `content` list, each token with its
        `top_logprobs` list ([] when none were asked for), or completions' parallel lists, whose
        `top_logprobs` (null when none were asked for) maps each position's alternatives' text to
        their log-probabilities and, as OpenAI's does, holds the chosen token too (so up to N + 1
        entries; alternatives whose text is the same keep the most likely one's)."""
        tokens = [e.token.decode(errors="replace") for e in entries]
        if self.chat:
            content = [
                {
                    "token": t,
                    "logprob": _logprob(e.logprob),
                    "bytes": list(e.token),
                    "top_logprobs": [
                        {
                            "token": a.token.decode(errors="replace"),
                            "logprob": _logprob(a.logprob),
                            "bytes": list(a.token),
                        }
                        for a in e.top
                    ],
                }
                for t, e in zip(tokens, entries, strict=True)
            ]
            return {"content": content, "refusal": None}
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [_logprob(e.logprob) for e in entries],
            "top_logprobs": [_top_of(t, e) for t, e in zip(tokens, entries, strict=True)]
            if self.top_logprobs
            else None,
            "text_offset": offsets,
        }

    def call_chunk(self, call: ToolCall) -> bytes:
        """The streamed tool call: one delta with its name and whole arguments."""
        delta = {
            "role": "assistant",
            "content": None,
            "tool_calls": [call_entry(call, 0)],
        }
        return self._chunk_of(
            [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
        )

    def last_chunks(self, final: Final) -> bytes:
        """The chunk with the finish reason and the extension, the usage chunk, then [DONE]."""
        choice: dict[str, Any] = {"index": 0}
        choice["delta" if self.chat else "text"] = {} if self.chat else ""
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason(final)
        # The Final's counts: a tool call's text, held back, was counted by no chunk.
        self.prompt_tokens, self.completion_tokens = final.prompt_tokens, final.completion_tokens
        out = self._chunk_of([choice], appliance=extension(self.request_id, final))
        if self.include_usage:
            out += self._chunk_of([], usage=usage(final), running=False)
        return out + b"data: [DONE]\n\n"

    def _chunk_of(self, choices: list[dict[str, Any]], running: bool = True, **extra: Any) -> bytes:
        """A chunk of `choices`; with continuous usage and `running`, it carries the usage so far."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        if running and self.continuous_usage:
            p, c = self.prompt_tokens, self.completion_tokens
            body["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        return b"data: " + dumps(body) + b"\n\n"

    def whole(
        self, text: str, final: Final, logprobs: Sequence[TokenLogprob] = ()
    ) -> dict[str, Any]:
        """The non-streaming answer."""
        choice: dict[str, Any] = {"index": 0}
        call = final.tool_call
        if call is not None:
            choice["message"] = {
                "role": "assistant",
                "content": None,
                "tool_calls": [call_entry(call)],
            }
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self.render_logprobs(logprobs) if self.logprobs else None
        choice["finish_reason"] = finish_reason(final)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(final),
            "appliance": extension(self.request_id, final),
        }


def _top_of(text: str, entry: TokenLogprob) -> dict[str, float]:
    """Completions' alternatives of one position: text -> log-probability, most likely first,
    with the chosen token's text added when none of them has it."""
    top: dict[str, float] = {}
    for a in entry.top:
        top.setdefault(a.token.decode(errors="replace"), _logprob(a.logprob))
    top.setdefault(text, _logprob(entry.logprob))
    return top


def _logprob(value: float) -> float:
    """A log-probability as JSON can carry it: -inf (a token a grammar's mask or min_tokens
    banned) and NaN are LOGPROB_FLOOR, as OpenAI writes a token too unlikely to be scored."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def stream_error(err: HttpError) -> bytes:
    """An error after the stream began (the status line is gone): an SSE event the SDKs raise,
    then [DONE], which ends every stream (as vLLM's do), so a client reading to it sees the end."""
    return b"data: " + dumps(error_body(err)) + b"\n\ndata: [DONE]\n\n"


def model_list(names: list[str], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_entry(n, created) for n in names]}


def model_entry(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "appliance"}
