"""Speculative decoding: drafts proposed by a drafter, verified by the target in one forward pass.

At batch 1 a decode step is bound by reading the weights once, so scoring k + 1 tokens in one
forward pass costs little more than one. A drafter (`Drafter`) proposes up to k tokens to follow
the text so far; the target model scores the current token and the drafts at consecutive cache
positions; the longest prefix the target agrees with is accepted, plus one token chosen by the
target itself, so every verify step yields at least one token. Two drafters plug in the same way:
prompt lookup (`NgramSpeculation`, here: drafts copied from the most recent earlier occurrence of
the text's last n-gram) and a smaller model of the same tokenizer
(`appliance.engine.draft_model.DraftModelDrafter`).

Agreement keeps the output the target's: greedy, a draft is accepted when it is the argmax;
sampled, the standard rejection rule: draft d, drawn from the drafter's distribution q, is accepted
with probability min(1, p(d) / q(d)), and on rejection the token is drawn from max(0, p - q),
renormalised. A drafter whose drafts are certain (prompt lookup, or any greedy drafter) has a
one-hot q: d is accepted with probability p(d), else drawn from p without d.

Cache positions written for rejected drafts are never read: the next forward pass starts at the
first of them and overwrites it, and attention reads only positions up to its own.

Speculation switches itself off where it does not pay (`OffSwitch`): per request, when the drafts
accepted per verify step over the last `window` verify steps fall below the drafter's break-even,
drafting rests for `cooldown` tokens (doubled each time it switches off again in the request).
With `probe_every` set, the drafter remembers across requests instead (`AcceptanceMemory`): a
request starts with drafting resting when the recent verify steps did not pay, and then drafts only
one probe (a single verify step) every `probe_every` tokens of the drafter's traffic (the spacing
carries from request to request), or fewer where a probe costs more than a small share of the time
between probes, until the remembered acceptance reaches
break-even again; a drafting request goes back to probing as soon as the remembered acceptance
falls below break-even (after two verify steps of its own). The break-even is then
measured rather than assumed: a verify step that costs c decode steps pays when it accepts more
than c - 1 drafts, c being the ratio of the remembered wall time per verify step (its drafting
included) to that per decode step.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from appliance.engine.llama import KVCache, LlamaModel

if TYPE_CHECKING:
    from appliance.engine.sampling import Sampler

__all__ = [
    "MAX_DRAFT_TOKENS",
    "MAX_NGRAM",
    "AcceptanceMemory",
    "Draft",
    "Drafter",
    "NgramSpeculation",
    "OffSwitch",
    "SpecCounts",
    "Speculator",
    "accept_sampled",
    "propose",
    "verify",
]

MAX_DRAFT_TOKENS = 16
MAX_NGRAM = 8


@dataclass(frozen=True)
class Draft:
    """Draft tokens, and the drafter's distributions they were drawn from: `probs` (n, vocab),
    None when every draft is certain (a one-hot distribution)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class OffSwitch:
    """When a request stops drafting: the mean accepted drafts per verify step over the last
    `window` verify steps below `min_accepted` rests drafting for `cooldown` decode steps, doubled
    at each further switch-off in the same request. `min_accepted` 0 never switches off.

    `probe_every` > 0 uses the drafter's `AcceptanceMemory` instead of the window: `min_accepted`
    is the break-even until the memory has measured one, a request whose drafter's recent verify
    steps did not pay probes (one verify step, then at least `probe_every` - 1 decode steps
    resting, counted along the drafter's requests: more where the measured probe cost asks,
    `AcceptanceMemory.probe_gap`), and a drafting request goes back to probing as soon as the remembered mean falls
    below break-even (after `Speculator.SETTLE_STEPS` verify steps of its own), not after a
    window: a window of unpaid verify steps after each paying probe is what a low-acceptance
    workload would pay again and again. 0: each request on its own."""

    window: int = 8
    min_accepted: float = 0.5
    cooldown: int = 32
    probe_every: int = 0


class AcceptanceMemory:
    """A drafter's acceptance and step costs across requests: exponentially weighted means of the
    drafts accepted per verify step and of the wall time per verify step and per decode step.

    One instance per drafter (so per model); only the compute thread updates it.
    """

    ACCEPTED_WEIGHT = 0.25  # a probe that accepts every draft lifts a resting drafter at once
    TIME_WEIGHT = 0.1
    MIN_TIMED = 8  # steps of each kind timed before the measured break-even is used
    BREAK_EVEN_RANGE = (0.1, float(MAX_DRAFT_TOKENS))
    PROBE_SHARE = 0.02  # the most a resting drafter's probes add to the decode time
    MAX_PROBE_GAP = 1024

    def __init__(self) -> None:
        # Tokens the drafter still rests before its next probe, carried from request to request:
        # probes are spaced along the drafter's traffic, so a short request is not probed at its
        # first token every time.
        self.rest = 0
        self.accepted: float | None = None
        self.verify_s: float | None = None
        self.decode_s: float | None = None
        self.timed_verify = 0
        self.timed_decode = 0

    def observe(self, accepted: int) -> None:
        """One verify step's accepted drafts."""
        self.accepted = _ewma(self.accepted, float(accepted), self.ACCEPTED_WEIGHT)

    def observe_step(self, verified: bool, seconds: float) -> None:
        """The wall time of one verify step (its drafting included) or one decode step."""
        if not seconds > 0.0:
            return
        if verified:
            self.verify_s = _ewma(self.verify_s, seconds, self.TIME_WEIGHT)
            self.timed_verify += 1
        else:
            self.decode_s = _ewma(self.decode_s, seconds, self.TIME_WEIGHT)
            self.timed_decode += 1

    def break_even(self, prior: float) -> float:
        """Accepted drafts per verify step at which drafting pays: the measured verify cost in
        decode steps less one (bounded), or `prior` until both kinds of step have been timed."""
        if self.verify_s is None or self.decode_s is None:
            return prior
        if min(self.timed_verify, self.timed_decode) < self.MIN_TIMED:
            return prior
        low, high = self.BREAK_EVEN_RANGE
        return min(high, max(low, self.verify_s / self.decode_s - 1.0))

    def probe_gap(self, probe_every: int) -> int:
        """Tokens from one probe to the next: `probe_every`, or more where a probe's measured
        extra cost (verify cost in decode steps less one) would exceed PROBE_SHARE of the decode
        steps between probes, so a resting drafter costs a bounded share whatever its cost."""
        if self.verify_s is None or self.decode_s is None:
            return probe_every
        if min(self.timed_verify, self.timed_decode) < self.MIN_TIMED:
            return probe_every
        extra = self.verify_s / self.decode_s - 1.0
        return max(probe_every, min(self.MAX_PROBE_GAP, math.ceil(extra / self.PROBE_SHARE)))

    def pays(self, prior: float) -> bool:
        """Whether the remembered acceptance reaches break-even (unknown counts as paying)."""
        return self.accepted is None or self.accepted >= self.break_even(prior)


def _ewma(mean: float | None, value: float, weight: float) -> float:
    return value if mean is None else mean + weight * (value - mean)


class Drafter(Protocol):
    """Proposes the tokens to follow a text; the runner's one instance serves one request at a
    time (the compute thread), so it may keep state, such as a KV cache, across calls."""

    @property
    def off_switch(self) -> OffSwitch:
        """When a request stops asking this drafter (its break-even acceptance)."""
        ...

    @property
    def memory(self) -> AcceptanceMemory:
        """This drafter's acceptance across requests (read when off_switch.probe_every > 0)."""
        ...

    def propose(self, text: Sequence[int], limit: int, sampler: Sampler) -> Draft:
        """At most `limit` (and at most the drafter's own k) tokens to follow `text`, whose last
        token is the current one (not yet in the target's cache). `sampler` is the request's:
        a drafter that samples draws from it and returns its distributions."""
        ...


@dataclass(frozen=True)
class NgramSpeculation:
    """Prompt lookup: how many draft tokens a verify step scores, and the longest n-gram looked up.

    A lookup costs nothing beside the verify step, whose k + 1 rows cost little more than one:
    break-even is a fraction of a token per verify step, and a probe costs that fraction.
    """

    draft_tokens: int = 4
    ngram: int = 3
    off_switch: OffSwitch = OffSwitch(min_accepted=0.5, probe_every=32)
    memory: AcceptanceMemory = field(
        default_factory=AcceptanceMemory, compare=False, repr=False, hash=False
    )

    def problem(self) -> tuple[str, str] | None:
        """(option, why) when a value is out of range; None when both are usable."""
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            return "--draft-tokens", f"expected an integer in [1, {MAX_DRAFT_TOKENS}]"
        if not 1 <= self.ngram <= MAX_NGRAM:
            return "--ngram", f"expected an integer in [1, {MAX_NGRAM}]"
        return None

    def propose(self, text: Sequence[int], limit: int, sampler: Sampler | None = None) -> Draft:
        """Draft tokens to follow `text`: at most draft_tokens, and at most `limit`; certain."""
        return Draft(propose(text, min(self.draft_tokens, limit), self.ngram))


@dataclass
class SpecCounts:
    """Draft tokens proposed to and accepted by verify steps, the verify steps, and how often
    speculation switched itself off; only move forward."""

    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0
    switched_off: int = 0


class Speculator:
    """One request's speculation: its drafter, behind the request's off switch, and its counts."""

    # Verify steps a request drafts before the remembered mean may send it back to probing: one
    # rejected draft after a probe that paid does not.
    SETTLE_STEPS = 2

    def __init__(
        self,
        drafter: Drafter,
        counts: SpecCounts,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.drafter = drafter
        self.counts = counts
        self.switch = drafter.off_switch
        remembers = self.switch.probe_every > 0 and self.switch.min_accepted > 0.0
        self.memory = drafter.memory if remembers else None
        self._clock = clock
        self._recent: deque[int] = deque(maxlen=max(1, self.switch.window))
        self._resting = 0
        self._cooldown = self.switch.cooldown
        # Probing: drafting rests but for one verify step every probe gap (AcceptanceMemory.rest).
        self.probing = self.memory is not None and not self.memory.pays(self.switch.min_accepted)
        # Verify steps this request has drafted since it last probed.
        self._drafted = 0
        # When the previous step began, and whether it was a verify step.
        self._began: float | None = None
        self._verified = False

    def propose(self, text: Sequence[int], limit: int, sampler: Sampler) -> Draft | None:
        """The drafter's drafts, or None while drafting rests or when it proposes nothing."""
        draft = self._propose(text, limit, sampler)
        if self.memory is not None:
            # The previous step ran from its proposal to this one.
            now = self._clock()
            if self._began is not None:
                self.memory.observe_step(self._verified, now - self._began)
            self._began, self._verified = now, draft is not None
        return draft

    def _propose(self, text: Sequence[int], limit: int, sampler: Sampler) -> Draft | None:
        if self._resting > 0:
            self._resting -= 1
            return None
        if self.probing and self.memory is not None and self.memory.rest > 0:
            self.memory.rest -= 1
            return None
        if limit <= 0:
            return None
        draft = self.drafter.propose(text, limit, sampler)
        return draft if draft.tokens else None

    def record(self, proposed: int, accepted: int) -> None:
        """Count one verify step; switch drafting off (or to probing) when acceptance is too low."""
        self.counts.proposed += proposed
        self.counts.accepted += accepted
        self.counts.verify_steps += 1
        if self.memory is not None:
            self._remember(self.memory, accepted)
            return
        self._recent.append(accepted)
        window = self.switch.window
        if len(self._recent) < window or window <= 0 or self.switch.min_accepted <= 0.0:
            return
        if sum(self._recent) / window < self.switch.min_accepted:
            self.counts.switched_off += 1
            self._recent.clear()
            self._resting = self._cooldown
            self._cooldown *= 2

    def _remember(self, memory: AcceptanceMemory, accepted: int) -> None:
        """Probing ends when the remembered mean reaches break-even; drafting goes back to
        probing when it falls below (after SETTLE_STEPS verify steps of this request)."""
        memory.observe(accepted)
        pays = memory.pays(self.switch.min_accepted)
        if self.probing:
            self.probing = not pays
            self._drafted = 0
        else:
            self._drafted += 1
            if pays or self._drafted < self.SETTLE_STEPS:
                return
            self.counts.switched_off += 1
            self.probing = True
        memory.rest = memory.probe_gap(self.switch.probe_every) - 1 if self.probing else 0


def propose(text: Sequence[int], k: int, ngram: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest (at most
    `ngram`) suffix of `text`; empty when no suffix recurs or k <= 0."""
    if k <= 0:
        return []
    n_text = len(text)
    for n in range(min(ngram, n_text - 1), 0, -1):
        tail = list(text[n_text - n :])
        # Scan from the most recent start that leaves the suffix itself out.
        for start in range(n_text - n - 1, -1, -1):
            if list(text[start : start + n]) == tail:
                follow = list(text[start + n : start + n + k])
                if follow:
                    return follow
    return []


def verify(
    model: LlamaModel,
    cache: KVCache,
    pos: int,
    token: int,
    draft: Draft,
    sampler: Sampler,
    end_id: int | None,
    masked: int,
    rows: Callable[[Sequence[int], int], torch.Tensor] | None = None,
) -> list[int]:
    """Score `token` (at `pos`, not yet in the cache) and the drafts after it in one forward pass
    (by `rows`, a decode step's on `cache`, eager or a captured graph; by default the model's
    `forward_rows`); return the accepted drafts then the target's own next token.

    The K/V of `token` and of every accepted draft is in the cache afterwards; the positions of
    rejected drafts hold values nothing reads before they are overwritten. `masked` rows (the
    steps still under min_tokens) have the end id masked out, as the single-token step masks it.
    """
    drafts = draft.tokens
    tokens = [token, *drafts]
    logits = model.forward_rows(tokens, cache, pos) if rows is None else rows(tokens, pos)
    chosen: list[int] = []
    with torch.inference_mode():
        if masked and end_id is not None:
            logits[:masked, end_id] = float("-inf")
        for i, proposed in enumerate(drafts):
            q = None if draft.probs is None else draft.probs[i]
            choice, accepted = sampler.choose(logits[i], proposed, q)
            chosen.append(choice)
            if not accepted:
                return chosen
        chosen.append(sampler(logits[len(drafts)]))
    return chosen


def accept_sampled(
    probs: torch.Tensor,
    draft: int,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> tuple[int, bool]:
    """The token the target chooses at a step given a draft, and whether it is the draft.

    `probs` is the target's distribution p (vocab,) and `draft_probs` the drafter's q the draft
    was drawn from (None: the draft was certain). The draft is accepted with probability
    min(1, p(d) / q(d)), else a token is drawn from max(0, p - q) renormalised (for a certain
    draft: p without the draft). The token's distribution is p.
    """
    p_draft = float(probs[draft].item())
    q_draft = 1.0 if draft_probs is None else float(draft_probs[draft].item())
    u = float(torch.rand((), generator=generator, device=generator.device).item())
    if q_draft <= 0.0 or u * q_draft < p_draft or p_draft >= q_draft:
        # q(d) 0 cannot happen for a draft drawn from q; accepting it keeps the step defined.
        return draft, True
    if draft_probs is None:
        residual = probs.clone()
        residual[draft] = 0.0
    else:
        residual = (probs - draft_probs.to(probs.device, probs.dtype)).clamp_(min=0.0)
    total = float(residual.sum().item())
    if total <= 0.0:  # p equals q up to rounding: p itself is the residual's limit
        residual, total = probs, float(probs.sum().item())
    choice = torch.multinomial(residual / total, 1, generator=generator)
    return int(choice.item()), False
