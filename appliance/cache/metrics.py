"""Counters of the cache: every hit, miss and fault is counted (exported by CacheAdmin.Stats)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class CacheMetrics:
    misses: int = 0
    not_cacheable: int = 0
    single_flight_followers: int = 0
    writes: int = 0
    write_failures: int = 0
    l2_timeouts: int = 0
    l2_errors: int = 0
    l2_skipped_breaker_open: int = 0
    l2_corrupt_entries: int = 0
    # Entries whose authentication tag did not verify (written by something that is not a gateway
    # of this appliance, or damaged): misses, never answers.
    l2_forged_entries: int = 0
    breaker_opened: int = 0
    # Generations started beside a semantic lookup (overlap_engine) and cancelled because it hit:
    # the engine work the overlap wasted.
    engine_cancelled_by_hit: int = 0
    # Hits by tier name ("l1", "l2", ...), exported as NAME_hits.
    hits: dict[str, int] = field(default_factory=lambda: {"l1": 0, "l2": 0})

    def count_hit(self, tier: str) -> None:
        self.hits[tier] = self.hits.get(tier, 0) + 1

    def as_dict(self) -> dict[str, int]:
        counters = {k: v for k, v in asdict(self).items() if k != "hits"}
        counters.update({f"{tier}_hits": n for tier, n in self.hits.items()})
        return counters
