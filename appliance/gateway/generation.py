"""One generation on a backend, as events: text deltas as tokens decode, then how it ended.

Token ids come from the backend; text is decoded incrementally here (whole UTF-8 characters only) and
cut at stop strings, so the backend never needs the tokenizer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from appliance.backends.base import GenerationRequest
from appliance.cache.keys import ModelIdentity
from appliance.gateway.models import ServedModel
from appliance.text.detokenize import IncrementalDecoder
from appliance.text.stops import StopMatcher


@dataclass(slots=True)
class Delta:
    """New text and the token ids it came from, with their log-probabilities when asked for."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None


@dataclass(slots=True)
class Outcome:
    """How a generation ended; the last event of every stream."""

    # "stop" (end token or stop string) or "length" (max_tokens reached).
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    # The model that produced the answer: its cache entry may only be keyed with this identity.
    produced_by: ModelIdentity


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
    decoder = IncrementalDecoder(model.text.table)
    matcher = StopMatcher(stops)
    end_id = None if request.ignore_eos else request.end_id
    min_tokens = request.min_tokens
    completion = 0
    ended_by_stop = False
    tokens_stream = model.backend.stream(request)
    try:
        async for step in tokens_stream:
            tokens: list[int] = step
            logprobs = step.logprobs
            if end_id is not None and end_id in tokens:
                cut = tokens.index(end_id)
                tokens, logprobs = tokens[:cut], logprobs[:cut] if logprobs else logprobs
                ended_by_stop = True
            pieces = [decoder.push(t) for t in tokens]
            if completion >= min_tokens:
                text = matcher.feed("".join(pieces))
            else:
                free = min(len(pieces), min_tokens - completion)
                text = "".join(pieces[:free]) + matcher.feed("".join(pieces[free:]))
            completion += len(tokens)
            if text or tokens:
                yield Delta(text, tokens, logprobs)
            if matcher.stopped or ended_by_stop:
                ended_by_stop = True
                break
    finally:
        await tokens_stream.aclose()
    tail = "" if matcher.stopped else matcher.feed(decoder.flush()) + matcher.flush()
    if tail:
        yield Delta(tail, [])
    stopped = ended_by_stop or completion < request.max_tokens
    yield Outcome(
        "stop" if stopped else "length", len(request.prompt_ids), completion, model.identity
    )
