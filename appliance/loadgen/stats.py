"""The figures of a bench run, computed from its per-request records (no I/O here).

Definitions (client side, every time from the bench's own clock):
- TTFT: first non-empty response − request sent (genai-perf).
- Inter-token latency (ITL): (request latency − TTFT) / (output tokens − 1) per request (genai-perf;
  vLLM calls it TPOT). Only answers generated for the request count: a cache hit arrives as one
  message, so it has no inter-token latency.
- Chunk gap: every gap between consecutive streamed messages after the first, pooled over requests
  (vLLM's ITL).
- Request latency: request sent → stream closed.
- Output tokens/s per request: 1 / ITL = (output tokens − 1) / (request latency − TTFT), the
  decode speed one user sees (genai-perf's output token throughput per user).
- Output token throughput and request throughput: successful requests' output tokens, and their
  number, over the level's wall time (first request sent → last answer received).
Percentiles are numpy's (linear interpolation between the closest ranks).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance.client import inter_token_latency
from appliance.loadgen.options import Level

OK = "OK"
INTERRUPTED = "INTERRUPTED"  # in flight when the run was interrupted; not an error, not measured
MISS = "MISS"
# Failures the client sees without a gRPC status: an open-loop arrival over --max-in-flight, and a
# stream that ended without its final message.
NOT_SENT = "NOT_SENT"
NO_FINAL = "NO_FINAL"
# An answer the server ended early (FINISH_REASON_CANCELLED, e.g. a gateway shutting down): its
# figures are not those of a whole answer, so it counts as a failure of its own.
CANCELLED_BY_SERVER = "CANCELLED_BY_SERVER"
QUANTILES = (50, 90, 99)


@dataclass
class Record:
    """One request as the client saw it; times in seconds, `start_s` from the run's start."""

    level: str
    index: int
    start_s: float
    status: str = OK  # OK, a gRPC status code name, one of the failures above, or INTERRUPTED
    error: str = ""
    request_id: str = ""
    ttft_s: float | None = None
    latency_s: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    max_tokens: int = 0
    finish_reason: str = ""
    cache_tier: str = ""
    degraded: bool = False
    server_queue_us: int = 0
    server_ttft_us: int = 0
    server_total_us: int = 0
    gaps_s: list[float] = field(default_factory=list)

    @property
    def generated(self) -> bool:
        """Succeeded and generated for this request (not a cache hit)."""
        return self.status == OK and self.cache_tier == MISS

    @property
    def itl_s(self) -> float | None:
        if not self.generated or self.ttft_s is None or self.latency_s is None:
            return None
        return inter_token_latency(self.latency_s, self.ttft_s, self.output_tokens)

    @property
    def first_token_s(self) -> float | None:
        return None if self.ttft_s is None else self.start_s + self.ttft_s

    @property
    def end_s(self) -> float | None:
        return None if self.latency_s is None else self.start_s + self.latency_s


@dataclass(frozen=True)
class Distribution:
    n: int
    avg: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    def scaled(self, factor: float) -> Distribution:
        return Distribution(
            self.n,
            *(v * factor for v in (self.avg, self.p50, self.p90, self.p99, self.min, self.max)),
        )


def distribution(values: list[float]) -> Distribution | None:
    """avg, P50/P90/P99, min, max of values; None when there are none."""
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, QUANTILES)
    return Distribution(len(a), float(a.mean()), p50, p90, p99, float(a.min()), float(a.max()))


# (key, table row, unit scale from the record's seconds or counts)
METRICS = (
    ("ttft_ms", "Time to first token (ms)", 1e3),
    ("itl_ms", "Inter-token latency (ms)", 1e3),
    ("chunk_gap_ms", "Chunk gap, pooled (ms)", 1e3),
    ("latency_ms", "Request latency (ms)", 1e3),
    ("output_tokens_per_s", "Output tokens/s per request", 1.0),
    ("output_tokens", "Output tokens per request", 1.0),
    ("input_tokens", "Input tokens per request", 1.0),
)


@dataclass(frozen=True)
class LevelSummary:
    level: str
    mode: str  # "concurrency" | "rate"
    value: float
    sent: int  # requests sent (an open-loop arrival over --max-in-flight is not)
    ok: int
    errors: dict[str, int]  # status name -> count
    first_errors: dict[str, str]  # status name -> the first such request's error message
    interrupted: int
    cache_tiers: dict[str, int]  # of the successful requests
    wall_s: float
    request_throughput: float  # successful requests per second
    output_token_throughput: float  # output tokens of successful requests per second
    metrics: dict[str, Distribution | None]

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "metrics"}
        out["metrics"] = {k: (v.__dict__ if v else None) for k, v in self.metrics.items()}
        return out


def _first_errors(done: list[Record]) -> dict[str, str]:
    """The error message of the first request (by start) of each failing status."""
    first: dict[str, str] = {}
    for r in sorted(done, key=lambda r: r.start_s):
        if r.status != OK and r.status not in first:
            first[r.status] = r.error
    return dict(sorted(first.items()))


def summarize(level: Level, records: list[Record]) -> LevelSummary:
    """The level's figures; INTERRUPTED records count as sent but are not measured."""
    done = [r for r in records if r.status != INTERRUPTED]
    ok = [r for r in done if r.status == OK]
    generated = [r for r in ok if r.generated]
    ends = [e for r in done if (e := r.end_s) is not None]
    wall = max(ends) - min(r.start_s for r in done) if ends else 0.0
    per_user = [1.0 / itl for r in generated if (itl := r.itl_s)]
    raw: dict[str, list[float]] = {
        "ttft_ms": [r.ttft_s for r in ok if r.ttft_s is not None],
        "itl_ms": [i for r in generated if (i := r.itl_s) is not None],
        "chunk_gap_ms": [g for r in generated for g in r.gaps_s],
        "latency_ms": [r.latency_s for r in ok if r.latency_s is not None],
        "output_tokens_per_s": per_user,
        "output_tokens": [float(r.output_tokens) for r in ok],
        "input_tokens": [float(r.input_tokens) for r in ok],
    }
    metrics = {}
    for key, _, scale in METRICS:
        d = distribution(raw[key])
        metrics[key] = d.scaled(scale) if d is not None else None
    tokens = sum(r.output_tokens for r in ok)
    return LevelSummary(
        level=level.label,
        mode=level.mode,
        value=level.value,
        sent=sum(1 for r in records if r.status != NOT_SENT),
        ok=len(ok),
        errors=dict(sorted(Counter(r.status for r in done if r.status != OK).items())),
        first_errors=_first_errors(done),
        interrupted=len(records) - len(done),
        cache_tiers=dict(sorted(Counter(r.cache_tier for r in ok).items())),
        wall_s=wall,
        request_throughput=len(ok) / wall if wall > 0 else 0.0,
        output_token_throughput=tokens / wall if wall > 0 else 0.0,
        metrics=metrics,
    )
