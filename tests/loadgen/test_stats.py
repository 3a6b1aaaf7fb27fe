"""The bench's figures from known records: definitions, exclusions and numpy's percentiles."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.loadgen.options import Level
from appliance.loadgen.stats import INTERRUPTED, Record, distribution, summarize

LEVEL = Level("concurrency", 2)


def ok(index: int, start: float, ttft: float, latency: float, tokens: int, **kw: object) -> Record:
    r = Record("concurrency 2", index, start, ttft_s=ttft, latency_s=latency, output_tokens=tokens)
    r.cache_tier = "MISS"
    r.input_tokens = 10
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_distribution_of_one_to_hundred() -> None:
    d = distribution([float(v) for v in range(100, 0, -1)])
    assert d is not None
    assert (d.n, d.avg, d.min, d.max) == (100, 50.5, 1.0, 100.0)
    assert d.p50 == pytest.approx(50.5)
    assert d.p90 == pytest.approx(90.1)
    assert d.p99 == pytest.approx(99.01)


def test_distribution_of_nothing_is_none() -> None:
    assert distribution([]) is None


def test_summary_follows_the_definitions() -> None:
    records = [
        # 11 tokens in 1.0 s after a 0.1 s first token: ITL = 0.9 / 10.
        ok(0, 0.0, 0.1, 1.0, 11, gaps_s=[0.09] * 10),
        # 5 tokens, 0.2 s TTFT, 0.6 s: ITL = 0.4 / 4.
        ok(1, 0.5, 0.2, 0.6, 5, gaps_s=[0.1] * 4),
        # A cache hit: one message, TTFT = latency; no ITL, no gaps.
        ok(2, 1.0, 0.01, 0.01, 5, cache_tier="EXACT_L1"),
        # One token: a TTFT but no ITL.
        ok(3, 1.2, 0.05, 0.05, 1),
        Record("concurrency 2", 4, 1.3, status="RESOURCE_EXHAUSTED", latency_s=0.001),
        Record("concurrency 2", 5, 1.4, status="RESOURCE_EXHAUSTED", latency_s=0.001),
        Record("concurrency 2", 6, 1.6, status="INVALID_ARGUMENT", latency_s=0.001),
        Record("concurrency 2", 7, 1.9, status=INTERRUPTED),
    ]
    s = summarize(LEVEL, records)
    assert (s.level, s.mode, s.value) == ("concurrency 2", "concurrency", 2.0)
    assert (s.sent, s.ok, s.interrupted) == (8, 4, 1)
    assert s.errors == {"INVALID_ARGUMENT": 1, "RESOURCE_EXHAUSTED": 2}
    assert s.cache_tiers == {"EXACT_L1": 1, "MISS": 3}
    # The wall time spans first send (0.0) to the last answer (1.6 + 0.001), interrupted excluded.
    assert s.wall_s == pytest.approx(1.601)
    assert s.request_throughput == pytest.approx(4 / 1.601)
    assert s.output_token_throughput == pytest.approx((11 + 5 + 5 + 1) / 1.601)
    ttft, itl, gaps = s.metrics["ttft_ms"], s.metrics["itl_ms"], s.metrics["chunk_gap_ms"]
    assert ttft is not None and itl is not None and gaps is not None
    assert ttft.n == 4 and ttft.max == pytest.approx(200.0) and ttft.min == pytest.approx(10.0)
    assert itl.n == 2
    assert sorted([itl.min, itl.max]) == pytest.approx([90.0, 100.0])
    assert gaps.n == 14 and gaps.p50 == pytest.approx(90.0)
    per_user = s.metrics["output_tokens_per_s"]
    assert per_user is not None and per_user.n == 2
    assert per_user.avg == pytest.approx(np.mean([10 / 0.9, 4 / 0.4]))
    latency = s.metrics["latency_ms"]
    assert latency is not None and latency.n == 4  # errors are not latencies of answers


def test_a_level_of_errors_only_has_no_distributions() -> None:
    s = summarize(LEVEL, [Record("concurrency 2", 0, 0.0, status="UNAVAILABLE", latency_s=0.5)])
    assert s.ok == 0 and s.errors == {"UNAVAILABLE": 1}
    assert all(d is None for d in s.metrics.values())
    assert s.request_throughput == 0.0
