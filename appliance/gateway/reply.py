"""What the pipeline answers a request with, whatever front end asked: text deltas as they decode
(generation.Delta), then one Final (with the tool call the answer makes, if it makes one). Front
ends translate both into their wire format."""

from __future__ import annotations

import time
from dataclasses import dataclass

from appliance.gateway.generation import Delta
from appliance.gateway.report import RequestReport
from appliance.gateway.tool_calls import ToolCall


@dataclass(slots=True)
class Final:
    """How the answer ended and what the client is told about it."""

    request_id: str
    # "stop", "length" or "cancelled" (the gateway ended it early).
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    # Microseconds from arrival at the gateway: to the engine's slot, to the first text, to the end.
    queue_us: int
    ttft_us: int
    total_us: int
    # "miss" (generated) or the name of the cache tier that answered.
    tier: str
    # The model that answered, and whether it is not the one asked for (a fallback answered).
    model: str
    degraded: bool
    # A hit of a tier that judges similarity (semantic): the cosine similarity of this request's
    # question and the cached one; None for every other answer.
    similarity: float | None
    # The key (hex) the answer is cached under; "" when it is not.
    cache_entry: str
    # Speculative decoding of a generated answer: draft tokens proposed, and accepted (0 for a
    # cached answer and a model without a drafter).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # The request offered tools and the whole answer is one call of them (call_reader.py).
    tool_call: ToolCall | None = None
    # Prompt tokens of a generated answer the engine took from its prefix cache instead of
    # computing them (OpenAI's usage.prompt_tokens_details.cached_tokens). 0 for an answer from
    # the gateway's cache (L1, L2, semantic): no engine read the prompt, and the gateway's cache
    # is no prefix cache of the model's.
    cached_tokens: int = 0


Reply = Delta | Final


def final_of(r: RequestReport, received_ns: int, started_ns: int, first_ns: int) -> Final:
    """The last reply; fills the report's timings as the client sees them."""
    done = time.monotonic_ns()
    r.queue_us = (started_ns - received_ns) // 1000
    r.ttft_us = ((first_ns or done) - received_ns) // 1000
    r.total_us = (done - received_ns) // 1000
    return Final(
        r.request_id,
        r.finish_reason,
        r.prompt_tokens,
        r.completion_tokens,
        r.queue_us,
        r.ttft_us,
        r.total_us,
        r.tier,
        r.answered_by or r.model,
        r.answered_by not in ("", r.model),
        r.similarity,
        r.cache_entry,
        r.draft_tokens,
        r.accepted_draft_tokens,
        cached_tokens=r.cached_tokens,
    )
