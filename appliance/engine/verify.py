"""The verify step of speculative decoding captured as CUDA graphs: one per draft count and span.

A verify step scores the current token and k drafts at k + 1 consecutive cache positions in one
forward pass (`LlamaModel.forward_rows`). At batch 1 it is, like a decode step, hundreds of small
kernels whose launch gaps set its time on a GPU, so it is captured at start-up like the decode step:
one graph per captured draft count k ("verify graphs", `--verify-graphs`) and attention span,
replayed with the position and tokens as data (`LlamaModel.verify_static`).

A draft of k tokens replays the graph of the smallest captured count >= k, its tail padded (the
padded rows affect nothing, as a bucketed prefill's do); one whose padded rows would run past the
end of the cache, or longer than every captured count, runs eager (`forward_rows`), a fallback and
not an error. The configuration check (`appliance.engine.options`) refuses a `--draft-tokens` that
is not itself captured, so a full draft never pays for padding.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from functools import partial

import torch

from appliance.engine.decode import Capture, parse_counts
from appliance.engine.llama import KVCache, LlamaModel
from appliance.engine.speculative import MAX_DRAFT_TOKENS

__all__ = [
    "GraphVerify",
    "default_verify_counts",
    "parse_verify_graphs",
    "verify_counts_problem",
    "verify_graph_count",
]


def default_verify_counts(draft_tokens: int) -> tuple[int, ...]:
    """The draft counts captured for `--draft-tokens` K when `--verify-graphs` is auto: the powers
    of two below K, then K (K=4: 1, 2, 4; K=6: 1, 2, 4, 6)."""
    counts = {draft_tokens}
    k = 1
    while k < draft_tokens:
        counts.add(k)
        k *= 2
    return tuple(sorted(counts))


def verify_counts_problem(counts: Sequence[int]) -> str | None:
    """Why the draft counts `counts` cannot be captured (None: they can)."""
    if not counts or any(not 1 <= k <= MAX_DRAFT_TOKENS for k in counts):
        return f"each draft count must be in [1, {MAX_DRAFT_TOKENS}], got {list(counts)}"
    return None


def parse_verify_graphs(text: str) -> tuple[int, ...] | None:
    """`--verify-graphs`: comma-separated draft counts, or `auto` (None: derived from
    --draft-tokens by `default_verify_counts`)."""
    counts = parse_counts(text, "auto", "draft counts")
    if counts is None:
        return None
    why = verify_counts_problem(counts)
    if why:
        raise ValueError(why)
    return counts


def _graphs(counts: Sequence[int], spans: Sequence[int]) -> list[tuple[int, int]]:
    """(rows, span) of every graph: k + 1 rows of each count over each span that holds them."""
    return [(k + 1, s) for k in sorted(set(counts)) for s in spans if s >= k + 1]


def verify_graph_count(counts: Sequence[int], spans: Sequence[int]) -> int:
    """How many graphs `GraphVerify` captures (the fit check reserves memory per graph)."""
    return len(_graphs(counts, spans))


class GraphVerify:
    """The verify step, captured once per (draft count, span) and replayed per draft.

    Static buffers, allocated once: `verify_in` (2 + rows,) long holds the position, the live row
    count and the token then its drafts, padded; `logits` (rows, vocab) float32, whose first rows
    every replay writes (rows: the largest draft count + 1).
    """

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        capture: Capture,
        draft_counts: Sequence[int],
        spans: Sequence[int],
    ) -> None:
        why = verify_counts_problem(draft_counts)
        if why:
            raise ValueError(why)
        self.model = model
        self.cache = cache
        self.draft_counts = sorted(set(draft_counts))
        self.spans = list(spans)
        rows = self.draft_counts[-1] + 1
        device = model.device
        self.verify_in = torch.zeros(2 + rows, dtype=torch.long, device=device)
        # A valid request before any arrives: the capture's warm-up runs the body on these
        # values (start 0, one live token), and a count of 0 would index row -1.
        self.verify_in[1] = 1
        vocab = model.config.vocab_size
        self.logits = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        meta = self.verify_in[:2]
        with torch.inference_mode():
            self._replays = {
                (n, s): capture(
                    partial(
                        model.verify_static,
                        self.verify_in[2 : 2 + n],
                        meta,
                        cache,
                        s,
                        self.logits[:n],
                    )
                )
                for n, s in _graphs(self.draft_counts, self.spans)
            }

    def choose(self, rows: int, start: int) -> tuple[int, int] | None:
        """(graph rows, span) for `rows` rows at positions start..: the smallest captured count
        that holds them and ends inside the cache, over the smallest span covering it; None:
        eager."""
        i = bisect.bisect_left(self.draft_counts, rows - 1)
        if i == len(self.draft_counts):
            return None
        padded = self.draft_counts[i] + 1
        if start + padded > self.cache.max_seq_len:
            return None
        return padded, self.spans[bisect.bisect_left(self.spans, start + padded)]

    def load(self, token_ids: Sequence[int], start: int) -> Callable[[], None] | None:
        """Copy the n `token_ids` (the token, then its drafts) at positions start.. into
        `verify_in` and return the graph that scores them (its replay writes `logits[:n]`), or
        None when no graph holds them and the caller verifies eagerly."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("a verify step needs at least one token")
        vocab = self.model.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got {list(token_ids)[:16]}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        chosen = self.choose(n, start)
        if chosen is None:
            return None
        padded = chosen[0]
        row = [start, n, *token_ids] + [0] * (padded - n)
        with torch.inference_mode():
            self.verify_in[: 2 + padded].copy_(torch.tensor(row, dtype=torch.long))
        return self._replays[chosen]

    def __call__(self, token_ids: Sequence[int], start: int) -> torch.Tensor | None:
        """Float32 logits (n, vocab) of each of the n `token_ids` at positions start.. (valid
        until the next call), or None when no graph holds them (`load`)."""
        replay = self.load(token_ids, start)
        if replay is None:
            return None
        with torch.inference_mode():
            replay()
        return self.logits[: len(token_ids)]
