"""Counters every cache tier shares: hits by tier, misses, writes, single-flight followers (exported
by CacheAdmin.Stats and the metrics; each tier counts its own faults itself)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar

from appliance.cache.series import Described, Series


@dataclass
class CacheMetrics:
    misses: int = 0
    not_cacheable: int = 0
    single_flight_followers: int = 0
    writes: int = 0
    # Generations started beside a semantic lookup (overlap_engine) and cancelled because it hit:
    # the engine work the overlap wasted.
    engine_cancelled_by_hit: int = 0
    # Hits by tier name ("l1", "l2", ...), exported as NAME_hits; the cascade lists every tier.
    hits: dict[str, int] = field(default_factory=dict)

    series: ClassVar[Described] = {
        "misses": "Cacheable requests no cache tier answered.",
        "not_cacheable": "Requests whose answer is not cached: sampled, so not deterministic.",
        "single_flight_followers": (
            "Requests answered by following an identical request's generation under way."
        ),
        "writes": "Answers written to the cache tiers.",
        "engine_cancelled_by_hit": Series(
            "Generations started beside a semantic lookup and cancelled by its hit.",
            metric="appliance_cache_engine_cancelled_by_semantic_hit",
        ),
    }

    def count_hit(self, tier: str) -> None:
        self.hits[tier] = self.hits.get(tier, 0) + 1

    def as_dict(self, hits: bool = True) -> dict[str, int]:
        counters = {k: v for k, v in asdict(self).items() if k != "hits"}
        if hits:
            counters.update({f"{tier}_hits": n for tier, n in self.hits.items()})
        return counters
