"""Helpers shared by the benchmarks."""

from __future__ import annotations

import argparse


def pct(values: list[float], q: float) -> float:
    """The q-quantile of values, linearly interpolated between the two nearest ranks."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def workload_args(parser: argparse.ArgumentParser, requests: int) -> None:
    """The options of the benchmarks that stream one fixed request through the gateway."""
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--model-root", default="var/tiny")
