"""L1 LRU, the entry encoding, the breaker and single-flight, without servers."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.cache.entry import CachedAnswer, CorruptEntryError, decode, encode
from appliance.cache.invalidation_feed import MAX_LEN, InvalidationFeed
from appliance.cache.keys import ModelIdentity, SamplingKey
from appliance.cache.l1 import MAX_RECORD, LruCache
from appliance.cache.l2 import RedisSettings, RedisTier
from appliance.cache.metrics import CacheMetrics
from appliance.cache.singleflight import Flight, SingleFlight
from appliance.cache.tiers import CacheQuery, L1Tier, TierCascade
from appliance.gateway.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def answer(text: str = "hello", n: int = 3) -> CachedAnswer:
    return CachedAnswer(text, tuple(range(n)), "stop", 5, n)


@given(
    text=st.text(),
    ids=st.lists(st.integers(-(2**31), 2**31 - 1)),
    finish=st.sampled_from(["stop", "length"]),
)
def test_entry_round_trips(text: str, ids: list[int], finish: str) -> None:
    a = CachedAnswer(text, tuple(ids), finish, 7, len(ids))
    assert decode(encode(a)) == a


@pytest.mark.parametrize("data", [b"", b"\x02" + b"\x00" * 13, encode(answer())[:-8] + b"\xff"])
def test_corrupt_entries_are_refused(data: bytes) -> None:
    with pytest.raises(CorruptEntryError):
        decode(data)


def test_unknown_finish_reason_is_corrupt() -> None:
    data = bytearray(encode(answer()))
    data[1] = 3  # CANCELLED answers are never cached
    with pytest.raises(CorruptEntryError, match="finish reason"):
        decode(bytes(data))


def test_entry_size_counts_the_bytes_python_holds_the_text_in() -> None:
    # 1, 2 and 4 bytes a character: one character past U+FFFF widens the whole string.
    ascii_text, wide_text = answer("a" * 100), answer("日" * 100)
    assert wide_text.size() - ascii_text.size() >= 100
    assert answer("a" * 100 + "\U0001f600").size() - ascii_text.size() >= 300


@pytest.mark.parametrize("text", ["abcd", "日本", "ab\U0001f600"])
def test_l1_holds_no_more_memory_than_its_byte_bound_counts(text: str) -> None:
    """Many long answers decoded from Redis (every token id its own int object): what L1
    counts is at least what the process holds for them."""
    ids = tuple(range(1000, 3000))
    lru = LruCache(max_entries=10**6, max_bytes=10**9, ttl_s=60)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(40):
            answer = decode(encode(CachedAnswer(text * 1000 + str(i), ids, "length", 9, 2000)))
            lru.put(i.to_bytes(16, "big"), answer, ("ns", "m"))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(lru) == 40
    assert held <= lru.bytes


def test_lru_evicts_least_recently_used_by_entries_and_bytes() -> None:
    lru = LruCache(max_entries=2, max_bytes=10**6, ttl_s=60)
    lru.put(b"a", answer("a"), ("ns", "m"))
    lru.put(b"b", answer("b"), ("ns", "m"))
    assert lru.get(b"a") is not None  # a is now the most recent
    lru.put(b"c", answer("c"), ("ns", "m"))
    assert lru.get(b"b") is None and lru.get(b"a") is not None and len(lru) == 2
    small = LruCache(max_entries=100, max_bytes=answer("x" * 100).size() + 10, ttl_s=60)
    small.put(b"1", answer("x" * 100), ("ns", "m"))
    small.put(b"2", answer("y" * 100), ("ns", "m"))
    assert small.get(b"1") is None and small.get(b"2") is not None
    assert small.bytes == answer("y" * 100).size()


def test_lru_ttl_expires() -> None:
    clock = Clock()
    lru = LruCache(10, 10**6, ttl_s=5, clock=clock)
    lru.put(b"k", answer(), ("ns", "m"))
    clock.now = 4.9
    assert lru.get(b"k") is not None
    clock.now = 5.0
    assert lru.get(b"k") is None and lru.bytes == 0


def test_lru_invalidates_by_namespace_and_model() -> None:
    lru = LruCache(10, 10**6, 60)
    for k, labels in [(b"1", ("a", "m")), (b"2", ("a", "n")), (b"3", ("b", "m"))]:
        lru.put(k, answer(), labels)
    assert lru.invalidate("b", "", entry=b"1") == 0  # that key is in another namespace
    assert lru.invalidate("a", "", entry=b"1") == 1 and lru.get(b"2") is not None
    assert lru.invalidate("a", "", entry=b"1") == 0
    assert lru.invalidate("a", "") == 1 and len(lru) == 1
    assert lru.invalidate("", "m") == 1 and len(lru) == 0


def test_a_put_is_refused_when_an_invalidation_since_its_mark_named_it() -> None:
    """An answer whose generation (or Redis read) began before an invalidation is not stored,
    however long it took: its mark is the invalidation count before it began."""
    clock = Clock()
    lru = LruCache(10, 10**6, 60, clock=clock)
    since = lru.invalidations.sequence
    lru.invalidate("a", "", entry=b"1")
    lru.invalidate("", "m")
    clock.now = 3600.0  # a generation far longer than any time hold
    lru.put(b"1", answer(), ("a", "n"), since)  # the entry named
    lru.put(b"2", answer(), ("b", "m"), since)  # the model named
    lru.put(b"3", answer(), ("a", "n"), since)  # another key of that namespace
    lru.put(b"4", answer(), ("b", "n"), since)
    assert (lru.get(b"1"), lru.get(b"2")) == (None, None) and lru.held == 2
    assert lru.get(b"3") is not None and lru.get(b"4") is not None
    # Begun after the invalidations: stored.
    later = lru.invalidations.sequence
    lru.put(b"1", answer(), ("a", "n"), later)
    lru.put(b"2", answer(), ("b", "m"), later)
    assert lru.get(b"1") is not None and lru.get(b"2") is not None and lru.held == 2
    everything = LruCache(10, 10**6, 60, clock=clock)
    mark = everything.invalidations.sequence
    everything.invalidate("", "")
    everything.put(b"5", answer(), ("c", "x"), mark)
    assert everything.get(b"5") is None
    # More invalidations than the record keeps: a put marked before the oldest kept is refused
    # whatever it names (the record cannot say what the dropped ones named).
    burst = LruCache(10, 10**6, 60, clock=clock)
    old = burst.invalidations.sequence
    for n in range(MAX_RECORD + 1):
        burst.invalidate(f"ns{n}", "")
    burst.put(b"6", answer(), ("elsewhere", "x"), old)
    assert burst.get(b"6") is None and burst.held == 1
    burst.put(b"6", answer(), ("elsewhere", "x"), burst.invalidations.sequence)
    assert burst.get(b"6") is not None


async def test_an_l1_lookup_that_missed_marks_the_store_of_its_answer() -> None:
    """L1 missed, the generation ran, an invalidation landed meanwhile (however long ago): the
    answer it produced is not stored; a request whose plan only writes is marked by the cascade."""
    clock = Clock()
    lru = LruCache(10, 10**6, 60, clock=clock)
    cascade = TierCascade([L1Tier(lru)], CacheMetrics())
    looked, written = query(b"k" * 16), query(b"w" * 16)
    assert await cascade.lookup(looked) is None
    await cascade.mark(written)  # REFRESH: no lookup, marked before the engine is asked
    await cascade.invalidate("ns", "")
    clock.now = 3600.0
    cascade.store(looked, answer())
    cascade.store(written, answer())
    assert await cascade.lookup(query(b"k" * 16)) is None
    assert await cascade.lookup(query(b"w" * 16)) is None
    assert cascade.counters()["l1_held_puts"] == 2


def query(key: bytes) -> CacheQuery:
    model = ModelIdentity("m", "e", "t", "v")
    return CacheQuery(key, "ns", model, "q", (), SamplingKey(8, True, 0, 1, 1, None, ()))


class Recorded(L1Tier):
    def __init__(self, label: str, calls: list[str]) -> None:
        super().__init__(LruCache(10, 10**6, 60))
        self.label, self.calls = label, calls

    async def invalidate(self, namespace: str, model: str, entry: bytes | None = None) -> int:
        self.calls.append(self.label)
        return 0


async def test_the_other_gateways_hear_of_an_invalidation_after_every_tier_dropped_it() -> None:
    """Announced before Redis was unlinked, another gateway could copy an entry back into its L1
    from Redis (past the hold, when the unlink is slow); and the semantic tier's own stream
    message must follow the unlink of its records, as a restarted gateway's rebuild relies on.
    L1 is dropped again last, for the copies its own lookups made during a slow unlink."""
    calls: list[str] = []
    tiers = [Recorded(name, calls) for name in ("l1", "l2", "semantic")]
    feed = InvalidationFeed(RedisSettings(), lambda *_: 0)

    async def publish(namespace: str, model: str, entry: bytes | None) -> None:
        calls.append(f"announced {namespace}")

    feed.publish = publish  # type: ignore[method-assign]
    await TierCascade(tiers, CacheMetrics(), feed).invalidate("ns", "")
    assert calls == ["l1", "l2", "semantic", "l1", "announced ns"]


def test_the_feed_applies_other_gateways_messages_and_skips_bad_ones() -> None:
    applied: list[tuple[str, str, bytes | None]] = []

    def apply(namespace: str, model: str, entry: bytes | None) -> int:
        applied.append((namespace, model, entry))
        return 0

    # Without a MAC key (sealed messages: test_cache_e2e.py); connects only when used.
    feed = InvalidationFeed(RedisSettings(), apply)
    key = bytes(range(16))
    feed._message(
        b"1-0", {b"ns": b"team", b"model": b"", b"entry": key.hex().encode(), b"from": b"x"}
    )
    feed._message(b"1-0", {b"ns": b"", b"model": b"m", b"entry": b"", b"from": b"x"})
    feed._message(
        b"1-0", {b"ns": b"own", b"model": b"", b"entry": b"", b"from": feed.origin.encode()}
    )
    for bad in (
        {b"ns": b"team", b"model": b"", b"entry": b"not hex"},
        {b"ns": b"\xff", b"model": b"", b"entry": b""},
        {b"model": b"m"},
    ):
        feed._message(b"1-0", bad)
    assert applied == [("team", "", key), ("", "m", None)]
    counters = feed.counters()
    assert (counters["l1_peer_invalidations"], counters["l1_feed_corrupt_messages"]) == (2, 3)


def test_a_follower_that_may_have_lost_messages_to_trimming_empties_l1() -> None:
    """A read that returns MAX_LEN messages may have skipped trimmed ones: L1 is emptied; a
    shorter read cannot have (trimming keeps about MAX_LEN after it)."""
    applied: list[str] = []

    def apply(namespace: str, model: str, entry: bytes | None) -> int:
        applied.append(namespace or "everything")
        return 0

    feed = InvalidationFeed(RedisSettings(), apply)
    message = {b"ns": b"team", b"model": b"", b"entry": b"", b"from": b"x"}
    short = [(f"1-{n}".encode(), message) for n in range(MAX_LEN - 1)]
    assert feed._batch(short) == f"1-{MAX_LEN - 2}"
    assert "everything" not in applied and feed.counts.cleared == 0
    full = [(f"2-{n}".encode(), message) for n in range(MAX_LEN)]
    assert feed._batch(full) == f"2-{MAX_LEN - 1}"
    assert applied[-1] == "everything" and feed.counts.cleared == 1


def test_breaker_opens_probes_and_closes() -> None:
    clock = Clock()
    b = CircuitBreaker(threshold=3, reset_s=2.0, clock=clock)
    for _ in range(3):
        assert b.allow()
        b.failure()
    assert b.state == "open" and not b.allow() and b.opened == 1
    clock.now = 2.0
    assert b.allow()  # the probe
    assert not b.allow()  # only one probe at a time
    b.failure()
    assert b.state == "open" and b.opened == 2
    clock.now = 4.0
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow()


def test_a_probe_released_without_a_verdict_lets_the_next_call_probe() -> None:
    clock = Clock()
    b = CircuitBreaker(threshold=1, reset_s=2.0, clock=clock)
    b.failure()
    clock.now = 2.0
    assert b.allow() and not b.allow()
    b.release()  # the probe learned nothing (refused before it was sent, cancelled by its client)
    assert b.state == "half-open" and b.opened == 1
    assert b.allow() and not b.allow()


async def _numbers(n: int, gate: asyncio.Event, started: list[int]) -> AsyncIterator[int]:
    started.append(1)
    for i in range(n):
        await gate.wait()
        yield i


async def test_single_flight_runs_once_and_fans_out_live() -> None:
    flights: SingleFlight[int] = SingleFlight()
    gate = asyncio.Event()
    started: list[int] = []
    leader, led = flights.join(b"k", lambda: _numbers(3, gate, started))
    follower, followed = flights.join(b"k", lambda: _numbers(3, gate, started))
    assert led and not followed and leader is follower

    async def collect(f: Flight[int]) -> list[int]:
        return [x async for x in f.follow()]

    a, b = asyncio.ensure_future(collect(leader)), asyncio.ensure_future(collect(follower))
    gate.set()
    assert await a == [0, 1, 2] == await b
    assert started == [1] and len(flights) == 0


async def test_leader_leaving_does_not_stop_the_followers() -> None:
    flights: SingleFlight[int] = SingleFlight()
    gate = asyncio.Event()
    flight, _ = flights.join(b"k", lambda: _numbers(3, gate, []))
    leader = flight.follow()
    follower = asyncio.ensure_future(_drain(flight.follow()))
    await asyncio.sleep(0)
    gate.set()
    assert await leader.__anext__() == 0
    await leader.aclose()  # the leader's client went away
    assert await follower == [0, 1, 2]


async def test_a_flight_nobody_follows_is_cancelled() -> None:
    flights: SingleFlight[int] = SingleFlight()
    never = asyncio.Event()
    flight, _ = flights.join(b"k", lambda: _numbers(3, never, []))
    reader = flight.follow()
    pending = asyncio.ensure_future(reader.__anext__())
    await flight.started.wait()  # the flight is generating and the reader waits on it
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    await reader.aclose()
    await flight.wait()  # its task ends: the last follower left
    assert flight.done and flight.abandoned and len(flights) == 0
    again, led = flights.join(b"k", lambda: _numbers(1, asyncio.Event(), []))
    assert led and again is not flight


async def test_a_held_flight_runs_until_released_and_a_follow_keeps_it() -> None:
    gate = asyncio.Event()
    flight, _ = SingleFlight[int]().join(b"k", lambda: _numbers(3, gate, []))
    flight.hold()
    other = flight.follow()
    pending = asyncio.ensure_future(other.__anext__())
    await flight.started.wait()
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    await other.aclose()  # another follower came and went: the hold keeps the generation
    assert not flight.abandoned
    mine = asyncio.ensure_future(_drain(flight.follow()))
    await asyncio.sleep(0)
    assert not flight.release()  # the hold ends; the follow it turned into goes on
    gate.set()
    assert await mine == [0, 1, 2] and not flight.abandoned


async def test_releasing_the_last_hold_cancels_the_flight() -> None:
    flight, _ = SingleFlight[int]().join(b"k", lambda: _numbers(3, asyncio.Event(), []))
    flight.hold()
    await flight.started.wait()
    assert flight.release()
    await flight.wait()
    assert flight.done and flight.abandoned


async def test_a_flight_released_before_its_first_step_ends_and_leaves_no_entry() -> None:
    flights: SingleFlight[int] = SingleFlight()
    started: list[int] = []
    flight, _ = flights.join(b"k", lambda: _numbers(3, asyncio.Event(), started))
    flight.hold()
    assert flight.release()  # at once: its task has not run a step
    await flight.wait()
    assert flight.done and flight.abandoned and not flight.started.is_set()
    assert started == [] and len(flights) == 0


async def _drain(it: AsyncIterator[int]) -> list[int]:
    return [x async for x in it]


async def test_a_cancelled_probe_counts_as_a_failed_probe() -> None:
    """A caller whose deadline passes during the half-open probe must not leave the breaker
    waiting for that probe forever (L2 would stay off until a restart)."""
    tier = RedisTier(RedisSettings(breaker_failures=1, breaker_reset_s=0.0, mac_key=b"k" * 32))
    tier.breaker.failure()  # open; reset_s 0: the next call is the half-open probe
    started = asyncio.Event()

    async def hang() -> None:
        started.set()
        await asyncio.Event().wait()

    probe = asyncio.ensure_future(tier._call("GET", hang()))
    await started.wait()
    assert tier.breaker.state == "half-open" and not tier.breaker.allow()  # one probe at a time
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert tier.breaker.allow()  # the next call probes again
    await tier.close()


async def test_a_failed_flight_raised_to_many_followers_keeps_one_traceback() -> None:
    """Every follower is raised the flight's one error: each raise must not add its frames to
    the others' (the traceback, and the frames it holds, would grow with every follower)."""

    async def refused() -> AsyncIterator[int]:
        raise ValueError("refused")
        yield 0  # an async generator

    flight, _ = SingleFlight[int]().join(b"k", refused)
    await flight.wait()
    depths = []
    for _ in range(50):
        with pytest.raises(ValueError) as raised:
            async for _event in flight.follow():
                pass
        depths.append(len(raised.traceback))
    assert raised.value is flight.error
    assert max(depths) == min(depths), depths
