"""What a full garbage collection costs in a server process, before and after `freeze_heap`.

Loads a model repository as `appliance engine` does (every model, its compute thread running),
then times a full collection (`gc.collect()`, what Python runs on its own once the oldest
generation grows by a quarter) and the same after `appliance.heap.freeze_heap`, in one process:

    python -m bench.heap --repository var/repo

Prints tracked objects and the best of `--runs` full collections each way.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from appliance.heap import freeze_heap


def best_collection_us(runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - started)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs takes at least 1")
    from appliance.engine.repository import RepositoryError
    from appliance.engine.server import load_repository

    try:
        models = load_repository(args.repository)
    except RepositoryError as exc:
        print(f"bench.heap: {exc}", file=sys.stderr)
        return 2
    try:
        tracked = len(gc.get_objects())
        before = best_collection_us(args.runs)
        frozen = freeze_heap()
        after = best_collection_us(args.runs)
    finally:
        for model in models.values():
            model.runner.close()
    print(f"{', '.join(models)}: {tracked:,} tracked objects, {frozen:,} frozen")
    print("| full collection | best µs |\n|---|---:|")
    print(f"| as loaded | {before:,.0f} |\n| after freeze_heap | {after:,.1f} |")
    print(f"ratio: {before / after:,.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
