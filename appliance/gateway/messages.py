"""The gRPC API's messages translated to and from the pipeline's plain types (the wire edge): a
GenerateRequest into an IncomingRequest, and the pipeline's replies into GenerateResponses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from appliance.backends.base import Guide
from appliance.gateway import tool_calls
from appliance.gateway.errors import invalid
from appliance.gateway.generation import Delta
from appliance.gateway.reply import Final
from appliance.gateway.request import (
    MAX_GUIDE_BYTES,
    IncomingRequest,
    new_request_id,
    too_many_messages,
)
from appliance.v1 import inference_pb2 as pb

FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
}
TIERS = {
    "miss": pb.CACHE_TIER_MISS,
    "l1": pb.CACHE_TIER_EXACT_L1,
    "l2": pb.CACHE_TIER_EXACT_L2,
    "semantic": pb.CACHE_TIER_SEMANTIC,
}
GUIDE_TYPES = {
    pb.GUIDE_TYPE_JSON: "json",
    pb.GUIDE_TYPE_JSON_SCHEMA: "json_schema",
    pb.GUIDE_TYPE_REGEX: "regex",
    pb.GUIDE_TYPE_EBNF_GRAMMAR: "ebnf_grammar",
}


TOOL_CHOICES = {
    pb.TOOL_CHOICE_AUTO: "auto",
    pb.TOOL_CHOICE_NONE: "none",
    pb.TOOL_CHOICE_REQUIRED: "required",
}


# GenerateRequest's fields that are not IncomingRequest's fields of the same name and value.
_TRANSLATED = frozenset({"messages", "guide", "tools"})


def request_of(m: pb.GenerateRequest) -> IncomingRequest:
    """The request in plain values; the client's request id, or a new one (every reply names
    it). A chat's message count is checked before any message is read; tools make the same plan
    the HTTP API's do (a forced call becomes the answer's guide). The fields are read in one
    ListFields call: only those the client set, whose absence the IncomingRequest's defaults
    already say."""
    fields: dict[str, Any] = {field.name: value for field, value in m.ListFields()}
    if "request_id" not in fields:
        fields["request_id"] = new_request_id()
    if not _TRANSLATED.isdisjoint(fields):
        _translate(m, fields)
    return IncomingRequest(**fields)


def _translate(m: pb.GenerateRequest, fields: dict[str, Any]) -> None:
    """The messages, the guide and the tools as the IncomingRequest holds them."""
    fields.pop("tools", None)
    which = m.WhichOneof("input")
    plan = _plan(m) if m.HasField("tools") else None
    if m.HasField("tools") and which != "messages":
        raise invalid("tools need a chat: send messages, not a prompt", field="tools")
    if which == "messages":
        listed = m.messages.messages
        refusal = too_many_messages(len(listed))
        if refusal is not None:
            raise refusal
        tool_calls.check_past_calls(sum(len(c.tool_calls) for c in listed))
        turns = [_turn(c, i) for i, c in enumerate(listed)]
        if plan is not None or tool_calls.has_tool_parts(turns):
            # Written as messages by the check stage, once its size is known to fit.
            fields["tool_chat"] = tool_calls.ToolChat(plan, tuple(turns))
        else:
            fields["messages"] = [(t.role, t.content) for t in turns]
    guide = None
    if m.HasField("guide"):
        guide = Guide(GUIDE_TYPES.get(m.guide.type, str(m.guide.type)), m.guide.guide)
    if plan is not None and plan.forced:
        if guide is not None:
            raise invalid(
                "a tool choice that forces a call constrains the answer itself; drop the guide "
                "or use TOOL_CHOICE_AUTO",
                field="guide",
            )
        guide = Guide("json_schema", plan.guide_schema() or "")
    fields["guide"] = guide


def _plan(m: pb.GenerateRequest) -> tool_calls.ToolPlan | None:
    """The request's Tools checked (tool_calls.plan_of); None when the answer is text."""
    given = m.tools
    tool_calls.check_count(len(given.tools), "tools.tools")
    tools = tool_calls.within_schema_bytes(_tools(given), "tools.tools")
    choice = TOOL_CHOICES.get(given.choice)
    if choice is None:
        raise invalid(f"tools.choice {given.choice} is not a ToolChoice", field="tools.choice")
    if given.function_name:
        if choice == "none":
            raise invalid(
                "tools.function_name forces a call, which TOOL_CHOICE_NONE forbids; send one",
                field="tools.function_name",
            )
        choice = given.function_name
    if not tools and choice != "auto":
        raise invalid("tools.choice needs tools: send the tools it may call", field="tools.choice")
    if not tools:
        return None
    return tool_calls.plan_of(tools, choice, "tools.tools", "tools.function_name")


def _tools(given: pb.Tools) -> Iterator[tool_calls.Tool]:
    """Each Tool checked, as it is asked for."""
    for i, t in enumerate(given.tools):
        where = f"tools.tools[{i}]"
        parameters = None
        if t.parameters:
            if len(t.parameters) > MAX_GUIDE_BYTES:
                raise invalid(
                    f"{where}.parameters is longer than {MAX_GUIDE_BYTES} bytes", field=where
                )
            try:
                parameters = json.loads(t.parameters)
            except (ValueError, RecursionError) as exc:
                raise invalid(f"{where}.parameters is not valid JSON: {exc}", field=where) from None
        yield tool_calls.tool_of(t.name, t.description, parameters, where)


def _turn(c: pb.ChatMessage, i: int) -> tool_calls.Turn:
    calls = [tool_calls.PastCall(t.name, t.arguments, t.id) for t in c.tool_calls]
    return tool_calls.turn(c.role, c.content, calls, c.tool_call_id or None, i)


def delta(request_id: str, d: Delta) -> pb.GenerateResponse:
    message = pb.GenerateResponse(request_id=request_id, text=d.text, token_ids=d.token_ids)
    if d.logprobs is not None:
        add_logprobs(message.logprobs, d)
    return message


def add_logprobs(entries: Any, d: Delta) -> None:
    """The delta's log-probabilities appended to a message's repeated TokenLogprob field."""
    for e in d.logprobs or ():
        entry = entries.add(token_id=e.token_id, token=e.token, logprob=e.logprob)
        for a in e.top:
            entry.top.add(token_id=a.token_id, token=a.token, logprob=a.logprob)


def tool_call(call: tool_calls.ToolCall) -> pb.ToolCall:
    """An answer's call as the Final carries it."""
    return pb.ToolCall(
        name=call.name,
        arguments=json.dumps(call.arguments, ensure_ascii=False),
        id=call.id,
    )


def final(f: Final) -> pb.GenerateResponse:
    message = pb.GenerateResponse(request_id=f.request_id)
    fill_final(message.final, f)
    return message


def fill_final(out: pb.Final, f: Final) -> None:
    """The Final written into an empty message's `final` in place: its fields set one by one
    cost a third of building a message and copying it in."""
    out.finish_reason = FINISH[f.finish_reason]
    usage = out.usage
    usage.prompt_tokens = f.prompt_tokens
    usage.completion_tokens = f.completion_tokens
    usage.cached_prompt_tokens = f.cached_tokens
    timings = out.timings
    timings.queue_us = f.queue_us
    timings.ttft_us = f.ttft_us
    timings.total_us = f.total_us
    out.cache_tier = TIERS.get(f.tier, pb.CACHE_TIER_OTHER)
    out.cache_tier_name = f.tier
    out.model = f.model
    out.degraded = f.degraded
    out.similarity = f.similarity or 0.0
    out.cache_entry = f.cache_entry
    out.draft_tokens = f.draft_tokens
    out.accepted_draft_tokens = f.accepted_draft_tokens
    if f.tool_call is not None:
        out.tool_call.CopyFrom(tool_call(f.tool_call))
