"""Token selection with TensorRT-LLM's request semantics, and the per-request generation loop.

The engine server stands in for Triton's `tensorrt_llm` model, so a request must mean the same
thing on both: `runtime_top_k`/`runtime_top_p` both 0 (or top_k 1) is greedy, a seed makes a run
reproducible. Reproducibility comes from a private torch.Generator per request, never the global
RNG, so concurrent or interleaved requests cannot perturb each other's draws.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from appliance.engine.decode import DecodeStep, EagerDecode
from appliance.engine.guided import CompiledGuide, GuidedMatcher
from appliance.engine.llama import KVCache, LlamaModel
from appliance.engine.speculative import Drafter, SpecCounts, Speculator, accept_sampled, verify

__all__ = ["Sampler", "SamplingParams", "TopLogprobs", "generate"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs, named after Triton's tensorrt_llm inputs."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """TensorRT-LLM: top_k 1, or neither top_k nor top_p, is argmax; so is temperature 0."""
        return self.top_k == 1 or (self.top_k == 0 and self.top_p == 0.0) or self.temperature == 0.0


class Sampler:
    """Picks one token from a logits vector; holds the request's generator between steps."""

    def __init__(self, params: SamplingParams) -> None:
        if not params.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if params.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {params.top_k}")
        if not 0.0 <= params.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {params.top_p}")
        if params.seed is not None and not -(2**63) <= params.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {params.seed}")
        self.params = params
        self.seed = (
            params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        )
        self._generator: torch.Generator | None = None

    def _generator_for(self, device: torch.device) -> torch.Generator:
        # Created on first use so the generator lives on the logits' device (cpu or cuda).
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def __call__(self, logits: torch.Tensor) -> int:
        """Return the chosen token id for a (vocab,) logits vector."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits).item())
        with torch.inference_mode():
            scaled = _scaled(logits, p.temperature)
            vocab = scaled.shape[-1]
            if 0 < p.top_k < vocab:
                values, indices = torch.topk(scaled, p.top_k)  # sorted descending
            elif 0.0 < p.top_p < 1.0:
                values, indices = torch.sort(scaled, descending=True)
            else:  # full distribution: no need to sort
                values, indices = scaled, None
            probs = torch.softmax(values, dim=-1)
            if 0.0 < p.top_p < 1.0:
                probs = probs * nucleus_mask(probs, p.top_p)
            choice = torch.multinomial(probs, 1, generator=self._generator_for(probs.device))
            if indices is not None:
                choice = indices[choice]
            return int(choice.item())

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The (vocab,) probabilities `__call__` samples from when not greedy (temperature, top-k,
        top-p applied, renormalised), as a full-vocabulary vector."""
        p = self.params
        with torch.inference_mode():
            scaled = _scaled(logits, p.temperature)
            if 0 < p.top_k < scaled.shape[-1]:
                values, indices = torch.topk(scaled, p.top_k)
            elif 0.0 < p.top_p < 1.0:
                values, indices = torch.sort(scaled, descending=True)
            else:
                return torch.softmax(scaled, dim=-1)
            probs = torch.softmax(values, dim=-1)
            if 0.0 < p.top_p < 1.0:
                probs = probs * nucleus_mask(probs, p.top_p)
                probs = probs / probs.sum()
            return torch.zeros_like(scaled).scatter_(0, indices, probs)

    def choose(
        self, logits: torch.Tensor, draft: int, draft_probs: torch.Tensor | None = None
    ) -> tuple[int, bool]:
        """The token chosen from `logits` given a speculative draft (drawn from `draft_probs`;
        None: certain), and whether it is the draft: greedy, the argmax; sampled, the rejection
        rule (`accept_sampled`), whose tokens are distributed as `__call__`'s."""
        if self.params.greedy:
            token = int(torch.argmax(logits).item())
            return token, token == draft
        probs = self.distribution(logits)
        return accept_sampled(probs, draft, self._generator_for(probs.device), draft_probs)

    def draw(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A drafter's token from its own `logits`, with the distribution it was drawn from:
        greedy, the argmax (certain: None); sampled, a draw from `distribution(logits)`."""
        if self.params.greedy:
            return int(torch.argmax(logits).item()), None
        with torch.inference_mode():
            probs = self.distribution(logits)
            choice = torch.multinomial(probs, 1, generator=self._generator_for(probs.device))
            return int(choice.item()), probs

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The (vocab,) log-probabilities of the distribution a token is chosen from: the
        log-softmax over the whole vocabulary of the logits as masked (grammar, min_tokens), divided
        by the temperature when sampling; top-k and top-p truncation do not renormalize it (as a
        greedy answer's log-probabilities stay those of the model's distribution)."""
        with torch.inference_mode():
            scaled = logits.float()
            if not self.params.greedy:
                scaled = _scaled(logits, self.params.temperature)
            return torch.log_softmax(scaled, dim=-1)

    def logprob(self, logits: torch.Tensor, token: int) -> float:
        """The log-probability of `token` under the distribution it was chosen from (log_probs)."""
        return float(self.log_probs(logits)[token].item())


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in float32, the largest shifted to 0 first (the softmax is the same):
    a tiny temperature then sends the others to -inf instead of every logit to +-inf, whose
    softmax is NaN."""
    wide = logits.float()
    return (wide - wide.max()) / temperature


@dataclass
class TopLogprobs:
    """The `k` most likely tokens of each generated step, most likely first: `ids[i]` and
    `logprobs[i]` belong to the i-th token generated. The log-probabilities are the chosen token's
    kind (Sampler.log_probs); ties keep torch.topk's order."""

    k: int
    ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)

    def add(self, log_probs: torch.Tensor) -> None:
        """Appends the alternatives of one step's (vocab,) log-probabilities."""
        with torch.inference_mode():
            values, indices = torch.topk(log_probs, min(self.k, log_probs.shape[-1]))
        self.ids.append(indices.tolist())
        self.logprobs.append(values.tolist())

    def since(self, start: int) -> TopLogprobs:
        """A copy holding the steps from `start` on."""
        return TopLogprobs(self.k, self.ids[start:], self.logprobs[start:])


def nucleus_mask(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of descending probabilities whose mass reaches top_p.

    A token is kept when the mass *before* it is still below top_p, so the token that crosses the
    threshold stays in (as in TensorRT-LLM) and the most likely token is always kept.
    """
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return (before < top_p).to(sorted_probs.dtype)


def generate(
    model: LlamaModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    end_id: int | None,
    params: SamplingParams,
    should_stop: Callable[[], bool] = lambda: False,
    cache: KVCache | None = None,
    start_pos: int = 0,
    history: list[int] | None = None,
    decode: DecodeStep | None = None,
    prefill_chunk: int | None = None,
    guide: CompiledGuide | None = None,
    min_tokens: int = 0,
    logprobs: list[float] | None = None,
    speculation: Drafter | None = None,
    spec_counts: SpecCounts | None = None,
    top_logprobs: TopLogprobs | None = None,
) -> Iterator[int]:
    """Stream new token ids for one request; nothing runs until the first token is requested.

    Validation happens here, eagerly, so the caller can reject a request before it starts
    streaming. `end_id` is not yielded; `should_stop` (cancellation) is polled before the prefill
    and before every decode step, so a cancelled request costs at most one more forward pass.
    `cache` lets a caller reuse one preallocated cache across requests (its contents are simply
    overwritten); by default each request gets a cache sized to prompt + max_new_tokens.
    `start_pos` > 0 says `cache` already holds the K/V of prompt positions 0..start_pos-1 (a reused
    prefix): only the rest is prefilled. `history`, when given, is extended with each token once
    its K/V is in the cache, so afterwards it names exactly the cache's valid positions.
    `decode` runs the decode steps (a CUDA-graph step, say) on `cache`; by default they are eager
    forward passes. A greedy request without a guide, drafts, `min_tokens`, log-probabilities or
    alternatives chains them (`DecodeStep.launch`): each step is queued before the token of the
    one before is read. `prefill_chunk` splits the prefill into forward passes of at most that many
    tokens, which bounds the activations and lets a cancellation stop a long prompt between chunks.
    `guide` constrains every step to its grammar: disallowed tokens are masked out of the logits
    before sampling, and a step with no allowed token, or a sampled stop token of the grammar, ends
    the generation as the end id does. The next mask is computed after the decode step is launched,
    so on a GPU it overlaps the step. The grammar's state (its matcher) exists only while the
    generation runs: it is made at the first token requested and released when the generation ends,
    however it ends.
    `min_tokens`: the end id is masked out of the logits of the first `min_tokens` steps (a
    guide's own end is left to its grammar). An `end_id` no token has (TensorRT-LLM's -1) never
    ends the generation. `logprobs`, when given, is extended with each yielded token's
    log-probability (Sampler.logprob) before the token is yielded; `top_logprobs`, when given,
    with each yielded token's step's most likely alternatives, from the same log-probabilities.
    `speculation` turns on speculative decoding with that drafter (`appliance.engine.speculative`),
    verified by the decode step's `rows` (eager, or a captured graph): same tokens when greedy,
    same distribution when sampled; a guided request or one asking for log-probabilities or
    alternatives runs without it. `spec_counts` counts its drafts,
    verify steps and switch-offs.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must contain at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    total = len(prompt_ids) + max_new_tokens
    limit = model.config.max_position_embeddings
    if total > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
            f"exceeds the model's max_position_embeddings ({limit})"
        )
    vocab = model.config.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if cache is not None and cache.max_seq_len < total:
        raise ValueError(f"the cache holds {cache.max_seq_len} tokens; this request needs {total}")
    if not 0 <= start_pos < len(prompt_ids) or (start_pos and cache is None):
        raise ValueError(
            f"start_pos must be in [0, {len(prompt_ids)}) and needs a cache holding the prefix, "
            f"got {start_pos}"
        )
    if decode is not None and decode.cache is not cache:
        raise ValueError("a decode step runs on its own cache; pass that cache")
    if prefill_chunk is not None and prefill_chunk <= 0:
        raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    if guide is not None and guide.grammars.vocab_size != vocab:
        raise ValueError(
            f"the guide was compiled for a vocabulary of {guide.grammars.vocab_size}, "
            f"the model has {vocab}"
        )
    sampler = Sampler(params)
    ends = end_id is not None and 0 <= end_id < vocab
    guided = guide is not None
    steps = functools.partial(
        _steps,
        model,
        list(prompt_ids),
        max_new_tokens,
        end_id,
        sampler,
        should_stop,
        cache,
        start_pos,
        history if history is not None else [],
        decode,
        prefill_chunk or len(prompt_ids),
        min_tokens=min_tokens if ends and not guided else 0,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        speculation=(
            speculation if not guided and logprobs is None and top_logprobs is None else None
        ),
        spec_counts=spec_counts if spec_counts is not None else SpecCounts(),
    )
    return _with_matcher(guide, end_id if ends else None, steps)


def _with_matcher(
    guide: CompiledGuide | None,
    end_id: int | None,
    steps: Callable[[GuidedMatcher | None], Iterator[int]],
) -> Iterator[int]:
    """Runs `steps` with the guide's matcher, made at the first token requested and closed when
    the generation ends, however it ends."""
    matcher = guide.matcher(end_id) if guide is not None else None
    try:
        yield from steps(matcher)
    finally:
        if matcher is not None:
            matcher.close()


def _steps(
    model: LlamaModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    end_id: int | None,
    sampler: Sampler,
    should_stop: Callable[[], bool],
    cache: KVCache | None,
    start_pos: int,
    history: list[int],
    decode: DecodeStep | None,
    prefill_chunk: int,
    guide: GuidedMatcher | None,
    *,
    min_tokens: int,
    logprobs: list[float] | None,
    top_logprobs: TopLogprobs | None,
    speculation: Drafter | None,
    spec_counts: SpecCounts,
) -> Iterator[int]:
    if max_new_tokens == 0 or should_stop():
        return
    if cache is None:
        cache = model.new_cache(len(prompt_ids) + max_new_tokens)
    speculator = Speculator(speculation, spec_counts) if speculation is not None else None
    step_once = decode or EagerDecode(model, cache)
    for start in range(start_pos, len(prompt_ids), prefill_chunk):
        if start > start_pos and should_stop():
            return
        logits = step_once.prefill(prompt_ids[start : start + prefill_chunk], start)
    if guide is not None:
        guide.fill()  # while the prefill's last chunk runs
    history.extend(prompt_ids)
    pos = len(prompt_ids)
    scored = logprobs is not None or top_logprobs is not None
    plain = guide is None and speculator is None and not min_tokens and not scored
    if plain and sampler.params.greedy:
        token = sampler(logits)
        if token == end_id:
            return
        yield token
        if max_new_tokens > 1 and not should_stop():
            yield from _chained(
                step_once, token, pos, max_new_tokens - 1, end_id, should_stop, history
            )
        return
    # Tokens a verify step chose, emitted one per step; all but the last have their K/V written.
    chosen: list[int] = []
    for step in range(max_new_tokens):
        if chosen:
            token = chosen.pop(0)
        else:
            if guide is not None and not guide.apply(logits):
                return  # the grammar allows no token here
            if step < min_tokens and end_id is not None:
                with torch.inference_mode():  # the logits are inference tensors
                    logits[end_id] = float("-inf")
            token = sampler(logits)
        if token == end_id or (guide is not None and token in guide.stop):
            return
        if logprobs is not None or top_logprobs is not None:
            scores = sampler.log_probs(logits)
            if logprobs is not None:
                logprobs.append(float(scores[token].item()))
            if top_logprobs is not None:
                top_logprobs.add(scores)
        yield token
        if step == max_new_tokens - 1 or should_stop():
            return
        if chosen:  # an accepted draft: its K/V is in the cache already
            history.append(token)
            pos += 1
            continue
        draft = (
            speculator.propose([*history, token], max_new_tokens - step - 2, sampler)
            if speculator is not None
            else None
        )
        if draft is not None and speculator is not None:
            masked = max(0, min_tokens - step - 1) if end_id is not None else 0
            chosen = verify(
                model, cache, pos, token, draft, sampler, end_id, masked, step_once.rows
            )
            speculator.record(len(draft.tokens), len(chosen) - 1)
            history.append(token)
            pos += 1
            continue
        logits = step_once(token, pos)
        if guide is not None:
            guide.advance(token)  # while the decode step runs
        history.append(token)
        pos += 1


def _chained(
    step: DecodeStep,
    token: int,
    pos: int,
    remaining: int,
    end_id: int | None,
    should_stop: Callable[[], bool],
    history: list[int],
) -> Iterator[int]:
    """Greedy tokens after `token` (at `pos`, yielded already), at most `remaining` of them, each
    step queued before the previous step's token is read (`DecodeStep.launch`). `should_stop` is
    polled before each step is queued: once it says stop, no token is yielded any more, as on
    the step-by-step path. The step queued before the stop, or for a token that turns out to be
    the end id, ran in vain; its K/V write lands after the positions `history` names."""
    chosen = step.launch(pos, token)
    while True:
        stop = should_stop()
        following = step.launch(pos + 1) if remaining > 1 and not stop else None
        token_next = chosen()
        history.append(token)
        pos += 1
        if token_next == end_id or stop:
            return
        yield token_next
        remaining -= 1
        if following is None:
            return
        token, chosen = token_next, following
