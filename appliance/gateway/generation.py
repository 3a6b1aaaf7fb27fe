"""One generation on a backend, as events: text deltas as tokens decode, then how it ended.

Token ids come from the backend; text is decoded incrementally here (whole UTF-8 characters only) and
cut at stop strings, so the backend never needs the tokenizer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from appliance.backends.base import GenerationRequest
from appliance.cache.entry import CachedAnswer
from appliance.cache.keys import ModelIdentity
from appliance.gateway.models import ServedModel
from appliance.text.detokenize import IncrementalDecoder
from appliance.text.stops import StopMatcher


class TopLogprob(NamedTuple):
    """One of the most likely tokens at a completion token's step: id, bytes, log-probability."""

    token_id: int
    token: bytes
    logprob: float


class TokenLogprob(NamedTuple):
    """A completion token, its bytes (a token may hold part of a character) and log-probability;
    `top`: the step's most likely tokens, most likely first, when the request asked for them."""

    token_id: int
    token: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(slots=True)
class Delta:
    """New text and the token ids it came from, with their log-probabilities when asked for, and
    the prompt's tokens as the answering model counts them (0: not said; a client's usage so far
    counts them). Every client following a generation receives the same Delta: nobody changes
    one (the clients of one generation share its prompt)."""

    text: str
    token_ids: Sequence[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0


@dataclass(slots=True)
class Outcome:
    """How a generation ended; the last event of every stream."""

    # "stop" (end token or stop string) or "length" (max_tokens or the engine's max_seq_len
    # reached).
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    # The model that produced the answer: its cache entry may only be keyed with this identity.
    produced_by: ModelIdentity
    # Speculative decoding: draft tokens proposed to the model's verify steps, and accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # Prompt tokens the engine took from its prefix cache instead of computing them (0 when it
    # reused none or does not say).
    cached_tokens: int = 0


@dataclass(slots=True)
class Started:
    """The generation got its slot at the engine (time.monotonic_ns()); not sent to clients."""

    at_ns: int


Event = Delta | Outcome | Started


async def generate(
    model: ServedModel, request: GenerationRequest, stops: tuple[str, ...]
) -> AsyncIterator[Delta | Outcome]:
    """Deltas as they decode, then the Outcome. Stop strings are looked for only in the text of
    the tokens after the first `request.min_tokens` (the engine bans the end id until then); with
    `request.ignore_eos` the end id does not end the answer."""
    table = model.text.table
    decoder = IncrementalDecoder(table)
    matcher = StopMatcher(stops)
    end_id = None if request.ignore_eos else request.end_id
    min_tokens = request.min_tokens
    completion = drafts = accepted = cached = 0
    prompt_tokens = len(request.prompt_ids)
    ended_by_stop = False
    tokens_stream = model.backend.stream(request)
    try:
        async for step in tokens_stream:
            tokens: list[int] = step
            logprobs = step.logprobs
            top = step.top
            if step.draft_tokens is not None:  # the generation's counts so far
                drafts, accepted = step.draft_tokens, step.accepted_draft_tokens or 0
            if step.cached_tokens is not None:
                cached = step.cached_tokens
            left = request.max_tokens - completion
            # An engine sending more than it was asked is cut first: an end id past max_tokens
            # did not end the answer.
            overrun = len(tokens) > left
            if overrun:
                tokens, logprobs = tokens[:left], logprobs[:left] if logprobs else logprobs
                top = top[:left] if top else top
            if end_id is not None and end_id in tokens:
                cut = tokens.index(end_id)
                tokens, logprobs = tokens[:cut], logprobs[:cut] if logprobs else logprobs
                top = top[:cut] if top else top
                ended_by_stop = True
            entries = None
            if logprobs is not None:
                entries = [
                    TokenLogprob(
                        t,
                        table.bytes_of(t),
                        p,
                        tuple(TopLogprob(a, table.bytes_of(a), q) for a, q in top[i])
                        if top
                        else (),
                    )
                    for i, (t, p) in enumerate(zip(tokens, logprobs, strict=True))
                ]
            pieces = [decoder.push(t) for t in tokens]
            if completion >= min_tokens:
                text = matcher.feed("".join(pieces))
            else:
                free = min(len(pieces), min_tokens - completion)
                text = "".join(pieces[:free]) + matcher.feed("".join(pieces[free:]))
            completion += len(tokens)
            if text or tokens:
                yield Delta(text, tokens, entries, prompt_tokens)
            if matcher.stopped or ended_by_stop:
                ended_by_stop = True
                break
            if overrun:
                break
    finally:
        await tokens_stream.aclose()
    tail = "" if matcher.stopped else matcher.feed(decoder.flush()) + matcher.flush()
    if tail:
        yield Delta(tail, [], None, prompt_tokens)
    # The engine also ends an answer that reaches its max_seq_len, with no end token.
    max_seq_len = model.backend.engine_limits.max_seq_len
    cut = completion >= request.max_tokens or (
        max_seq_len is not None and prompt_tokens + completion >= max_seq_len
    )
    stopped = ended_by_stop or not cut
    yield Outcome(
        "stop" if stopped else "length",
        prompt_tokens,
        completion,
        model.identity,
        drafts,
        min(accepted, drafts),
        min(cached, max(0, prompt_tokens - 1)),
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
