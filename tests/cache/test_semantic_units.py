"""The semantic tier's index bounds and the cascade's promotion rule, without servers."""

from __future__ import annotations

import gc

import numpy as np
import psutil
import pytest

from appliance.cache.entry import CachedAnswer, CorruptEntryError
from appliance.cache.keys import ModelIdentity, SamplingKey
from appliance.cache.l1 import LruCache
from appliance.cache.l2 import stamp
from appliance.cache.metrics import CacheMetrics
from appliance.cache.semantic import OlderRecordError, decode_record, encode_record
from appliance.cache.tiers import CacheQuery, CacheTier, Hit, L1Tier, TierCascade
from appliance.cache.vectors import SCOPE_OVERHEAD, Entry, VectorIndex


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(384).astype(np.float32)
    return v / np.linalg.norm(v)


def entry(
    n: int, scope: bytes = b"s", ns: str = "ns", model: str = "m", ttl: float = 1e12
) -> Entry:
    """An entry that expires at `ttl` on the index's clock; scopes are 16-byte keys."""
    answer = CachedAnswer(f"answer {n}", (1, 2, 3), "stop", 4, 3)
    return Entry(
        n.to_bytes(16, "big"), scope.ljust(16, b"."), f"question {n}", answer, (ns, model), ttl
    )


def test_search_stays_in_its_scope_and_finds_the_nearest() -> None:
    index = VectorIndex(384, 100, 10**8)
    index.add(entry(1, b"a"), unit(1))
    index.add(entry(2, b"b"), unit(1))
    found = index.search(entry(1, b"a").scope, unit(1), 4)
    assert [e.entry_id for e, _ in found] == [entry(1).entry_id]
    assert float(found[0][1] @ unit(1)) > 0.999
    assert index.search(entry(1, b"c").scope, unit(1), 4) == []


def test_a_batch_of_entries_in_several_scopes_with_a_replacement() -> None:
    index = VectorIndex(384, 100, 10**8)
    batch = [(entry(n, b"ab"[n % 2 : n % 2 + 1]), unit(n)) for n in range(6)]
    batch.append((entry(2, b"a"), unit(7)))  # entry 2 again, now with another vector
    assert index.add_many(batch) == 7 and len(index) == 6
    one = (index.bytes - 2 * SCOPE_OVERHEAD) // 6  # two scopes
    assert index.bytes == 6 * one + 2 * SCOPE_OVERHEAD
    for n in (0, 4):
        found = index.search(entry(n, b"a").scope, unit(n), 1)
        assert [e.entry_id for e, _ in found] == [entry(n).entry_id]
    in_a = index.search(entry(2, b"a").scope, unit(7), 10)
    assert {e.entry_id for e, _ in in_a} == {entry(n).entry_id for n in (0, 2, 4)}
    assert in_a[0][0].entry_id == entry(2).entry_id and float(in_a[0][1] @ unit(7)) > 0.999
    assert [e.entry_id for e, _ in index.search(entry(3, b"b").scope, unit(3), 1)] == [
        entry(3).entry_id
    ]


def test_candidates_come_ranked_by_their_exact_vectors_and_dropped_rows_are_reused() -> None:
    """The graph compares int8 copies; what a search returns is the float32 vector as added, and
    the order is the float32 similarity, also between near-identical vectors that int8 rounding
    cannot tell apart."""
    index = VectorIndex(384, 100, 10**8)
    base = unit(1)
    nudge = unit(2)
    near = [
        (base + eps * nudge) / np.linalg.norm(base + eps * nudge) for eps in (1.4e-3, 1e-3, 1.2e-3)
    ]
    for n, v in enumerate(near):
        index.add(entry(n), v.astype(np.float32))
    found = index.search(entry(0).scope, base, 3)
    assert [e.entry_id for e, _ in found] == [entry(n).entry_id for n in (1, 2, 0)]
    for e, v in found:
        assert np.array_equal(v, near[int.from_bytes(e.entry_id, "big")].astype(np.float32))
    # A full index that keeps replacing its entries keeps to its rows.
    full = VectorIndex(384, 10, 10**8)
    for n in range(200):
        full.add(entry(n), unit(n))
    assert len(full) == 10 and full._slots <= 11  # rows handed out, reused once dropped
    assert [e.entry_id for e, _ in full.search(entry(0).scope, unit(195), 1)] == [
        entry(195).entry_id
    ]


def test_bounds_entries_bytes_and_ttl() -> None:
    clock = Clock()
    index = VectorIndex(384, 3, 10**8, clock=clock)
    for n in range(5):
        index.add(entry(n, ttl=60), unit(n))
    assert len(index) == 3 and entry(0).entry_id not in index and entry(4).entry_id in index
    one = (index.bytes - SCOPE_OVERHEAD) // 3  # one scope
    small = VectorIndex(384, 100, SCOPE_OVERHEAD + 2 * one + 10, clock=clock)
    for n in range(4):
        small.add(entry(n), unit(n))
    assert len(small) == 2 and small.bytes <= SCOPE_OVERHEAD + 2 * one + 10
    clock.now = 61.0
    assert index.search(entry(0).scope, unit(4), 4) == [] and len(index) == 0


def test_invalidate_by_namespace_and_model() -> None:
    index = VectorIndex(384, 100, 10**8)
    index.add(entry(1, ns="a", model="x"), unit(1))
    index.add(entry(2, ns="b", model="x"), unit(2))
    index.add(entry(3, ns="a", model="y"), unit(3))
    assert index.invalidate("b", "", entry(1).entry_id) == 0  # that id is in another namespace
    assert index.invalidate("a", "", entry(1).entry_id) == 1 and entry(3).entry_id in index
    assert index.invalidate("a", "") == 1 and len(index) == 1
    assert index.invalidate("", "x") == 1 and len(index) == 0


def test_records_round_trip() -> None:
    e = entry(7)
    data = encode_record(e, unit(7), 123.5, (1, 2, 3, 4, 5))
    gens, created, scope, vector, text, answer = decode_record(data, 384)
    assert (gens, created, scope, text, answer) == (
        (1, 2, 3, 4, 5),
        123.5,
        e.scope,
        e.text,
        e.answer,
    )
    assert np.array_equal(vector, unit(7))


def test_a_record_without_generations_is_an_older_releases_not_corrupt() -> None:
    """A release before generations wrote the record from its version byte on: refused, as L2
    refuses such an entry, since no invalidation can be checked against it; told apart from a
    damaged record, so a rolling upgrade does not count it as corrupt."""
    data = encode_record(entry(7), unit(7), 123.5)
    with pytest.raises(OlderRecordError, match="without generations"):
        decode_record(data[len(stamp((0,) * 5)) :], 384)
    with pytest.raises(CorruptEntryError) as raised:
        decode_record(b"\x07" + data[1:], 384)
    assert not isinstance(raised.value, OlderRecordError)


class ParaphraseTier(CacheTier):
    """A tier that answers every query with another request's answer (a semantic hit)."""

    name = "semantic"
    overlaps = False

    def __init__(self) -> None:
        self.prepared: list[bytes] = []
        self.forgone: list[bytes] = []

    async def lookup(self, query: CacheQuery) -> Hit:
        return Hit(CachedAnswer("other", (9,), "stop", 1, 1), self.name, False, 0.97, b"\x01" * 16)

    def overlaps_engine(self, query: CacheQuery) -> bool:
        return self.overlaps

    def prepare(self, query: CacheQuery) -> None:
        self.prepared.append(query.key)

    def forgo(self, query: CacheQuery) -> None:
        self.forgone.append(query.key)


async def test_a_semantic_hit_is_never_copied_into_the_exact_tiers() -> None:
    lru = LruCache(10, 10**6, 60)
    cascade = TierCascade([L1Tier(lru), ParaphraseTier()], CacheMetrics())
    model = ModelIdentity("m", "e", "t", "v")
    query = CacheQuery(b"k" * 16, "ns", model, "q", (), SamplingKey(8, True, 0, 1, 1, None, ()))
    hit = await cascade.lookup(query)
    assert hit is not None and (hit.tier, hit.exact, hit.similarity) == ("semantic", False, 0.97)
    assert len(lru) == 0
    assert cascade.counters()["semantic_hits"] == 1


async def test_a_split_cascade_counts_one_miss_and_copies_exact_hits_as_a_whole_one() -> None:
    lru = LruCache(10, 10**6, 60)
    metrics = CacheMetrics()
    semantic = ParaphraseTier()
    cascade = TierCascade([L1Tier(lru), semantic], metrics)
    model = ModelIdentity("m", "e", "t", "v")
    query = CacheQuery(b"k" * 16, "ns", model, "q", (), SamplingKey(8, True, 0, 1, 1, None, ()))
    assert cascade.split(query) == 2
    semantic.overlaps = True
    assert cascade.split(query) == 1
    assert await cascade.lookup(query, stop=1) is None
    assert metrics.misses == 0  # the tiers after the split have not been asked yet
    hit = await cascade.lookup(query, start=1)
    assert hit is not None and hit.tier == "semantic" and len(lru) == 0
    assert cascade.counters()["semantic_hits"] == 1
    empty = TierCascade([L1Tier(LruCache(10, 10**6, 60))], metrics)
    assert await empty.lookup(query, stop=empty.split(query)) is None
    assert metrics.misses == 1


class RoundTrip(CacheTier):
    """A tier between L1 and the semantic one that notes what the semantic tier had been asked to
    prepare by the time it is asked itself (it stands for L2's round trip to Redis)."""

    name = "l2"

    def __init__(self, later: ParaphraseTier, answer: CachedAnswer | None = None) -> None:
        self.later = later
        self.answer = answer
        self.seen: list[list[bytes]] = []

    async def lookup(self, query: CacheQuery) -> CachedAnswer | None:
        self.seen.append(list(self.later.prepared))
        return self.answer

    def overlaps_engine(self, query: CacheQuery) -> bool:
        return False

    def prepare(self, query: CacheQuery) -> None:
        return None


async def test_later_tiers_prepare_once_the_first_tier_misses_and_not_on_its_hit() -> None:
    lru = LruCache(10, 10**6, 60)
    semantic = ParaphraseTier()
    l2 = RoundTrip(semantic)
    cascade = TierCascade([L1Tier(lru), l2, semantic], CacheMetrics())
    model = ModelIdentity("m", "e", "t", "v")
    query = CacheQuery(b"k" * 16, "ns", model, "q", (), SamplingKey(8, True, 0, 1, 1, None, ()))
    assert await cascade.lookup(query) is not None
    assert l2.seen == [[query.key]]  # the semantic tier's work began before L2 answered
    lru.put(query.key, CachedAnswer("cached", (1,), "stop", 1, 1), ("ns", "m"))
    assert (await cascade.lookup(query)) is not None and semantic.prepared == [query.key]
    assert semantic.forgone == []  # it answered, then nothing was prepared


async def test_a_hit_before_a_prepared_tier_lets_it_forgo_its_work() -> None:
    lru = LruCache(10, 10**6, 60)
    semantic = ParaphraseTier()
    answer = CachedAnswer("from redis", (2,), "stop", 1, 1)
    cascade = TierCascade([L1Tier(lru), RoundTrip(semantic, answer), semantic], CacheMetrics())
    model = ModelIdentity("m", "e", "t", "v")
    query = CacheQuery(b"k" * 16, "ns", model, "q", (), SamplingKey(8, True, 0, 1, 1, None, ()))
    hit = await cascade.lookup(query)
    assert hit is not None and hit.tier == "l2"
    assert semantic.prepared == semantic.forgone == [query.key]
    hit = await cascade.lookup(query)  # now from L1 (copied there): nothing prepared or forgone
    assert hit is not None and hit.tier == "l1"
    assert semantic.prepared == semantic.forgone == [query.key]


def test_entries_each_in_a_scope_of_its_own_keep_to_the_byte_bound() -> None:
    """Every scope is a graph of its own (each chat history, each set of sampling parameters):
    what the process holds for many one-entry scopes, searched once each, is what the index
    counts against its byte bound."""
    process = psutil.Process()
    index = VectorIndex(384, 10**6, 10**10)
    # The first add imports usearch and allocates the first block of vectors.
    index.add(entry(10**6, b"first"), unit(0))
    gc.collect()
    before, counted = process.memory_info().rss, index.bytes
    for n in range(400):
        index.add(entry(n, n.to_bytes(4, "big")), unit(n))
        index.search(entry(n, n.to_bytes(4, "big")).scope, unit(n), 4, exact=False)
    gc.collect()
    held = process.memory_info().rss - before
    assert len(index) == 401
    assert held <= index.bytes - counted
    # The scopes' cost goes with their last entry.
    for n in (*range(400), 10**6):
        index.remove(entry(n).entry_id)
    assert index.bytes == 0
