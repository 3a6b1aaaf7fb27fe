"""L2: Redis, shared by every gateway, through redis-py's asyncio client (hiredis parser).

Redis is an optimization, never a dependency: each call has a small time budget, a timeout or error
is a miss (counted), a breaker stops calling a Redis that keeps failing and probes it again later, and
the connection pool reconnects on its own. Keys are `PREFIX:NAMESPACE:MODEL:HEX` so a namespace or
model can be invalidated with SCAN + UNLINK.

Generations: whatever can write to Redis could keep a sealed entry and SET it back after an
invalidation unlinked it. So an invalidation first raises a generation, a counter under a key of
its scope (`PREFIX:gen` for everything, `PREFIX:gen-ns-NS`, `PREFIX:gen-model-MODEL`,
`PREFIX:gen-pair-LEN-NS-MODEL`, `PREFIX:gen-entry-HEX` for one entry; never matched by an
invalidation's SCAN), and an entry's sealed body starts with the five generations of its scopes
as they were before its answer's generation began: read by the lookup that missed (in the same
MGET as the entry: no extra round trip), or, for a request that writes without reading (REFRESH, a
fallback model's key), by `mark` before its engine request. A lookup reads the entry and the five
in one MGET (one round trip) and serves the entry only when none of its generations is below
Redis's or below the highest this gateway has seen (up to GEN_MEMORY scopes): set back after an
invalidation, or generated while one ran, it is a counted miss (`l2_invalidated_entries`). A
gateway that started after an invalidation knows only what Redis holds: whatever can write to
Redis can set both the entry and its generation back for it.

With Sentinels configured, the tier asks them which server is the primary of `sentinel_service`
before each new connection: when the primary dies, calls fail (misses; the breaker opens) until the
Sentinels have promoted a replica, and the next probe connects to the new primary, with no restart.
Replication is asynchronous, so an invalidation waits (WAIT) for a replica to take its generation
and reports the invalidation incomplete when none did: promoted without it, a replica would serve
the answers the invalidation removed.
Redis Cluster is not supported: every key of the cache lives in one keyspace (SCAN invalidation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import struct
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.exceptions import (
    AuthenticationError,
    NoPermissionError,
    OutOfMemoryError,
    RedisError,
    ResponseError,
)

from appliance.cache.entry import CachedAnswer, CorruptEntryError, decode, encode
from appliance.cache.seal import Sealer
from appliance.cache.series import Described, Series
from appliance.cache.tiers import CacheQuery, CacheTier, TierContext, TierUnavailable
from appliance.gateway.breaker import CircuitBreaker
from appliance.logline import Throttled

log = logging.getLogger(__name__)

# Writes Redis refuses, and entries whose tag does not verify, are each logged once per this many
# seconds (every one is counted).
QUIET_LOG_S = 60.0
# An entry's body starts with its layout (an entry of a release before generations starts with
# entry.VERSION, 1) and the generations of its five scopes (all, namespace, model, both, the
# entry) as its writer read them.
_GENS = struct.Struct(">B5Q")
_LAYOUT = 2
_BEFORE_GENERATIONS = 1  # the first byte of an entry or record of the release before them
# Scopes whose highest generation seen a gateway remembers (the oldest are forgotten past this).
GEN_MEMORY = 100_000
# With Sentinels, how long an invalidation waits for a replica to take its generation (a replica
# promoted without it would serve what the invalidation removed).
REPLICA_WAIT_MS = 500
# The least time a new connection (to Redis or a Sentinel) has to be set up, when it is TLS: TCP,
# the handshake's round trip and key exchange, on a loaded host. A call's own time budget still
# bounds it; the start-up check (at least 1 s) is what needs it, or a gateway starts with L2 off.
TLS_CONNECT_S = 0.25


def stamp(known: Sequence[int]) -> bytes:
    """The head of a sealed body: its layout and the generations of its five scopes (those
    generation_keys names) as they were before its answer's generation began."""
    return _GENS.pack(_LAYOUT, *known)


def stamped(body: bytes) -> tuple[tuple[int, ...], bytes] | None:
    """The generations a sealed body's writer read and the rest of it; None for a body of
    another layout (one stored by a release before generations)."""
    if len(body) < _GENS.size or body[0] != _LAYOUT:
        return None
    return _GENS.unpack_from(body)[1:], body[_GENS.size :]


def unstamped(body: bytes) -> bool:
    """Whether a sealed body was stored by the release before generations (a gateway not yet
    upgraded, during a rolling upgrade): not damaged, so a plain miss, counted nowhere (the
    next answer stores it anew); neither corrupt nor invalidated, which would mislead whoever
    watches those counters during the upgrade."""
    return body[:1] == bytes([_BEFORE_GENERATIONS])


def superseded(written: Sequence[int], known: Sequence[int]) -> bool:
    """Whether an invalidation raised a generation of a body's scopes after its writer read
    them."""
    return any(w < k for w, k in zip(written, known, strict=True))


@dataclass(frozen=True, slots=True)
class Generations:
    """A query's mark in L2: its entry (namespace, model, key), the generation keys of the
    entry's scopes and their generations, read before its answer's generation began; `known`
    None when the lookup could not read them (Redis failed it: the answer is not written, and no
    second read delays the engine)."""

    entry: tuple[str, str, bytes]
    names: tuple[str, ...]
    known: tuple[int, ...] | None


@dataclass(frozen=True)
class RedisSettings:
    url: str = "redis://127.0.0.1:6379/0"
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None
    key_prefix: str = "appliance"
    ttl_s: int = 86400
    # A healthy local Redis answers well within this even on a loaded host; past it: a miss.
    # bench/redis_budget.py measures that tail (docs/PERFORMANCE.md#redis-time-budget).
    timeout_ms: float = 20.0
    max_connections: int = 32
    breaker_failures: int = 5
    breaker_reset_s: float = 2.0
    # Key of the entries' authentication tags, shared by every gateway on this Redis (required:
    # the configuration reads it from `mac_key_file`).
    mac_key: bytes | None = field(default=None, repr=False)
    # HOST:PORT of Redis Sentinels; empty: `url` names the one server. With Sentinels, `url` only
    # gives the database number and TLS (rediss://: to the Sentinels and to the servers they
    # name, each verified with `tls_ca_file`); its host and port are not used.
    sentinels: tuple[str, ...] = ()
    sentinel_service: str = "appliance"
    # What the gateway presents to the Sentinels (their ACL user and its password: they require
    # one where they are deployed by the redis role); None: no AUTH. `username` and `password`
    # are presented to the primary they name.
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


def _key_part(value: str) -> str:
    # ':' separates the parts and '*?[' are SCAN glob characters: escape them in names.
    return "".join(f"%{ord(c):02X}" if c in ":*?[]%\\" else c for c in value)


@dataclass
class RedisCounters:
    """The tier's faults: each one a miss (or an answer not kept), never a failed request."""

    l2_timeouts: int = 0
    l2_errors: int = 0
    l2_skipped_breaker_open: int = 0
    l2_corrupt_entries: int = 0
    # Entries whose authentication tag did not verify (written by something that is not a gateway
    # of this appliance, or damaged): misses, never answers.
    l2_forged_entries: int = 0
    # Entries stored before an invalidation that covers them (set back by something that is not
    # a gateway, or generated while it ran: stamped with the generations before it).
    l2_invalidated_entries: int = 0
    breaker_opened: int = 0
    write_failures: int = 0


class RedisTier(CacheTier):
    """The shared tier. Writes go out in background tasks, off the request path."""

    name = "l2"
    series: ClassVar[Described] = {
        "l2_timeouts": Series(
            "Redis calls over their time budget.", metric="appliance_redis_timeouts"
        ),
        "l2_errors": Series("Redis calls that failed.", metric="appliance_redis_errors"),
        "l2_skipped_breaker_open": Series(
            "Redis calls not made because the breaker was open.",
            metric="appliance_redis_skipped_breaker_open",
        ),
        "l2_corrupt_entries": Series(
            "Redis entries that could not be decoded (treated as misses).",
            metric="appliance_redis_corrupt_entries",
        ),
        "l2_forged_entries": Series(
            "Redis entries whose MAC did not match (refused, treated as misses).",
            metric="appliance_redis_forged_entries",
        ),
        "l2_invalidated_entries": Series(
            "Redis entries stored before, or generated while, an invalidation that covers "
            "them (refused, misses; or not written, where this gateway knew of it).",
            metric="appliance_redis_invalidated_entries",
        ),
        "breaker_opened": Series(
            "Times the Redis breaker opened.", metric="appliance_redis_breaker_opened"
        ),
        "write_failures": Series(
            "Answers not written to Redis: it did not take them, or their entry's generations "
            "could not be read before their generation began.",
            metric="appliance_cache_write_failures",
        ),
        "breaker_open": Series(
            "1 while the Redis breaker is open.", gauge=True, metric="appliance_redis_breaker_open"
        ),
    }

    def __init__(self, settings: RedisSettings) -> None:
        if not settings.mac_key:
            raise ValueError("RedisSettings.mac_key is required: entries are authenticated")
        self.settings = settings
        self.metrics = RedisCounters()
        self._sealer = Sealer(settings.mac_key)
        # The highest generation seen of each scope (by its key), when above 0; oldest first.
        self._gens: dict[str, int] = {}
        self._writes: set[asyncio.Task[None]] = set()
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_reset_s)
        self._budget = settings.timeout_ms / 1000.0
        self._refusals = Throttled(log, QUIET_LOG_S)
        self._forgeries = Throttled(log, QUIET_LOG_S)
        self._credentials = Throttled(log, QUIET_LOG_S)
        kwargs: dict[str, Any] = {
            **_credentials(settings),
            "max_connections": settings.max_connections,
            "socket_connect_timeout": max(
                self._budget, TLS_CONNECT_S if settings.url.startswith("rediss://") else 0.05
            ),
            "retry_on_timeout": False,
            # With every connection in use, a call waits for one (within its own time budget)
            # rather than failing at once: a burst of lookups is not a Redis fault and must not
            # open the breaker.
            "timeout": None,
        }
        self._sentinel: Sentinel | None = None
        self.client: redis.Redis
        if settings.sentinels:
            self._sentinel, self.client = _primary_of(settings, kwargs, _BlockingSentinelPool)
        else:
            pool = redis.BlockingConnectionPool.from_url(settings.url, **kwargs)
            self.client = redis.Redis.from_pool(pool)

    def seal(self, name: str, body: bytes) -> bytes:
        """The value to store under Redis key `name`: the body with the gateways' tag."""
        return self._sealer.seal(name.encode(), body)

    def open(self, name: str | bytes, value: bytes) -> bytes | None:
        """The body of a value read from `name`, or None when no gateway sealed it for that key."""
        return self._sealer.open(name if isinstance(name, bytes) else name.encode(), value)

    def redis_key(self, namespace: str, model: str, key: bytes) -> str:
        s = self.settings
        return f"{s.key_prefix}:{_key_part(namespace)}:{_key_part(model)}:{key.hex()}"

    def generation_keys(self, namespace: str, model: str, key: bytes) -> list[str]:
        """The generation keys of an entry's five scopes: everything, its namespace, its model,
        both, the entry. One colon each: no invalidation's SCAN pattern matches them."""
        p, ns, m = self.settings.key_prefix, _key_part(namespace), _key_part(model)
        return [
            f"{p}:gen",
            f"{p}:gen-ns-{ns}",
            f"{p}:gen-model-{m}",
            f"{p}:gen-pair-{len(ns)}-{ns}-{m}",
            f"{p}:gen-entry-{key.hex()}",
        ]

    def known(self, names: list[str], values: list[Any]) -> list[int]:
        """The generation of each scope: the higher of Redis's value and the highest seen here
        (remembered). ValueError: a value that is not a generation."""
        known = []
        for name, value in zip(names, values, strict=True):
            found = 0 if value is None else int(value)
            if not 0 <= found < 2**63:
                raise ValueError(f"generation {found} out of range")
            seen = self._gens.get(name, 0)
            if found > seen:
                self._gens.pop(name, None)
                self._gens[name] = seen = found
                if len(self._gens) > GEN_MEMORY:
                    del self._gens[next(iter(self._gens))]
            known.append(seen)
        return known

    async def _call(self, what: str, command: Awaitable[Any], write: bool = False) -> Any:
        """Runs one Redis command within the time budget; None on any fault (counted). `write`:
        the command only stores, and Redis refusing it is no reason to stop reading."""
        try:
            return await self._run(what, command, write)
        except TierUnavailable:
            return None

    async def _run(self, what: str, command: Awaitable[Any], write: bool = False) -> Any:
        """Runs one Redis command within the time budget: its result (None for a key of another
        type), or TierUnavailable saying why it was not run or failed (counted)."""
        if not self.breaker.allow():
            self.metrics.l2_skipped_breaker_open += 1
            close = getattr(command, "close", None)
            if close is not None:
                close()  # never awaited: say so, or Python warns
            wait = self.breaker.retry_in()
            state = f"open for {wait:.1f} s more" if wait > 0 else "probing it"
            raise self._unavailable(f"not asked: redis kept failing and its breaker is {state}")
        try:
            async with asyncio.timeout(self._budget):  # no extra task, unlike wait_for
                result = await command
        except asyncio.CancelledError:
            # The caller went away mid-call (its deadline passed). If this call was the half-open
            # breaker's probe, the probe failed: otherwise the breaker would wait for it forever.
            self.breaker.abandoned()
            raise
        except TimeoutError:
            self.metrics.l2_timeouts += 1
            self._failed(what, "timeout")
            raise self._unavailable(
                f"{what} took longer than its {self.settings.timeout_ms:g} ms time budget"
            ) from None
        except ResponseError as exc:
            if str(exc).startswith("WRONGTYPE"):
                # Redis answered: the key holds a list, a hash... that no gateway wrote. A miss,
                # like any other value that is not an entry, and no sign of a failing Redis
                # (which would open the breaker for every key).
                self.metrics.l2_corrupt_entries += 1
                self.breaker.success()
                return None
            self.metrics.l2_errors += 1
            why = self._denied(exc)
            if not write:
                self._failed(what, why)
                raise self._unavailable(f"{what} failed: {why}") from None
            # Redis answered in time and refused to store (full under noeviction, a replica): it
            # still serves what it holds, which an open breaker would turn away.
            self.breaker.success()
            self._refused(what, exc)
            raise self._unavailable(f"{what} refused: {why}") from None
        except (RedisError, OSError) as exc:
            self.metrics.l2_errors += 1
            why = self._denied(exc)
            self._failed(what, why)
            raise self._unavailable(f"{what} failed: {why}") from None
        self.breaker.success()
        return result

    def _unavailable(self, why: str) -> TierUnavailable:
        return TierUnavailable(f"tier {self.name} (redis) {why}", self.breaker.retry_in())

    def _denied(self, exc: BaseException) -> str:
        """What Redis said (without a credential); when it refused this gateway's credentials
        or its ACL user's rights, also said once per QUIET_LOG_S with what to fix."""
        why = _reason(exc)
        for password in (self.settings.password, self.settings.sentinel_password):
            if password:
                why = why.replace(password, "***")
        fix = _credentials_fix(exc)
        if fix:
            self._credentials.warning("redis refused this gateway (%s): %s", why, fix)
        return why

    def _refused(self, what: str, exc: ResponseError) -> None:
        """A write Redis refused (each is counted), logged once per QUIET_LOG_S."""
        fix = (
            ": raise its maxmemory or set maxmemory-policy volatile-lru (evicts answers only)"
            if isinstance(exc, OutOfMemoryError)
            else ""
        )
        self._refusals.warning(
            "redis refused %s (%s)%s; answers are not shared until it takes them",
            what,
            _reason(exc),
            fix,
        )

    def _failed(self, what: str, why: str) -> None:
        before = self.breaker.opened
        self.breaker.failure()
        if self.breaker.opened != before:
            self.metrics.breaker_opened += 1
            log.warning(
                "redis %s failed (%s); not calling redis for %.1f s",
                what,
                why,
                self.breaker.reset_s,
            )

    async def lookup(self, query: CacheQuery) -> CachedAnswer | None:
        """TierUnavailable when Redis was not asked or did not answer (ONLY reports it). The
        generations its MGET read are the query's mark."""
        return await self._read(query.namespace, query.model.name, query.key, query.marks)

    async def mark(self, query: CacheQuery) -> None:
        """One MGET of the generations, unless the query's lookup read them (none on a fault: its
        answer is then not written)."""
        if self._mark(query) is not None:
            return
        entry = (query.namespace, query.model.name, query.key)
        known = await self.generations(*entry)
        if known is not None:
            names = tuple(self.generation_keys(*entry))
            query.marks[self.name] = Generations(entry, names, tuple(known))

    def overtaken(self, query: CacheQuery) -> bool:
        """An invalidation since the query's mark that this gateway knows of: made here, or its
        generation read since."""
        mark = self._mark(query)
        return mark is not None and self._superseded(mark)

    def marked(self, query: CacheQuery) -> tuple[int, ...] | None:
        """The generations of the query's entry as read before its answer's generation began;
        None when none were (Redis failed) or the mark is another entry's (a fallback's key)."""
        mark = self._mark(query)
        return None if mark is None else mark.known

    def _mark(self, query: CacheQuery) -> Generations | None:
        """The query's mark in this tier, if it is of the query's own entry."""
        mark = query.marks.get(self.name)
        entry = (query.namespace, query.model.name, query.key)
        return mark if isinstance(mark, Generations) and mark.entry == entry else None

    def _superseded(self, mark: Generations) -> bool:
        known = mark.known
        return known is not None and superseded(known, [self._gens.get(n, 0) for n in mark.names])

    def store(self, query: CacheQuery, answer: CachedAnswer) -> None:
        mark = self._mark(query)
        if mark is None or mark.known is None:
            self.metrics.write_failures += 1
            return
        if self._superseded(mark):
            # Refused at every lookup, and written it could replace a newer answer.
            self.metrics.l2_invalidated_entries += 1
            return
        task = asyncio.get_running_loop().create_task(
            self._write(query.namespace, query.model.name, query.key, answer, mark.known)
        )
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(
        self, namespace: str, model: str, key: bytes, answer: CachedAnswer, known: Sequence[int]
    ) -> None:
        if not await self.put(namespace, model, key, answer, known):
            self.metrics.write_failures += 1

    @classmethod
    def build(cls, context: TierContext) -> RedisTier:
        if context.config.redis is None:  # the configuration refuses l2 without [cache.redis]
            raise ValueError("the l2 cache tier needs a [cache.redis] table")
        return cls(context.config.redis)

    def counters(self) -> dict[str, int]:
        return {**asdict(self.metrics), "breaker_open": int(self.breaker.state != "closed")}

    async def check(self) -> str:
        """One PING within a start-up budget; an unreachable Redis opens the breaker at once."""
        try:
            async with asyncio.timeout(max(self._budget, 1.0)):
                await self.client.ping()
        except (TimeoutError, RedisError, OSError) as exc:
            for _ in range(self.breaker.threshold):
                self.breaker.failure()
            where = re.sub(r"//[^@/]*@", "//", self.settings.url)  # never log a password
            if self.settings.sentinels:
                where = f"'{self.settings.sentinel_service}' of Sentinels {', '.join(self.settings.sentinels)}"
            return f"redis at {where} unreachable ({self._denied(exc)})"
        return ""

    async def get(self, namespace: str, model: str, key: bytes) -> CachedAnswer | None:
        """The answer, or None on a miss or a fault (counted)."""
        try:
            return await self._read(namespace, model, key)
        except TierUnavailable:
            return None

    async def _read(
        self, namespace: str, model: str, key: bytes, marks: dict[str, object] | None = None
    ) -> CachedAnswer | None:
        """`marks`: a query's, where the generations read are noted (unless noted already)."""
        name = self.redis_key(namespace, model, key)
        gens = self.generation_keys(namespace, model, key)
        entry = (namespace, model, key)
        try:
            data, *found = await self._run("MGET", self.client.mget([name, *gens]))
        except TierUnavailable:
            if marks is not None:
                marks.setdefault(self.name, Generations(entry, tuple(gens), None))
            raise
        known = self._read_generations(gens, found)
        if known is None:
            return None
        if marks is not None:
            marks.setdefault(self.name, Generations(entry, tuple(gens), tuple(known)))
        if not isinstance(data, bytes):
            return None
        body = self.open(name, data)
        if body is None:
            self.metrics.l2_forged_entries += 1
            self._forgeries.warning(
                "a redis entry's tag did not verify (refused, a miss): if gateways share "
                "this redis, give them all the same [cache.redis] mac_key_file secret"
            )
            return None
        found_gens = stamped(body)
        if found_gens is None:
            if not unstamped(body):
                self.metrics.l2_corrupt_entries += 1
            return None
        written, rest = found_gens
        if superseded(written, known):
            self.metrics.l2_invalidated_entries += 1
            return None
        try:
            return decode(rest)
        except CorruptEntryError:
            self.metrics.l2_corrupt_entries += 1
            return None

    async def put(
        self,
        namespace: str,
        model: str,
        key: bytes,
        answer: CachedAnswer,
        known: Sequence[int] | None = None,
    ) -> bool:
        """`known`: the generations read before the answer's generation began; None: read now
        (for an answer no invalidation can have overtaken)."""
        name = self.redis_key(namespace, model, key)
        if known is None:
            known = await self.generations(namespace, model, key)
            if known is None:
                return False
        value = self.seal(name, stamp(known) + encode(answer))
        done = await self._call(
            "SET", self.client.set(name, value, ex=self.settings.ttl_s), write=True
        )
        return done is True

    async def generations(self, namespace: str, model: str, key: bytes) -> list[int] | None:
        """The generations of an entry's five scopes, as Redis and this gateway know them now (one
        MGET within the time budget); None on a fault (counted) or a value that is not a
        generation."""
        gens = self.generation_keys(namespace, model, key)
        found = await self._call("MGET", self.client.mget(gens))
        return None if found is None else self._read_generations(gens, found)

    def _read_generations(self, gens: list[str], found: list[Any]) -> list[int] | None:
        """`known` of generation keys as MGET read them; None (counted corrupt) when one holds
        a value that is not a generation."""
        try:
            return self.known(gens, found)
        except ValueError:
            self.metrics.l2_corrupt_entries += 1
            return None

    async def invalidate(self, namespace: str, model: str, entry: bytes | None = None) -> int:
        """UNLINKs every key of a namespace and/or model ("" matches any); `entry`: only that
        key's answer and the semantic record of the same key (its name ends in the same hex).
        Each SCAN page and its UNLINK is one command within the time budget, as a lookup is:
        TierUnavailable says why when Redis is not asked (breaker open), does not answer in time
        or fails; the keys unlinked before stay unlinked. First raises the generation of the
        invalidation's scope: the entries stored before it are refused even where Redis keeps
        them. With Sentinels, TierUnavailable also when no replica took the generation within
        REPLICA_WAIT_MS (the keys are unlinked all the same)."""
        scope = 4 if entry is not None else (2 if namespace else 0) + (1 if model else 0)
        gen = self.generation_keys(namespace, model, entry or b"")[(0, 2, 1, 3, 4)[scope]]
        replicated = True
        if self.settings.sentinels:
            # WAIT counts the replicas that took the writes of its own connection: the INCR's.
            pinned = self.client.client()
            try:
                raised = await self._run("INCR", self._raise(gen, pinned))
                replicated = await self._replicated(pinned)
            finally:
                await pinned.aclose()
        else:
            raised = await self._run("INCR", self._raise(gen, self.client))
        self.known([gen], [raised])
        ns = _key_part(namespace) if namespace else "*"
        m = _key_part(model) if model else "*"
        last = "*" if entry is None else f"*{entry.hex()}"
        pattern = f"{self.settings.key_prefix}:{ns}:{m}:{last}"
        removed = 0
        cursor = 0
        while True:
            cursor, names = await self._run(
                "SCAN", self.client.scan(cursor, match=pattern, count=1000)
            )
            if names:
                removed += await self._run("UNLINK", self.client.unlink(*names))
            if not cursor:
                break
        if not replicated:
            raise self._unavailable(
                f"raised generation {gen} and unlinked {removed} keys on the primary, but no "
                f"replica acknowledged the generation within {REPLICA_WAIT_MS} ms (none "
                "connected, or behind): a failover before it replicates would serve the "
                "invalidated answers again; invalidate again once a replica is in step"
            )
        return removed

    async def _replicated(self, client: redis.Redis) -> bool:
        """Whether a replica took the writes of `client`'s connection within REPLICA_WAIT_MS
        (WAIT 1); False on any fault (the invalidation then says so)."""
        try:
            async with asyncio.timeout(REPLICA_WAIT_MS / 1000 + self._budget):
                return int(await client.wait(1, REPLICA_WAIT_MS)) >= 1
        except (TimeoutError, RedisError, OSError) as exc:
            self._denied(exc)
            return False

    async def _raise(self, gen: str, client: redis.Redis) -> int:
        """Raises generation key `gen` atomically (INCR) above the highest this gateway has seen
        of it (Redis may hold less: a replica promoted before the raise reached it); returns the
        new generation. A value that is not a generation (overwritten, or a key of another type) is
        replaced."""
        seen = self._gens.get(gen, 0)
        try:
            raised = int(await client.incr(gen))
        except NoPermissionError as exc:
            # An ACL of an older release: GET then SET, which two gateways raising the same
            # generation at once may set back by one.
            self._denied(exc)
            current: Any = await client.get(gen)
            raised = max(seen, int(current) if (current or b"").isdigit() else 0) + 1
            await client.set(gen, str(raised))
            return raised
        except ResponseError as exc:
            # A value that is no integer, or a key of another type (a list...): no gateway
            # wrote it, and SET replaces either.
            if "not an integer" not in str(exc) and not str(exc).startswith("WRONGTYPE"):
                raise
            raised = seen + 1
            await client.set(gen, str(raised))
            return raised
        if raised <= seen:
            raised = int(await client.incrby(gen, seen + 1 - raised))
        return raised

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(self._writes, timeout=1.0)
        await _close(self.client, self._sentinel)


class StreamClient:
    """A Redis client apart from the tier's pool, for a follower's blocking XREAD (which would hold
    one of the tier's time-budgeted connections for seconds) and the appends that go with it. With
    Sentinels it talks to the primary they name, as the tier does; `url`'s host is not used then."""

    def __init__(self, settings: RedisSettings, socket_timeout_s: float) -> None:
        kwargs: dict[str, Any] = {
            **_credentials(settings),
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": 1.0,
        }
        self._sentinel: Sentinel | None = None
        self.client: redis.Redis
        if settings.sentinels:
            self._sentinel, self.client = _primary_of(settings, kwargs, SentinelConnectionPool)
        else:
            self.client = redis.Redis.from_url(settings.url, **kwargs)

    async def close(self) -> None:
        """Bounded: a stop must not hang on a Redis that does not answer."""
        with contextlib.suppress(TimeoutError, RedisError, OSError):
            async with asyncio.timeout(1.0):
                await _close(self.client, self._sentinel)


def _reason(exc: BaseException) -> str:
    """What Redis or the connection said, for a log line: without the command a pipeline's error
    quotes (a key names a namespace; a value holds a question and its answer)."""
    if isinstance(exc, MasterNotFoundError):
        # redis-py lists each Sentinel's client (its whole repr) with what it raised: only the
        # errors, each once.
        head, _, rest = str(exc).partition(" : ")
        errors = dict.fromkeys(re.findall(r"\)> - (.+?)(?=, <|$)", rest))
        return f"{head}: {'; '.join(errors)}" if errors else head
    return str(exc).rpartition(" of pipeline caused error: ")[2] or type(exc).__name__


def _credentials_fix(exc: BaseException) -> str:
    """What to fix when Redis or its Sentinels refused this gateway's credentials or its ACL
    user's rights; "" for any other fault."""
    # redis-py reports a Sentinel that refused the login among the reasons no primary was found,
    # and raises a Sentinel's NOPERM as it is.
    said = str(exc)
    if isinstance(exc, MasterNotFoundError) and "AuthenticationError" in said:
        return (
            "[cache.redis] sentinel_password_file (and sentinel_username) must hold the "
            "password of the ACL user the Sentinels give the gateways (sentinel-users.acl)"
        )
    if isinstance(exc, NoPermissionError) and "'sentinel|" in said:
        return (
            "the Sentinels' ACL user [cache.redis] sentinel_username names lacks this command: "
            "give it the rules the ansible redis role writes to sentinel-users.acl"
        )
    if isinstance(exc, AuthenticationError):
        return (
            "[cache.redis] password_file (and username, for an ACL user) must hold what this "
            "redis requires: its requirepass, or the password of that ACL user (ACL SETUSER)"
        )
    if isinstance(exc, NoPermissionError):
        return (
            "the ACL user [cache.redis] username names lacks this command or key: give it the "
            "rules the ansible redis role writes to users.acl (keys PREFIX:*, the cache's commands)"
        )
    return ""


def _credentials(settings: RedisSettings) -> dict[str, Any]:
    """What every connection to Redis presents: the ACL user and, for TLS, the CA to verify."""
    kwargs: dict[str, Any] = {"username": settings.username, "password": settings.password}
    if settings.tls_ca_file:
        kwargs["ssl_ca_certs"] = settings.tls_ca_file
    return kwargs


async def _close(client: redis.Redis, sentinel: Sentinel | None) -> None:
    await client.aclose()
    if sentinel is not None:
        for each in sentinel.sentinels:
            await each.aclose()


class _BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """Sentinel's pool (connections go to the primary the Sentinels name) that waits for a free
    connection when all are in use, as the single-server pool does."""


def _primary_of(
    settings: RedisSettings, kwargs: dict[str, Any], pool: type[SentinelConnectionPool]
) -> tuple[Sentinel, redis.Redis]:
    """The Sentinels and a client of the primary they name for `sentinel_service`."""
    addresses = []
    for address in settings.sentinels:
        host, _, port = address.rpartition(":")
        addresses.append((host.strip("[]"), int(port)))
    timeout = kwargs["socket_connect_timeout"]
    # rediss://: TLS to the Sentinels as to the servers (the Sentinels hear the gateways'
    # password and name the primary), verified with the same CA.
    tls = settings.url.startswith("rediss://")
    sentinel_tls: dict[str, Any] = {"ssl": True} if tls else {}
    if tls and settings.tls_ca_file:
        sentinel_tls["ssl_ca_certs"] = settings.tls_ca_file
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        addresses,
        # The Sentinels' own login, apart from the primary's (`kwargs`). Each Sentinel is asked
        # once: redis-py's default retries (with a backoff of up to seconds) would spend every
        # call's time budget on a Sentinel that is down, and never reach the ones that answer.
        sentinel_kwargs={
            "socket_connect_timeout": timeout,
            "socket_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),
            "username": settings.sentinel_username,
            "password": settings.sentinel_password,
            **sentinel_tls,
        },
    )
    url = parse_url(settings.url)  # type: ignore[no-untyped-call]
    client = sentinel.master_for(
        settings.sentinel_service,
        connection_pool_class=pool,
        db=url.get("db", 0),
        ssl=tls,
        **kwargs,
    )
    return sentinel, client
