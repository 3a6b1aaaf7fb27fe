"""Short prefills captured as CUDA graphs: a prompt padded to one of a few bucketed lengths.

A short prompt's prefill, like a decode step, is hundreds of small kernels whose launch gaps, not
their arithmetic, set its time on a GPU. So a few prompt lengths ("buckets", 16, 32, 64 and 128
tokens by default) are captured at start-up like the decode step, one graph per bucket and
attention span, and a prefill of n new tokens replays the smallest bucket that holds them, its
tail padded (`LlamaModel.prefill_static` makes padding affect nothing). The bucket is chosen by the
tokens being computed, not the prompt: a prompt continuing a reused prefix (or the last chunk of a
long prompt) pays for its new tokens only, attending to the cached positions before them over the
smallest span that covers them.

On the Triton kernels a bucket of at most `fused.FUSED_ROWS` tokens is captured from the fused
step (`fused.static_rows`: eight launches a block, a decode step nine); a larger one from the torch
step, whose products are bound by arithmetic there.

A prefill with more new tokens than the largest bucket, or one whose padded bucket would run past
the end of the cache, runs eager (`LlamaModel.forward`); that is a fallback, not an error.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from functools import partial

import torch

from appliance.engine.decode import Capture, parse_counts
from appliance.engine.llama import KVCache, LlamaModel

__all__ = [
    "MAX_PREFILL_BUCKET",
    "PREFILL_BUCKETS",
    "GraphPrefill",
    "bucket_problem",
    "parse_buckets",
    "prefill_graph_count",
]

# Prompt lengths captured by default.
PREFILL_BUCKETS = (16, 32, 64, 128)
# The longest bucket accepted: past this a prefill is compute-bound and gains nothing from a graph,
# while every bucket is captured once per attention span.
MAX_PREFILL_BUCKET = 2048


def bucket_problem(buckets: Sequence[int]) -> str | None:
    """Why `buckets` cannot be captured (None: they can)."""
    if any(not 1 <= b <= MAX_PREFILL_BUCKET for b in buckets):
        return (
            f"each bucket must be a token count in [1, {MAX_PREFILL_BUCKET}], got {list(buckets)}"
        )
    return None


def parse_buckets(text: str) -> tuple[int, ...]:
    """`--prefill-buckets`: comma-separated token counts, or `none` (no prefill captured)."""
    buckets = parse_counts(text, "none", "token counts")
    if buckets is None:
        return ()
    why = bucket_problem(buckets)
    if why:
        raise ValueError(why)
    return buckets


def _graphs(buckets: Sequence[int], spans: Sequence[int]) -> list[tuple[int, int]]:
    """(bucket, span) of every graph: each bucket over each span that can hold it."""
    return [(b, s) for b in sorted(set(buckets)) for s in spans if s >= b]


def prefill_graph_count(buckets: Sequence[int], spans: Sequence[int]) -> int:
    """How many graphs `GraphPrefill` captures (the fit check reserves memory per graph)."""
    return len(_graphs(buckets, spans))


class GraphPrefill:
    """The bucketed prefill, captured once per (bucket, span) and replayed per prompt.

    Static buffers, allocated once: `prefill_in` (2 + largest bucket,) long holds the start
    position, the live token count and the padded tokens; `logits` (vocab,) float32 is written by
    every replay.
    """

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        capture: Capture,
        buckets: Sequence[int],
        spans: Sequence[int],
    ) -> None:
        why = bucket_problem(buckets)
        if why or not buckets:
            raise ValueError(why or "no prefill buckets to capture")
        self.model = model
        self.cache = cache
        self.buckets = sorted(set(buckets))
        self.spans = list(spans)
        device = model.device
        self.prefill_in = torch.zeros(2 + self.buckets[-1], dtype=torch.long, device=device)
        # A valid request before any arrives: the capture's warm-up runs the body on these
        # values (start 0, one live token), and a count of 0 would index row -1.
        self.prefill_in[1] = 1
        self.logits = torch.empty(model.config.vocab_size, dtype=torch.float32, device=device)
        meta = self.prefill_in[:2]
        with torch.inference_mode():
            self._replays = {
                (b, s): capture(
                    partial(
                        model.prefill_static,
                        self.prefill_in[2 : 2 + b],
                        meta,
                        cache,
                        s,
                        self.logits,
                    )
                )
                for b, s in _graphs(self.buckets, self.spans)
            }

    def choose(self, count: int, start: int) -> tuple[int, int] | None:
        """(bucket, span) for `count` new tokens at positions start..: the smallest bucket that
        holds them and ends inside the cache, over the smallest span covering it; None: eager."""
        i = bisect.bisect_left(self.buckets, count)
        if i == len(self.buckets) or start + self.buckets[i] > self.cache.max_seq_len:
            return None
        bucket = self.buckets[i]
        span = self.spans[bisect.bisect_left(self.spans, start + bucket)]
        return bucket, span

    def __call__(self, token_ids: Sequence[int], start: int) -> torch.Tensor | None:
        """Logits (vocab,) float32 of the last of `token_ids` at positions start.. (valid until
        the next call), or None when no bucket fits them and the caller prefills eagerly."""
        count = len(token_ids)
        if count == 0:
            raise ValueError("a prefill needs at least one token")
        vocab = self.model.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got {list(token_ids)[:16]}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        chosen = self.choose(count, start)
        if chosen is None:
            return None
        bucket, span = chosen
        row = [start, count, *token_ids] + [0] * (bucket - count)
        with torch.inference_mode():
            self.prefill_in[: 2 + bucket].copy_(torch.tensor(row, dtype=torch.long))
            self._replays[bucket, span]()
        return self.logits
