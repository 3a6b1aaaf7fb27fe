"""What a weight format costs in quality: perplexity over a text and agreement with a reference.

Three numbers per format, each against the same token ids:

- perplexity: exp of the mean next-token cross-entropy over the text, scored in windows of
  `window` tokens (each window starts fresh; every token after a window's first is scored);
- teacher-forced top-1 agreement: the share of those positions where the format's most likely
  next token is the reference's;
- greedy agreement: for each prompt, the reference's and the format's greedy continuations are
  compared token by token up to the first difference (after it they continue different texts),
  as a share of all generated tokens.

The per-position logits come from the model's own prefill path (`LlamaModel._blocks` and
`_logits`) without a KV cache, so a window is one batched forward, not one decode step per token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from appliance.engine.llama import LlamaModel

__all__ = ["FormatQuality", "greedy", "measure", "token_logits"]


def token_logits(model: LlamaModel, ids: Sequence[int]) -> torch.Tensor:
    """float32 logits (len(ids), vocab): entry i predicts token i + 1; positions 0.. of one window."""
    c = model.config
    if not 0 < len(ids) <= c.max_position_embeddings:
        raise ValueError(f"a window holds 1..{c.max_position_embeddings} tokens, got {len(ids)}")
    return model.sequence_logits(ids)


def greedy(model: LlamaModel, prompt: Sequence[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt`, through the serving path (prefill, decode steps)."""
    cache = model.new_cache(len(prompt) + steps)
    logits = model.forward(prompt, cache, 0)
    out: list[int] = []
    for i in range(steps):
        token = int(logits.argmax())
        out.append(token)
        if i + 1 < steps:
            logits = model.forward([token], cache, len(prompt) + i)
    return out


@dataclass(frozen=True)
class FormatQuality:
    """One format's numbers; agreement is None for the reference itself."""

    name: str
    weight_bytes: int
    perplexity: float
    scored_tokens: int
    top1_agreement: float | None
    greedy_agreement: float | None
    decode_ms: float  # wall time per greedy token, its prompt's prefill included


def _windows(ids: Sequence[int], window: int) -> list[list[int]]:
    return [list(ids[i : i + window]) for i in range(0, len(ids) - 1, window) if i + 1 < len(ids)]


def measure(
    name: str,
    model: LlamaModel,
    ids: Sequence[int],
    prompts: Sequence[Sequence[int]],
    steps: int,
    window: int,
    reference: tuple[list[torch.Tensor], list[list[int]]] | None,
) -> tuple[FormatQuality, tuple[list[torch.Tensor], list[list[int]]]]:
    """Score `model` on `ids` and `prompts`; `reference` is the reference format's (top-1 per
    window, greedy continuations), None when `model` is the reference. Returns this format's
    numbers and its own (top-1, continuations) for use as a reference."""
    nll = 0.0
    scored = 0
    tops: list[torch.Tensor] = []
    for chunk in _windows(ids, window):
        logits = token_logits(model, chunk)[:-1]
        targets = torch.tensor(chunk[1:], device=logits.device)
        nll += float(F.cross_entropy(logits, targets, reduction="sum"))
        scored += len(chunk) - 1
        tops.append(logits.argmax(dim=-1).cpu())
    top1 = None
    if reference is not None:
        same = sum(int((a == b).sum()) for a, b in zip(tops, reference[0], strict=True))
        top1 = same / scored
    started = time.perf_counter()
    continuations = [greedy(model, p, steps) for p in prompts]
    decode_ms = (time.perf_counter() - started) * 1000 / max(1, len(prompts) * steps)
    agreement = None
    if reference is not None:
        agreed = 0
        for got, want in zip(continuations, reference[1], strict=True):
            agreed += next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want)
            )
        agreement = agreed / max(1, len(prompts) * steps)
    quality = FormatQuality(
        name=name,
        weight_bytes=model.weight_bytes,
        perplexity=math.exp(nll / scored) if scored else float("nan"),
        scored_tokens=scored,
        top1_agreement=top1,
        greedy_agreement=agreement,
        decode_ms=decode_ms,
    )
    return quality, (tops, continuations)
