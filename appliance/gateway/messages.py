"""The gRPC API's messages translated to and from the pipeline's plain types (the wire edge): a
GenerateRequest into an IncomingRequest, and the pipeline's replies into GenerateResponses."""

from __future__ import annotations

from appliance.backends.base import Guide
from appliance.gateway.generation import Delta
from appliance.gateway.reply import Final
from appliance.gateway.request import IncomingRequest, new_request_id, too_many_messages
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


def request_of(m: pb.GenerateRequest) -> IncomingRequest:
    """The request in plain values; the client's request id, or a new one (every reply names
    it). A chat's message count is checked before any message is read."""
    which = m.WhichOneof("input")
    messages = None
    if which == "messages":
        listed = m.messages.messages
        refusal = too_many_messages(len(listed))
        if refusal is not None:
            raise refusal
        messages = [(c.role, c.content) for c in listed]
    guide = None
    if m.HasField("guide"):
        guide = Guide(GUIDE_TYPES.get(m.guide.type, str(m.guide.type)), m.guide.guide)
    return IncomingRequest(
        model=m.model,
        prompt=m.prompt if which == "prompt" else None,
        messages=messages,
        request_id=m.request_id or new_request_id(),
        namespace=m.namespace,
        max_tokens=m.max_tokens if m.HasField("max_tokens") else None,
        temperature=m.temperature if m.HasField("temperature") else None,
        top_p=m.top_p if m.HasField("top_p") else None,
        top_k=m.top_k if m.HasField("top_k") else None,
        seed=m.seed if m.HasField("seed") else None,
        stop=m.stop,
        cache_policy=m.cache_policy,
        semantic_cache=m.semantic_cache if m.HasField("semantic_cache") else None,
        ttft_budget_ms=m.ttft_budget_ms if m.HasField("ttft_budget_ms") else None,
        guide=guide,
        min_tokens=m.min_tokens if m.HasField("min_tokens") else None,
        ignore_eos=m.ignore_eos,
        logprobs=m.logprobs,
        top_logprobs=m.top_logprobs if m.HasField("top_logprobs") else None,
        speculation=m.speculation if m.HasField("speculation") else None,
    )


def delta(request_id: str, d: Delta) -> pb.GenerateResponse:
    message = pb.GenerateResponse(request_id=request_id, text=d.text, token_ids=d.token_ids)
    if d.logprobs is not None:
        entries = message.logprobs
        for token_id, token, logprob in d.logprobs:
            entries.add(token_id=token_id, token=token, logprob=logprob)
    return message


def final(f: Final) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=f.request_id,
        final=pb.Final(
            finish_reason=FINISH[f.finish_reason],
            usage=pb.Usage(prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens),
            timings=pb.Timings(queue_us=f.queue_us, ttft_us=f.ttft_us, total_us=f.total_us),
            cache_tier=TIERS.get(f.tier, pb.CACHE_TIER_OTHER),
            cache_tier_name=f.tier,
            model=f.model,
            degraded=f.degraded,
            similarity=f.similarity,
            cache_entry=f.cache_entry,
            draft_tokens=f.draft_tokens,
            accepted_draft_tokens=f.accepted_draft_tokens,
        ),
    )
