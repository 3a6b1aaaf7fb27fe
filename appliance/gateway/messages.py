"""The public API's messages for generation events, cached answers and timings (the wire edge)."""

from __future__ import annotations

import time

from appliance.cache.entry import CachedAnswer
from appliance.gateway.generation import Delta, Event, Outcome
from appliance.gateway.report import RequestReport
from appliance.text.detokenize import TokenTable
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


def delta(request_id: str, d: Delta, table: TokenTable) -> pb.GenerateResponse:
    message = pb.GenerateResponse(request_id=request_id, text=d.text, token_ids=d.token_ids)
    if d.logprobs is not None:
        entries = message.logprobs
        for token_id, logprob in zip(d.token_ids, d.logprobs, strict=True):
            entries.add(token_id=token_id, token=table.bytes_of(token_id), logprob=logprob)
    return message


def final(
    r: RequestReport, received_ns: int, started_ns: int, first_ns: int
) -> pb.GenerateResponse:
    """The last message; fills the report's timings as the client sees them."""
    done = time.monotonic_ns()
    r.queue_us = (started_ns - received_ns) // 1000
    r.ttft_us = ((first_ns or done) - received_ns) // 1000
    r.total_us = (done - received_ns) // 1000
    return pb.GenerateResponse(
        request_id=r.request_id,
        final=pb.Final(
            finish_reason=FINISH[r.finish_reason],
            usage=pb.Usage(prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens),
            timings=pb.Timings(queue_us=r.queue_us, ttft_us=r.ttft_us, total_us=r.total_us),
            cache_tier=TIERS.get(r.tier, pb.CACHE_TIER_OTHER),
            cache_tier_name=r.tier,
            model=r.answered_by or r.model,
            degraded=r.answered_by not in ("", r.model),
            similarity=r.similarity,
            cache_entry=r.cache_entry,
        ),
    )


def answer_of(events: list[Event]) -> CachedAnswer:
    """A complete generation as a cache entry."""
    outcome = events[-1]
    assert isinstance(outcome, Outcome)
    deltas = [e for e in events if isinstance(e, Delta)]
    return CachedAnswer(
        text="".join(d.text for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        finish_reason=outcome.finish_reason,
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens,
    )
