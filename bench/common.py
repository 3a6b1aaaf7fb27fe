"""Helpers shared by the benchmarks."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of values, numpy's linear interpolation; NaN when there are none."""
    return float(np.percentile(values, q * 100)) if len(values) else float("nan")


def workload_args(parser: argparse.ArgumentParser, requests: int) -> None:
    """The options of the benchmarks that stream one fixed request through the gateway."""
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--model-root", default="var/tiny")
