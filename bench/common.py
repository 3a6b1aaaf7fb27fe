"""Helpers shared by the benchmarks."""

from __future__ import annotations


def pct(values: list[float], q: float) -> float:
    """The q-quantile of values, linearly interpolated between the two nearest ranks."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
