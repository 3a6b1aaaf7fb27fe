"""The cache-tier base class, the tiers the configuration can name, and the cascade the gateway
looks answers up in.

A tier finds an answer for a CacheQuery: the exact tiers use its key alone; a semantic tier needs the
normalized input, the namespace, the model identity and the sampling parameters, so the query carries
them all. The cascade asks tiers in order (cheapest first); an exact hit in a later tier is copied into
the earlier ones, so the next identical request stops at the first tier. A semantic hit is not: it is
another request's answer, and copied under this request's key it would turn a similarity judgment into
an exact entry that outlives the judgment (an invalidation of the cached question would not reach it).

A tier may say that its lookup of a query overlaps the engine: the gateway then asks the tiers before
it, and on their miss asks it and the tiers after it while the generation starts (split, then lookup
with start and stop). The counting and copying are the same either way.

An answer is stored only when no invalidation since its generation began covers it: each tier notes,
in the query's `marks`, the state its store compares against (L1 the count of its invalidations, L2
the generations it read) at the lookup that missed; a request that writes without reading
(REFRESH) has the cascade's `mark` take them before its engine request. A tier that keeps no such
state ignores `marks`. `overtaken` says the same of a generation under way: a request sent after
such an invalidation does not follow it (single flight) but starts its own.

A tier is one class: `[cache] tiers` names it (a built-in name, or `package.module:Class`), its
`build` makes it from the configuration, and its `name` and `series` are all the final message, the
metrics and CacheAdmin.Stats need to report it.
"""

from __future__ import annotations

import abc
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Self, TypeVar, cast

from appliance.cache.entry import CachedAnswer
from appliance.cache.keys import ModelIdentity, SamplingKey
from appliance.cache.l1 import Invalidations, LruCache
from appliance.cache.metrics import CacheMetrics
from appliance.cache.series import Described, Series, described
from appliance.plugins import check_members, load_class

if TYPE_CHECKING:  # the feed is built on L2's client, and the configuration on L2's settings
    from appliance.cache.invalidation_feed import InvalidationFeed
    from appliance.config import CacheConfig

log = logging.getLogger(__name__)
_T = TypeVar("_T")


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
    # By tier name, what that tier's store of this request's answer compares against: its state
    # before the generation began (noted by its lookup, or by `mark`). Shared by the copies
    # dataclasses.replace makes (a fallback's key): a tier checks that a mark is of its entry.
    marks: dict[str, object] = field(default_factory=dict, compare=False, hash=False, repr=False)


@dataclass(frozen=True, slots=True)
class Hit:
    """A cached answer and where it came from."""

    answer: CachedAnswer
    tier: str
    # False for an answer cached under another key (a paraphrase): never copied to exact tiers.
    exact: bool = True
    # The answering entry's key: the request's own for an exact hit, another request's for a
    # semantic one, which also says the cosine similarity of the two questions (None: an exact
    # tier, which judges no similarity).
    similarity: float | None = None
    entry: bytes = b""


class TierError(ValueError):
    """A tier that cannot take part in the cascade; the message is one line saying what to fix."""


class TierUnavailable(Exception):
    """A tier could not look in its store, or change it (its breaker open, a timeout, an error):
    its miss says nothing of what the store holds. The message names the tier and says why;
    `retry_after_s`: when asking it again may work (0: at once)."""

    def __init__(self, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InvalidationIncomplete(Exception):
    """An invalidation some tier, or the announcement to the other gateways, failed to make. The
    message says which tiers dropped how many entries, which did not and why, and whether the
    other gateways were told."""

    def __init__(self, removed: dict[str, int], failed: dict[str, str], untold: str) -> None:
        self.removed, self.failed, self.untold = removed, failed, untold
        parts = [f"{tier} not invalidated ({why})" for tier, why in failed.items()]
        parts += [f"{tier} invalidated ({n} removed)" for tier, n in removed.items()]
        if untold:
            parts.append(
                f"the other gateways were not told ({untold}): their L1 may serve these answers "
                "until its TTL"
            )
        super().__init__("; ".join(parts) + "; invalidate again once redis answers")


# The tiers the configuration names without an import path, in the default order.
BUILTIN_TIERS = {
    "l1": "appliance.cache.tiers:L1Tier",
    "l2": "appliance.cache.l2:RedisTier",
    "semantic": "appliance.cache.semantic:SemanticTier",
}
# What a final message says when no tier answered; no tier may take it as its name.
MISS = "miss"
HITS_METRIC = "appliance_cache_hits"
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


@dataclass(frozen=True)
class TierContext:
    """What a tier is built from: the cache's configuration, the counters every tier shares, and
    the tiers configured before it (a tier that works through another finds it here)."""

    config: CacheConfig
    metrics: CacheMetrics
    before: tuple[CacheTier, ...] = ()

    def find(self, kind: type[_T]) -> _T | None:
        return next((tier for tier in self.before if isinstance(tier, kind)), None)


class CacheTier(abc.ABC):
    """One place answers are kept, and the base of every tier.

    A tier declares its `name` (what the final message and the HTTP `appliance` object report when
    it answers, and the `tier` label of its hits) and, in `series`, every number its `counters()`
    reports with a line of help (the metrics, CacheAdmin.Stats and start-up's checks read it). Only
    `lookup` has no default: a tier that keeps answers also overrides `store` and `invalidate`.
    """

    name: ClassVar[str]
    series: ClassVar[Described] = {}

    @classmethod
    def build(cls, context: TierContext) -> Self | None:
        """The tier for this configuration, or None when it is off (said in a log line)."""
        return cls()

    @abc.abstractmethod
    async def lookup(self, query: CacheQuery) -> CachedAnswer | Hit | None:
        """The answer for the query (a Hit when the tier says more than the answer), or None; a
        fault is a (counted) miss: None, or TierUnavailable when the tier could not look (a
        request that must not generate is then told the cache may hold its answer), never
        another exception."""

    def store(self, query: CacheQuery, answer: CachedAnswer) -> None:
        """Keeps the answer; must not wait on I/O (slow tiers write in the background). A tier
        whose invalidations an answer under way can overtake refuses it when one since its mark
        in `query.marks` covers it."""
        return None

    async def mark(self, query: CacheQuery) -> None:
        """Notes in `query.marks[self.name]`, unless its lookup did, the state the store of this
        query's answer compares against: the cascade calls it before the engine is asked."""
        return None

    def overtaken(self, query: CacheQuery) -> bool:
        """Whether an invalidation this tier knows of, since the query's mark, covers its entry:
        the answer generated for it must not be stored, nor given to a request sent since."""
        return False

    def overlaps_engine(self, query: CacheQuery) -> bool:
        """Whether the lookup of this query runs while the engine's generation starts, instead of
        before it: worth it only for a tier slower than starting a generation."""
        return False

    def prepare(self, query: CacheQuery) -> None:
        """Starts, without waiting, work its lookup of this query will need: the cascade calls it
        once the first tier has missed, so the work runs while the tiers before this one answer."""
        return None

    def forgo(self, query: CacheQuery) -> None:
        """A tier before this one answered the query it was asked to prepare: the work started
        for it may stop."""
        return None

    async def invalidate(self, namespace: str, model: str, entry: bytes | None = None) -> int:
        """Drops entries of a namespace and/or model ("" matches any), or only the entry of that
        key among them; returns how many."""
        return 0

    def counters(self) -> dict[str, int]:
        """The numbers `series` declares, by name (entries, bytes, faults, breaker state)."""
        return {}

    async def check(self) -> str:
        """ "" when the tier works, else why not (said once at start-up: degraded, not failed)."""
        return ""

    async def close(self) -> None:
        return None


class CountedInvalidations:
    """For a tier that numbers its invalidations (`invalidations`): a query's mark is their count
    before its generation began, and its answer is overtaken when one since then covers it."""

    name: ClassVar[str]
    invalidations: Invalidations

    def note_mark(self, query: CacheQuery) -> None:
        query.marks.setdefault(self.name, self.invalidations.sequence)

    async def mark(self, query: CacheQuery) -> None:
        self.note_mark(query)

    def count_mark(self, query: CacheQuery) -> int | None:
        mark = query.marks.get(self.name)
        return mark if isinstance(mark, int) else None

    def overtaken(self, query: CacheQuery) -> bool:
        mark = self.count_mark(query)
        labels = (query.namespace, query.model.name)
        return mark is not None and self.invalidations.since(mark, query.key, labels)


def tier_class(spec: str) -> type[CacheTier]:
    """The tier class a configuration entry names (a built-in name or `package.module:Class`): a
    CacheTier subclass that defines CacheTier's abstract members (check_members), its name and
    counters checked; TierError or PluginError (ValueErrors) say what to fix."""
    # check_members refuses a class that is not a CacheTier subclass.
    loaded = load_class(spec, BUILTIN_TIERS, "cache tier")
    check_members(loaded, CacheTier, spec, "cache tier", structural=False)
    found = cast("type[CacheTier]", loaded)
    name = getattr(found, "name", None)
    if not (isinstance(name, str) and _NAME.fullmatch(name)) or name == MISS:
        raise TierError(
            f"cache tier {spec!r}: name {name!r} must be up to 32 lowercase letters, digits "
            f"and _ (and not {MISS!r}): the final message reports it"
        )
    described(f"cache tier {spec!r}", found.series)
    return found


class L1Tier(CountedInvalidations, CacheTier):
    """The in-process LRU as a tier: a hit never leaves the event loop."""

    name = "l1"
    series: ClassVar[Described] = {
        "l1_entries": Series("Entries in the in-process L1 cache.", gauge=True),
        "l1_bytes": Series("Bytes of the answers in L1.", gauge=True),
        "l1_held_puts": (
            "Answers L1 refused because an invalidation named them (or emptied L1) after their "
            "generation, or the Redis read they were copied from, began; or more invalidations "
            "came meanwhile than L1 remembers."
        ),
    }

    def __init__(self, lru: LruCache) -> None:
        self.lru = lru
        self.invalidations = lru.invalidations

    @classmethod
    def build(cls, context: TierContext) -> L1Tier:
        config = context.config
        return cls(LruCache(config.l1_max_entries, config.l1_max_bytes, config.l1_ttl_s))

    async def lookup(self, query: CacheQuery) -> CachedAnswer | None:
        # Before the generation, and before the later tiers' reads whose hits are copied here.
        self.note_mark(query)
        return self.lru.get(query.key)

    def store(self, query: CacheQuery, answer: CachedAnswer) -> None:
        labels = (query.namespace, query.model.name)
        self.lru.put(query.key, answer, labels, self.count_mark(query))

    async def invalidate(self, namespace: str, model: str, entry: bytes | None = None) -> int:
        return self.lru.invalidate(namespace, model, entry)

    def counters(self) -> dict[str, int]:
        return {
            "l1_entries": len(self.lru),
            "l1_bytes": self.lru.bytes,
            "l1_held_puts": self.lru.held,
        }


class MissUnsure(Exception):
    """No tier had the answer, but a tier could not be asked: the cache may hold it. The message
    names the tiers and why; `retry_after_s`: the longest of their hints."""

    def __init__(self, asked: Sequence[str], unavailable: Sequence[TierUnavailable]) -> None:
        missed = f"no cached answer in {', '.join(asked)}, and " if asked else ""
        why = "; ".join(str(exc) for exc in unavailable)
        super().__init__(f"{missed}{why}: the cache may hold this answer; try again later")
        self.retry_after_s = max(exc.retry_after_s for exc in unavailable)


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
        for tier in self.tiers:  # every tier's hits are reported, the first one included
            metrics.hits.setdefault(tier.name, 0)
        self._described: dict[str, Series] | None = None

    def split(self, query: CacheQuery) -> int:
        """The index of the first tier whose lookup of this query overlaps the engine (the ones
        before it are asked first, alone); len(tiers) when none does."""
        for index, tier in enumerate(self.tiers):
            if tier.overlaps_engine(query):
                return index
        return len(self.tiers)

    async def lookup(
        self, query: CacheQuery, start: int = 0, stop: int | None = None, sure: bool = False
    ) -> Hit | None:
        """The cached answer and the tier that had it, or None on a miss. `start`, `stop`: the
        tiers to ask (all by default); a miss is counted once the last tier has missed. A tier
        that could not be asked (TierUnavailable) misses; with `sure`, a miss with such a tier
        raises MissUnsure instead of returning None."""
        stop = len(self.tiers) if stop is None else stop
        prepared = start > 0
        asked: list[str] = []
        unavailable: list[TierUnavailable] = []
        for index in range(start, stop):
            tier = self.tiers[index]
            try:
                found = await tier.lookup(query)
            except TierUnavailable as exc:
                unavailable.append(exc)
                found = None
            else:
                asked.append(tier.name)
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
        if sure and unavailable:
            raise MissUnsure(asked, unavailable)
        return None

    async def mark(self, query: CacheQuery) -> None:
        """Has every tier note what the store of this query's answer compares against, where its
        lookup did not (a REFRESH, a fallback model's key): before the engine is asked."""
        for tier in self.tiers:
            await tier.mark(query)

    def store(self, query: CacheQuery, answer: CachedAnswer) -> None:
        self.metrics.writes += 1
        for tier in self.tiers:
            tier.store(query, answer)

    def overtaken(self, query: CacheQuery) -> bool:
        """Whether a tier knows of an invalidation, since the query's marks, that covers it."""
        return any(tier.overtaken(query) for tier in self.tiers)

    async def invalidate(
        self, namespace: str, model: str, entry: bytes | None = None
    ) -> dict[str, int]:
        """Removed entries per tier. Every tier is tried, and the other gateways told, even when
        one fails; then InvalidationIncomplete says which tiers were invalidated, which not and
        why. The first tier (L1) is dropped first, so it stops answering at once, and again once
        the others are: a lookup that marked L1 after its first drop may have read Redis before
        the unlink; its copy is dropped, or refused, by the second."""
        removed: dict[str, int] = {}
        failed: dict[str, str] = {}
        again = self.tiers[:1] if len(self.tiers) > 1 else ()
        for tier in (*self.tiers, *again):
            try:
                dropped = await tier.invalidate(namespace, model, entry)
            except Exception as exc:  # Redis down: the other tiers are still dropped
                failed.setdefault(tier.name, str(exc) or type(exc).__name__)
            else:
                removed[tier.name] = removed.get(tier.name, 0) + dropped
        untold = ""
        if self.feed is not None:
            try:
                await self.feed.publish(namespace, model, entry)
            except Exception as exc:
                untold = str(exc) or type(exc).__name__
        which = "" if entry is None else f" entry={entry.hex()}"
        if failed or untold:
            incomplete = InvalidationIncomplete(removed, failed, untold)
            log.warning(
                "invalidation of namespace=%r model=%r%s incomplete: %s",
                namespace,
                model,
                which,
                incomplete,
            )
            raise incomplete
        log.info("invalidated namespace=%r model=%r%s: %s", namespace, model, which, removed)
        return removed

    def counters(self) -> dict[str, int]:
        counters = self.metrics.as_dict()
        for tier in self.tiers:
            counters.update(tier.counters())
        if self.feed is not None:
            counters.update(self.feed.counters())
        return counters

    def describe(self) -> dict[str, Series]:
        """Every number `counters()` reports but the hits (one family, labelled by tier), with its
        help line and Prometheus name. Checked once, at start-up: TierError when two tiers share a
        name or a number, or a tier reports a number it does not declare, or declares one it does
        not report."""
        if self._described is not None:
            return self._described
        owners: list[tuple[str, Described, dict[str, int]]] = [
            ("the cache", CacheMetrics.series, self.metrics.as_dict(hits=False))
        ]
        if self.feed is not None:
            owners.append(("the invalidation feed", self.feed.series, self.feed.counters()))
        names: set[str] = set()
        for tier in self.tiers:
            if tier.name in names:
                raise TierError(f"two cache tiers are named {tier.name!r}: names must differ")
            names.add(tier.name)
            owners.append((f"cache tier {tier.name!r}", tier.series, tier.counters()))
        found: dict[str, Series] = {}
        metrics = {HITS_METRIC}
        taken = {f"{name}_hits" for name in names}
        for owner, series, reported in owners:
            declared = described(owner, series)
            if undeclared := sorted(set(reported) - set(declared)):
                raise TierError(
                    f"{owner}: counter {undeclared[0]!r} has no description: declare it in series"
                )
            if unreported := sorted(set(declared) - set(reported)):
                raise TierError(f"{owner}: counters() does not report {unreported[0]!r}")
            for key, s in declared.items():
                if key in found or key in taken or s.metric in metrics:
                    raise TierError(f"{owner}: counter {key!r} ({s.metric}) is taken already")
                found[key] = s
                metrics.add(s.metric)
        self._described = found
        return found

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
