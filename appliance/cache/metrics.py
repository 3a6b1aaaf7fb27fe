"""Counters of the cache: every hit, miss and fault is counted (exported by CacheAdmin.Stats)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CacheMetrics:
    l1_hits: int = 0
    l2_hits: int = 0
    misses: int = 0
    not_cacheable: int = 0
    single_flight_followers: int = 0
    writes: int = 0
    write_failures: int = 0
    l2_timeouts: int = 0
    l2_errors: int = 0
    l2_skipped_breaker_open: int = 0
    l2_corrupt_entries: int = 0
    breaker_opened: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
