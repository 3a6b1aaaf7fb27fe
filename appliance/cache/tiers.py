"""The cache-tier protocol and the cascade the gateway looks answers up in.

A tier finds an answer for a CacheQuery: the exact tiers use its key alone; a semantic tier needs the
normalized input, the namespace, the model identity and the sampling parameters, so the query carries
them all. The cascade asks tiers in order (cheapest first); an exact hit in a later tier is copied into
the earlier ones, so the next identical request stops at the first tier. A semantic hit is not: it is
another request's answer, and copied under this request's key it would turn a similarity judgment into
an exact entry that outlives the judgment (an invalidation of the cached question would not reach it).

A tier may say that its lookup of a query overlaps the engine: the gateway then asks the tiers before
it, and on their miss asks it and the tiers after it while the generation starts (split, then lookup
with start and stop). The counting and copying are the same either way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from appliance.cache.entry import CachedAnswer
from appliance.cache.keys import ModelIdentity, SamplingKey
from appliance.cache.l1 import LruCache
from appliance.cache.metrics import CacheMetrics

if TYPE_CHECKING:  # the feed is built on L2's client, which imports this module
    from appliance.cache.invalidation_feed import InvalidationFeed

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CacheQuery:
    """One deterministic request as the cache sees it (text already NFC-normalized)."""

    key: bytes
    namespace: str
    model: ModelIdentity
    prompt: str | None
    messages: tuple[tuple[str, str], ...]
    sampling: SamplingKey
    # The request's own say on the semantic tier: True asks it, False never, None the default.
    semantic: bool | None = None


@dataclass(frozen=True, slots=True)
class Hit:
    """A cached answer and where it came from."""

    answer: CachedAnswer
    tier: str
    # False for an answer cached under another key (a paraphrase): never copied to exact tiers.
    exact: bool = True
    # The answering entry's key: the request's own for an exact hit, another request's for a
    # semantic one, which also says the cosine similarity of the two questions.
    similarity: float = 0.0
    entry: bytes = b""


class CacheTier(Protocol):
    """One place answers are kept. `name` labels its counters ("l1" → l1_hits)."""

    name: str

    async def lookup(self, query: CacheQuery) -> CachedAnswer | Hit | None:
        """The answer for the query (a Hit when the tier says more than the answer), or None; a
        fault is a (counted) miss, never an exception."""
        ...

    def store(self, query: CacheQuery, answer: CachedAnswer) -> None:
        """Keeps the answer; must not wait on I/O (slow tiers write in the background)."""
        ...

    def overlaps_engine(self, query: CacheQuery) -> bool:
        """Whether the lookup of this query runs while the engine's generation starts, instead of
        before it: worth it only for a tier slower than starting a generation."""
        ...

    def prepare(self, query: CacheQuery) -> None:
        """Starts, without waiting, work its lookup of this query will need: the cascade calls it
        once the first tier has missed, so the work runs while the tiers before this one answer."""
        ...

    def forgo(self, query: CacheQuery) -> None:
        """A tier before this one answered the query it was asked to prepare: the work started
        for it may stop."""
        ...

    async def invalidate(self, namespace: str, model: str, entry: bytes | None = None) -> int:
        """Drops entries of a namespace and/or model ("" matches any), or only the entry of that
        key among them; returns how many."""
        ...

    def counters(self) -> dict[str, int]:
        """Gauges of the tier's own (entries, bytes, breaker state)."""
        ...

    async def check(self) -> str:
        """ "" when the tier works, else why not (said once at start-up: degraded, not failed)."""
        ...

    async def close(self) -> None: ...


class L1Tier:
    """The in-process LRU as a tier: a hit never leaves the event loop."""

    name = "l1"

    def __init__(self, lru: LruCache) -> None:
        self.lru = lru

    async def lookup(self, query: CacheQuery) -> CachedAnswer | None:
        return self.lru.get(query.key)

    def store(self, query: CacheQuery, answer: CachedAnswer) -> None:
        self.lru.put(query.key, answer, (query.namespace, query.model.name))

    def overlaps_engine(self, query: CacheQuery) -> bool:
        return False

    def prepare(self, query: CacheQuery) -> None:
        return None

    def forgo(self, query: CacheQuery) -> None:
        return None

    async def invalidate(self, namespace: str, model: str, entry: bytes | None = None) -> int:
        return self.lru.invalidate(namespace, model, entry)

    def counters(self) -> dict[str, int]:
        return {
            "l1_entries": len(self.lru),
            "l1_bytes": self.lru.bytes,
            "l1_held_puts": self.lru.held,
        }

    async def check(self) -> str:
        return ""

    async def close(self) -> None:
        return None


class TierCascade:
    """Tiers in lookup order, with the counters every tier shares. With a feed, an invalidation
    made here is announced to the other gateways on the same Redis after every tier has tried to
    drop its entries (so no gateway can copy them back from Redis into its L1), even when one of
    them failed (the caller is told; the announcement still drops what the others hold), and
    theirs reach this gateway's L1 (see invalidation_feed.py)."""

    def __init__(
        self,
        tiers: Sequence[CacheTier],
        metrics: CacheMetrics,
        feed: InvalidationFeed | None = None,
    ) -> None:
        self.tiers = tuple(tiers)
        self.metrics = metrics
        self.feed = feed

    def split(self, query: CacheQuery) -> int:
        """The index of the first tier whose lookup of this query overlaps the engine (the ones
        before it are asked first, alone); len(tiers) when none does."""
        for index, tier in enumerate(self.tiers):
            if tier.overlaps_engine(query):
                return index
        return len(self.tiers)

    async def lookup(
        self, query: CacheQuery, start: int = 0, stop: int | None = None
    ) -> Hit | None:
        """The cached answer and the tier that had it, or None on a miss. `start`, `stop`: the
        tiers to ask (all by default); a miss is counted once the last tier has missed."""
        stop = len(self.tiers) if stop is None else stop
        prepared = start > 0
        for index in range(start, stop):
            tier = self.tiers[index]
            found = await tier.lookup(query)
            if found is None:
                if not prepared:
                    # Past the first (in-process) tier: the later tiers' own work overlaps the
                    # round trips before them. A hit in the first tier never pays for it.
                    prepared = True
                    for later in self.tiers[index + 1 :]:
                        later.prepare(query)
                continue
            hit = (
                Hit(found, tier.name, entry=query.key) if isinstance(found, CachedAnswer) else found
            )
            if prepared:
                for later in self.tiers[index + 1 :]:
                    later.forgo(query)
            self.metrics.count_hit(tier.name)
            if hit.exact:
                for earlier in self.tiers[:index]:
                    earlier.store(query, hit.answer)
            return hit
        if stop == len(self.tiers):
            self.metrics.misses += 1
        return None

    def store(self, query: CacheQuery, answer: CachedAnswer) -> None:
        self.metrics.writes += 1
        for tier in self.tiers:
            tier.store(query, answer)

    async def invalidate(
        self, namespace: str, model: str, entry: bytes | None = None
    ) -> dict[str, int]:
        """Removed entries per tier. Every tier is tried; the first failure is raised after.
        The first tier (L1) is dropped first, so it stops answering at once, and again once the
        others are: a lookup that read Redis before its (unbounded) unlink, and ended after L1's
        hold, may have put a copy back."""
        removed: dict[str, int] = {}
        failure: Exception | None = None
        again = self.tiers[:1] if len(self.tiers) > 1 else ()
        for tier in (*self.tiers, *again):
            try:
                dropped = await tier.invalidate(namespace, model, entry)
                removed[tier.name] = removed.get(tier.name, 0) + dropped
            except Exception as exc:  # Redis down: the other tiers are still dropped
                failure = failure or exc
        if self.feed is not None:
            try:
                await self.feed.publish(namespace, model, entry)
            except Exception as exc:
                failure = failure or exc
        which = "" if entry is None else f" entry={entry.hex()}"
        log.info("invalidated namespace=%r model=%r%s: %s", namespace, model, which, removed)
        if failure is not None:
            raise failure
        return removed

    def counters(self) -> dict[str, int]:
        counters = self.metrics.as_dict()
        for tier in self.tiers:
            counters.update(tier.counters())
        if self.feed is not None:
            counters.update(self.feed.counters())
        return counters

    async def check(self) -> None:
        """Says at start-up which tiers do not work (requests still do, without them); starts
        following the other gateways' invalidations."""
        if self.feed is not None:
            await self.feed.start()
        for tier in self.tiers:
            why = await tier.check()
            if why:
                log.warning(
                    "cache tier %s degraded: %s; requests are served without it", tier.name, why
                )

    async def close(self) -> None:
        if self.feed is not None:
            await self.feed.close()
        for tier in self.tiers:
            await tier.close()
