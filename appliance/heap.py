"""Keeping a server's long-lived objects out of Python's cyclic garbage collector.

Python collects all generations once the objects that survived into the oldest grow by a
quarter, and that collection walks every tracked object while holding the GIL. A server's heap
after start-up (torch and its modules, the model, a semantic index) holds hundreds of thousands of
them, so such a collection stalls every request in flight, the engine's compute thread included,
for tens of milliseconds (`python -m bench.heap`). `freeze_heap` moves everything alive out of the
collector's sight (`gc.freeze`): frozen objects are still freed by reference counting; only cycles
among them are never collected.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_heap"]


def freeze_heap() -> int:
    """A full collection, then every object alive frozen; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
