"""Prompt-lookup (n-gram) speculative decoding: drafts copied from the text so far, verified in one
forward pass.

At batch 1 a decode step is bound by reading the weights once, so scoring k + 1 tokens in one
forward pass costs little more than one. The drafter needs no second model: it finds the most
recent earlier occurrence of the text's last n-gram (n, then shorter, down to one token) and
proposes the tokens that followed it. The target model scores the current token and the drafts
at consecutive cache positions; the longest prefix the target agrees with is accepted, plus one
token chosen by the target itself, so every verify step yields at least one token.

Agreement keeps the output the target's: greedy, a draft is accepted when it is the argmax;
sampled, the standard rejection rule with a one-hot draft distribution: draft d is accepted with
probability p(d), and on rejection the token is drawn from p with d removed and renormalised.

Cache positions written for rejected drafts are never read: the next forward pass starts at the
first of them and overwrites it, and attention reads only positions up to its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from appliance.engine.llama import KVCache, LlamaModel

if TYPE_CHECKING:
    from appliance.engine.sampling import Sampler

__all__ = [
    "MAX_DRAFT_TOKENS",
    "MAX_NGRAM",
    "NgramSpeculation",
    "SpecCounts",
    "accept_sampled",
    "propose",
    "verify",
]

MAX_DRAFT_TOKENS = 16
MAX_NGRAM = 8


@dataclass(frozen=True)
class NgramSpeculation:
    """How many draft tokens a verify step scores, and the longest n-gram looked up."""

    draft_tokens: int = 4
    ngram: int = 3

    def problem(self) -> tuple[str, str] | None:
        """(option, why) when a value is out of range; None when both are usable."""
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            return "--draft-tokens", f"expected an integer in [1, {MAX_DRAFT_TOKENS}]"
        if not 1 <= self.ngram <= MAX_NGRAM:
            return "--ngram", f"expected an integer in [1, {MAX_NGRAM}]"
        return None

    def propose(self, text: Sequence[int], limit: int) -> list[int]:
        """Draft tokens to follow `text`: at most draft_tokens, and at most `limit`."""
        return propose(text, min(self.draft_tokens, limit), self.ngram)


@dataclass
class SpecCounts:
    """Draft tokens proposed to and accepted by verify steps; only move forward."""

    proposed: int = 0
    accepted: int = 0


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
    drafts: Sequence[int],
    sampler: Sampler,
    end_id: int | None,
    masked: int,
) -> list[int]:
    """Score `token` (at `pos`, not yet in the cache) and `drafts` after it in one forward pass;
    return the accepted drafts then the target's own next token.

    The K/V of `token` and of every accepted draft is in the cache afterwards; the positions of
    rejected drafts hold values nothing reads before they are overwritten. `masked` rows (the
    steps still under min_tokens) have the end id masked out, as the single-token step masks it.
    """
    rows = model.forward_rows([token, *drafts], cache, pos)
    chosen: list[int] = []
    with torch.inference_mode():
        if masked and end_id is not None:
            rows[:masked, end_id] = float("-inf")
        for i, draft in enumerate(drafts):
            choice, accepted = sampler.choose(rows[i], draft)
            chosen.append(choice)
            if not accepted:
                return chosen
        chosen.append(sampler(rows[len(drafts)]))
    return chosen


def accept_sampled(probs: torch.Tensor, draft: int, generator: torch.Generator) -> tuple[int, bool]:
    """The token the target chooses at a step given a draft, and whether it is the draft.

    `probs` is the target's distribution (vocab,); the draft is accepted with probability
    probs[draft], else a token is drawn from probs without the draft, renormalised (when the
    draft holds all the mass it is always accepted). The token's distribution is probs.
    """
    p_draft = float(probs[draft].item())
    u = float(torch.rand((), generator=generator, device=generator.device).item())
    if u < p_draft or p_draft >= 1.0:
        return draft, True
    residual = probs.clone()
    residual[draft] = 0.0
    choice = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return int(choice.item()), False
