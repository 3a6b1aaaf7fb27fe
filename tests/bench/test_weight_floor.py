"""bench/prefix_reuse.py's weight floor: every linear layer of a step run once, whatever its format."""

from __future__ import annotations

import math

from appliance.engine.random_weights import random_model
from bench.prefix_reuse import weight_floor_ms


def test_weight_floor_runs_the_models_own_linear_layers() -> None:
    floor = weight_floor_ms(random_model("tiny"), repeats=1)
    assert math.isfinite(floor) and floor > 0.0
