"""The semantic tier: a paraphrase of an earlier question gets that question's answer.

Scope: two requests may share an answer only when everything but the compared question is identical:
namespace, model identity (engine fingerprint included), sampling parameters, stop strings and, for
chat, every message before the last one, which must be the user's. The scope is the exact cache key
of the request with the compared question blanked out, so it is derived by the one canonical key
encoding. Only the namespaces the configuration lists take part; a request asks the tier when it sets
`semantic_cache`, or when it sets nothing and the configuration's `request_default` is on.

Decision: the question is embedded (on a worker thread: the event loop keeps streaming), the scope's
nearest entries are fetched from the in-process index, and the decision rule (paraphrase.py) accepts
one or refuses all. A hit is another request's answer: the cascade never copies it into the exact
tiers, and the final message names the answering entry and the similarity. With `overlap_engine` on,
the gateway makes the lookup while the generation starts, and leaves the generation on a hit.

Sharing: entries persist in Redis next to the exact L2 entries (`PREFIX:NS:MODEL:sem-HEX`, so an
L2 invalidation of a namespace or model drops them too), sealed for their key with the gateways' MAC
key as L2's entries are (a record that fails the check is skipped and counted: whatever else writes
to Redis cannot plant an answer). A record's seal also covers the generations of its five scopes
as they were before its answer's generation began (L2's mark of the query, l2.py): a rebuild
reads the generations of the scopes it meets, once each, in the same MGET as each batch of records
(the follower: in one MGET per batch of messages it hears), and skips a record that an
invalidation superseded (set back after the invalidation unlinked it; counted), or
that carries no generations (a release before them: skipped, counted nowhere, as L2 does). Every new entry and
invalidation is appended to a stream that each gateway follows with a blocking XREAD; a gateway
that starts, or that lost Redis and sees it again, rebuilds its index by scanning the entries. The stream's messages are sealed with the same key,
and a follower drops one without a valid tag or replayed (sealed_stream.py): whatever can write to
Redis cannot drop entries from every gateway's index, nor bring an invalidated entry back into it.
During a rolling upgrade from a version that did not seal them (sealed_stream.py says what to do),
the entries and invalidations of a gateway not yet upgraded do not reach the upgraded ones' index
(nor do its entries at a rebuild: they carry no generations), and such an invalidated entry stays
until its TTL or the next rebuild. Lookups answer only while the follower is in step with the stream (an index that cannot
hear invalidations may be stale): Redis down means no semantic hits, never a failed request.
Without Redis the tier is this gateway's alone.

An answer whose generation began before an invalidation that covers it (made here, or heard on the
stream before the answer's store) is neither indexed nor written: the tier counts its
invalidations as L1 does (l1.Invalidations), and the query's mark is that count taken at its
lookup, or by `mark` before the engine is asked.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import ChainMap, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import unquote

import numpy as np
import redis.asyncio as redis
from redis.exceptions import RedisError

from appliance.cache.classifier import load_rule
from appliance.cache.embedder import (
    Embedder,
    EmbedderUnavailable,
    EmbeddingCancelled,
    EmbedRun,
    Vector,
)
from appliance.cache.entry import CachedAnswer, CorruptEntryError, decode, encode
from appliance.cache.keys import cache_key
from appliance.cache.l1 import Invalidations
from appliance.cache.l2 import RedisTier, StreamClient, stamp, stamped, superseded, unstamped
from appliance.cache.paraphrase import Rule
from appliance.cache.sealed_stream import SealedStream
from appliance.cache.series import Described, Series
from appliance.cache.tiers import CacheQuery, CacheTier, CountedInvalidations, Hit, TierContext
from appliance.cache.vectors import Entry, VectorIndex
from appliance.config import SemanticConfig

log = logging.getLogger(__name__)

RECORD_VERSION = 1
# After the generations of its scopes (l2.stamp): version u8, created (unix seconds) f64, scope
# 16 bytes, text length u32; then the float32 vector, the text and the encoded answer.
_RECORD = struct.Struct("<Bd16sI")
MARK = "sem-"
# Records read per MGET of a rebuild (with the generation keys of their scopes not read yet).
REBUILD_BATCH = 500


@dataclass
class _Counters:
    lookups: int = 0
    skipped: int = 0  # not eligible: namespace off, request said no, text empty or too long
    unsynced: int = 0  # lookups not made because the index is not in step with Redis
    refused: int = 0  # candidates the rule refused
    stored: int = 0
    store_failures: int = 0
    follower_errors: int = 0
    rebuilds: int = 0
    corrupt: int = 0
    forged: int = 0  # records no gateway sealed for their key (skipped)
    # Records stored before an invalidation that covers them, and answers generated while one
    # ran (skipped).
    invalidated: int = 0
    cancelled: int = 0  # embeddings prepared for lookups an earlier tier answered


@dataclass
class _Embedding:
    """An embedding under way on the embedding thread, and who still wants its vector."""

    task: asyncio.Task[Vector | None]
    run: EmbedRun
    prepared: int = 0  # prepare calls not yet followed by this tier's lookup or by forgo
    waiting: int = 0  # lookups and stores awaiting it


class OlderRecordError(CorruptEntryError):
    """A record of the release before generations: skipped (l2.unstamped), not corrupt."""


def encode_record(
    entry: Entry, vector: Vector, created: float, generations: Sequence[int] = (0,) * 5
) -> bytes:
    """`generations`: of the entry's five scopes, as RedisTier.generations read them (zeros: of a
    Redis no invalidation has reached)."""
    text = entry.text.encode()
    head = stamp(generations) + _RECORD.pack(RECORD_VERSION, created, entry.scope, len(text))
    return head + np.asarray(vector, dtype="<f4").tobytes() + text + encode(entry.answer)


def decode_record(
    body: bytes, dim: int
) -> tuple[tuple[int, ...], float, bytes, Vector, str, CachedAnswer]:
    """(generations, created, scope, vector, text, answer) of a record's body."""
    found = stamped(body)
    if found is None:
        if unstamped(body):
            raise OlderRecordError("semantic record without generations (an older release's)")
        raise CorruptEntryError("semantic record of an unknown layout")
    generations, data = found
    if len(data) < _RECORD.size:
        raise CorruptEntryError("semantic record shorter than its header")
    version, created, scope, text_len = _RECORD.unpack_from(data)
    if version != RECORD_VERSION:
        raise CorruptEntryError(f"semantic record version {version}")
    start = _RECORD.size
    vector = np.frombuffer(data, dtype="<f4", count=dim, offset=start).astype(np.float32)
    start += 4 * dim
    try:
        text = data[start : start + text_len].decode()
    except UnicodeDecodeError as exc:
        raise CorruptEntryError("semantic record text is not UTF-8") from exc
    return generations, created, scope, vector, text, decode(data[start + text_len :])


class SemanticTier(CountedInvalidations, CacheTier):
    """Lookups never touch Redis; stores and the follower do, off the request path. It shares its
    entries through the l2 tier configured before it; without one, its index is this gateway's."""

    name = "semantic"
    series: ClassVar[Described] = {
        "semantic_entries": Series(
            "Entries in the semantic index.", gauge=True, metric="appliance_semantic_entries"
        ),
        "semantic_bytes": Series(
            "Bytes the semantic index accounts for (vectors, texts, answers).",
            gauge=True,
            metric="appliance_semantic_bytes",
        ),
        "semantic_in_sync": Series(
            "1 while the semantic index is in step with Redis; 0: no semantic hits.",
            gauge=True,
            metric="appliance_semantic_in_sync",
        ),
        "semantic_lookups": Series(
            "Semantic lookups made (question embedded, index searched, candidates verified).",
            metric="appliance_semantic_lookups",
        ),
        "semantic_skipped": Series(
            "Requests the semantic tier passed over: namespace or request not opted in, question "
            "empty or over 128 word pieces, or its embedding failed.",
            metric="appliance_semantic_skipped",
        ),
        "semantic_unsynced": Series(
            "Semantic lookups not made because the index was not in step with Redis.",
            metric="appliance_semantic_unsynced",
        ),
        "semantic_refused": Series(
            "Nearest entries the decision rule refused (a lookup may refuse several).",
            metric="appliance_semantic_refused_candidates",
        ),
        "semantic_stored": Series(
            "Answers this gateway embedded and indexed.", metric="appliance_semantic_stored"
        ),
        "semantic_store_failures": Series(
            "Semantic entries Redis did not take, or not stored because their entry's "
            "generations could not be read before their generation began.",
            metric="appliance_semantic_store_failures",
        ),
        "semantic_follower_errors": Series(
            "Times the semantic tier lost its Redis stream (no semantic hits until it rebuilds).",
            metric="appliance_semantic_follower_errors",
        ),
        "semantic_rebuilds": Series(
            "Rebuilds of the index from Redis.", metric="appliance_semantic_rebuilds"
        ),
        "semantic_corrupt_records": Series(
            "Semantic records in Redis that could not be decoded (skipped).",
            metric="appliance_semantic_corrupt_records",
        ),
        "semantic_forged_records": Series(
            "Semantic records no gateway sealed for their Redis key (skipped, never an answer).",
            metric="appliance_semantic_forged_records",
        ),
        "semantic_invalidated_records": Series(
            "Semantic records stored before an invalidation that covers them, or answers "
            "generated while one ran (skipped, never an answer).",
            metric="appliance_semantic_invalidated_records",
        ),
        "semantic_refused_messages": Series(
            "Messages on the semantic tier's Redis stream without this gateway's MAC, or replayed "
            "(dropped).",
            metric="appliance_semantic_refused_messages",
        ),
        "semantic_embeddings_cancelled": Series(
            "Embeddings started when L1 missed and cancelled because L2 answered.",
            metric="appliance_semantic_embeddings_cancelled",
        ),
    }

    def __init__(
        self,
        settings: SemanticConfig,
        embedder: Embedder,
        rule: Rule,
        l2: RedisTier | None,
    ) -> None:
        self.settings = settings
        self.embedder = embedder
        self.rule = rule
        if settings.min_similarity is not None:
            rule.floor = settings.min_similarity
        if settings.min_score is not None:
            rule.threshold = settings.min_score
        self.index = VectorIndex(embedder.dim, settings.max_entries, settings.max_bytes)
        self.invalidations = Invalidations()
        self.l2 = l2
        self.counts = _Counters()
        self._all = "*" in settings.namespaces
        self._namespaces = frozenset(settings.namespaces)
        self._embeds = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")
        # Vectors of recent lookups by text: the store after a miss does not embed again.
        self._recent: OrderedDict[str, Vector] = OrderedDict()
        # Embeddings under way, by text: started by prepare, awaited by the lookup.
        self._embedding: dict[str, _Embedding] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._follower: asyncio.Task[None] | None = None
        # close() began: a read that ignored its cancellation ends when close() shuts the client
        # under it, which is not Redis lost.
        self._closing = False
        self._synced_at: float | None = None if l2 is not None else float("inf")
        self._stale_s = 4 * settings.follow_block_ms / 1000
        self.last_rebuild: tuple[int, float] | None = None  # (entries, seconds)
        # Called after each rebuild: the process that owns the heap decides what to do with a
        # hundred thousand new long-lived objects (the gateway freezes them, see server.py).
        self.on_rebuilt: Callable[[], object] = lambda: None
        self._stream = ""
        # The generations of the scopes of the records in the stream messages being applied.
        self._heard: dict[str, Any] = {}
        self._own: StreamClient | None = None
        self._client: redis.Redis | None = None
        self._seals: SealedStream | None = None
        if l2 is not None:
            self._stream = f"{l2.settings.key_prefix}:{MARK}log"
            self._seals = SealedStream(
                self._stream,
                l2.settings.mac_key,
                log,
                "a semantic cache message",
                "add entries to its semantic index or drop them",
            )
            self._own = StreamClient(l2.settings, settings.follow_block_ms / 1000 + 2.0)
            self._client = self._own.client

    # -- scope --------------------------------------------------------------------------------

    def question(self, query: CacheQuery, asking: bool) -> str | None:
        """The text this tier compares when the request takes part in the tier, else None."""
        if not (self._all or query.namespace in self._namespaces):
            return None
        if query.sampling.guide is not None:
            return None  # a paraphrase's answer was not decoded under this request's grammar
        if query.sampling.tools is not None:
            return None  # nor with this request's tools
        if asking and not (
            query.semantic if query.semantic is not None else self.settings.request_default
        ):
            return None
        if query.prompt is not None:
            text = query.prompt
        elif query.messages and query.messages[-1][0] == "user":
            text = query.messages[-1][1]
        else:
            return None
        return text if any(c.isalnum() for c in text[:1024]) else None

    def eligible(self, query: CacheQuery, asking: bool) -> tuple[bytes, str] | None:
        """(scope, question) when this request takes part in the tier, else None."""
        text = self.question(query, asking)
        if text is None:
            return None
        if query.prompt is not None:
            scope = cache_key(query.namespace, query.model, "", (), query.sampling)
        else:
            earlier = (*query.messages[:-1], ("user", ""))
            scope = cache_key(query.namespace, query.model, None, earlier, query.sampling)
        return scope, text

    def in_sync(self) -> bool:
        return self._synced_at is not None and time.monotonic() - self._synced_at < self._stale_s

    # -- CacheTier ----------------------------------------------------------------------------

    @classmethod
    def build(cls, context: TierContext) -> SemanticTier | None:
        return make_semantic_tier(context.config.semantic, context.find(RedisTier))

    async def lookup(self, query: CacheQuery) -> Hit | None:
        self.note_mark(query)
        found = self.eligible(query, asking=True)
        if found is None:
            self.counts.skipped += 1
            return None
        if not self.in_sync():
            self.counts.unsynced += 1
            return None
        scope, text = found
        self.counts.lookups += 1
        vector = await self._embed(text, prepared=True)
        if vector is None:
            self.counts.skipped += 1
            return None
        return self.match(scope, text, vector)

    def match(
        self, scope: bytes, text: str, vector: Vector, exact: bool | None = None
    ) -> Hit | None:
        """The decision over the scope's nearest entries: the best one the rule accepts (`exact`:
        see VectorIndex.search)."""
        found = self.index.search(scope, vector, self.settings.candidates, exact)
        decisions = self.rule.decide_many(
            vector, text, [(stored, entry.text) for entry, stored in found]
        )
        best: tuple[Entry, float, float] | None = None
        for (entry, _), decision in zip(found, decisions, strict=True):
            if not decision.same:
                self.counts.refused += 1
            elif best is None or decision.score > best[2]:
                best = (entry, decision.similarity, decision.score)
        if best is None:
            return None
        entry, similarity, _ = best
        self.index.touch(entry)
        return Hit(
            entry.answer, self.name, exact=False, similarity=similarity, entry=entry.entry_id
        )

    def overlaps_engine(self, query: CacheQuery) -> bool:
        """With `overlap_engine` on, the lookups that embed: one the tier skips at once has no
        time to hide behind the engine's start."""
        return (
            self.settings.overlap_engine
            and self.in_sync()
            and self.question(query, asking=True) is not None
        )

    def prepare(self, query: CacheQuery) -> None:
        """Starts the embedding while the exact L2 tier asks Redis: a lookup that reaches this
        tier finds it under way or done; `forgo` cancels it when an earlier tier answers."""
        text = self.question(query, asking=True)
        if text is not None and self.in_sync():
            self._start_embedding(text).prepared += 1

    def forgo(self, query: CacheQuery) -> None:
        """An earlier tier answered: the embedding `prepare` started is cancelled unless another
        request still wants it. It would otherwise hold the embedding thread (a few ms of two
        cores) for a vector nobody uses, while the next request's embedding waits behind it."""
        text = self.question(query, asking=True)
        if text is None:
            return
        running = self._embedding.get(text)
        if running is None or running.task.done():
            return
        running.prepared = max(0, running.prepared - 1)
        if running.prepared == 0 and running.waiting == 0:
            running.run.cancel()
            # Whoever asks for this text from now on starts a new embedding.
            del self._embedding[text]
            self.counts.cancelled += 1

    def store(self, query: CacheQuery, answer: CachedAnswer) -> None:
        found = self.eligible(query, asking=False)
        if found is None:
            return
        task = asyncio.get_running_loop().create_task(self._store(query, found, answer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def invalidate(self, namespace: str, model: str, entry: bytes | None = None) -> int:
        """Drops local entries, tells every gateway through the stream; the Redis records share
        the L2 key layout, so the L2 tier's invalidation unlinks them."""
        removed = self._invalidate(namespace, model, entry)
        if self._client is not None and self._seals is not None:
            message = {"inv": namespace, "model": model}
            if entry is not None:
                message["entry"] = entry.hex()
            await self._seals.append(self._client, message, self.settings.stream_max_len)
        return removed

    def counters(self) -> dict[str, int]:
        c = self.counts
        return {
            "semantic_entries": len(self.index),
            "semantic_bytes": self.index.bytes,
            "semantic_in_sync": int(self.in_sync()),
            "semantic_lookups": c.lookups,
            "semantic_skipped": c.skipped,
            "semantic_unsynced": c.unsynced,
            "semantic_refused": c.refused,
            "semantic_stored": c.stored,
            "semantic_store_failures": c.store_failures,
            "semantic_follower_errors": c.follower_errors,
            "semantic_rebuilds": c.rebuilds,
            "semantic_corrupt_records": c.corrupt,
            "semantic_forged_records": c.forged,
            "semantic_invalidated_records": c.invalidated,
            "semantic_refused_messages": 0 if self._seals is None else self._seals.refused,
            "semantic_embeddings_cancelled": c.cancelled,
        }

    async def check(self) -> str:
        """Starts following the shared entries (a restarted gateway rebuilds its index now, not at
        its first request); says why not when Redis does not answer (the follower keeps trying)."""
        if self._client is None or self._follower is not None:
            return ""
        self._follower = asyncio.get_running_loop().create_task(self._follow())
        try:
            async with asyncio.timeout(1.0):
                await self._client.ping()
        except (TimeoutError, RedisError, OSError) as exc:
            return f"redis unreachable ({exc or type(exc).__name__}): no semantic hits until it is"
        return ""

    async def close(self) -> None:
        # Every wait is bounded: a stop must not hang on a Redis read that ignores cancellation.
        self._closing = True
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.wait({self._follower}, timeout=1.0)
        waiting: set[asyncio.Future[Any]] = {
            *self._tasks,
            *(e.task for e in self._embedding.values()),
        }
        if waiting:
            await asyncio.wait(waiting, timeout=1.0)
        if self._own is not None:
            await self._own.close()
        self._embeds.shutdown(wait=False, cancel_futures=True)

    # -- work off the request path ------------------------------------------------------------

    async def _embed(self, text: str, prepared: bool = False) -> Vector | None:
        """The text's vector; `prepared`: the lookup `prepare` started this embedding for."""
        vector = self._recent.get(text)
        if vector is not None:
            return vector
        running = self._start_embedding(text)
        if prepared:
            running.prepared = max(0, running.prepared - 1)
        running.waiting += 1
        try:
            # Shielded: a cancelled lookup leaves the embedding to finish for whoever else waits.
            return await asyncio.shield(running.task)
        finally:
            running.waiting -= 1

    def _start_embedding(self, text: str) -> _Embedding:
        """The embedding of the text on the embedding thread, one at a time per text."""
        running = self._embedding.get(text)
        if running is not None:
            return running
        run = EmbedRun()
        task = asyncio.get_running_loop().create_task(self._run_embedding(text, run))
        started = self._embedding[text] = _Embedding(task, run)

        def forget(_: object) -> None:
            if self._embedding.get(text) is started:  # not a newer one after a cancel
                del self._embedding[text]

        task.add_done_callback(forget)
        return started

    async def _run_embedding(self, text: str, run: EmbedRun) -> Vector | None:
        loop = asyncio.get_running_loop()
        try:
            vector = await loop.run_in_executor(self._embeds, self.embedder.embed, text, run)
        except EmbeddingCancelled:
            return None
        except Exception:  # an embedder fault is a miss, never a failed request
            log.exception("embedding failed")
            return None
        if vector is not None:
            self._recent[text] = vector
            if len(self._recent) > 256:
                self._recent.popitem(last=False)
        return vector

    async def _store(
        self, query: CacheQuery, found: tuple[bytes, str], answer: CachedAnswer
    ) -> None:
        scope, text = found
        vector = await self._embed(text)
        if vector is None:
            return
        labels = (query.namespace, query.model.name)
        if self.overtaken(query) or (self.l2 is not None and self.l2.overtaken(query)):
            # Generated while an invalidation that covers it ran: neither indexed nor shared.
            self.counts.invalidated += 1
            return
        known = None
        if self.l2 is not None:
            known = self.l2.marked(query)
            if known is None:  # not read before the generation began: not stored
                self.counts.store_failures += 1
                return
        entry = Entry(
            entry_id=query.key,
            scope=scope,
            text=text,
            answer=answer,
            labels=labels,
            expires=time.monotonic() + self.settings.ttl_s,
        )
        if not self.index.add(entry, vector):
            return
        self.counts.stored += 1
        if self.l2 is None or self._seals is None or known is None:
            return
        # The L2 key layout with the entry's id marked, so L2's GETs never meet a record. Sealed
        # for that key as L2's entries are: the stream carries the same value, and whatever else
        # writes to Redis cannot plant an answer.
        name = self.l2.redis_key(query.namespace, query.model.name, b"") + MARK + query.key.hex()
        record = self.l2.seal(name, encode_record(entry, vector, time.time(), known))
        ttl = max(1, int(self.settings.ttl_s))
        # The record and its message in one round trip (SET, then TIME's millisecond's XADD),
        # within the tier's time budget; an XADD behind the stream's last id retries alone.
        appended = self._seals.append(
            self.l2.client,
            {"k": name, "v": record},
            self.settings.stream_max_len,
            also=lambda pipe: pipe.set(name, record, ex=ttl),
        )
        if await self.l2._call("semantic write", appended, write=True) is None:
            self.counts.store_failures += 1

    def _record(
        self, name: bytes, data: bytes, generations: Mapping[str, Any]
    ) -> tuple[Entry, Vector] | None:
        """The entry a Redis record read under key `name` holds, unless it is already in the
        index, was not sealed by a gateway for that key, is corrupt, or an invalidation
        superseded it: one of its scopes has a generation above the one its writer read, in
        `generations` (read from Redis, by key) or as the highest this gateway has seen."""
        parsed = self._parse_key(name)
        if parsed is None or parsed[0] in self.index:
            return None
        entry_id, labels = parsed
        assert self.l2 is not None
        body = self.l2.open(name, data)
        if body is None:
            self.counts.forged += 1
            return None
        try:
            written, created, scope, vector, text, answer = decode_record(body, self.embedder.dim)
        except OlderRecordError:
            return None
        except (CorruptEntryError, ValueError):
            self.counts.corrupt += 1
            return None
        scopes = self.l2.generation_keys(*labels, entry_id)
        try:
            known = self.l2.known(scopes, [generations.get(key) for key in scopes])
        except ValueError:  # not a generation: overwritten
            self.counts.corrupt += 1
            return None
        if superseded(written, known):
            self.counts.invalidated += 1
            return None
        left = created + self.settings.ttl_s - time.time()
        return Entry(entry_id, scope, text, answer, labels, time.monotonic() + left), vector

    def _message(self, message_id: bytes, fields: dict[bytes, bytes]) -> None:
        """A message read from the stream, applied unless no gateway sealed it or it is a replay.
        The gateway's own messages apply again: a rebuild under way may have loaded a record
        its invalidation unlinked."""
        assert self._seals is not None
        try:
            admitted = self._seals.admits(message_id, fields)
        except (KeyError, ValueError):
            self.counts.corrupt += 1
            return
        if admitted:
            self._apply(fields)

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        if b"inv" in fields:
            try:
                entry = bytes.fromhex(fields[b"entry"].decode()) if b"entry" in fields else None
                namespace, model = fields[b"inv"].decode(), fields.get(b"model", b"").decode()
            except (UnicodeDecodeError, ValueError):
                self.counts.corrupt += 1
                return
            self._invalidate(namespace, model, entry)
            return
        record = self._record(fields.get(b"k", b""), fields.get(b"v", b""), self._heard)
        if record is not None:
            self.index.add(*record)

    def _invalidate(self, namespace: str, model: str, entry: bytes | None) -> int:
        self.invalidations.note(namespace, model, entry)
        return self.index.invalidate(namespace, model, entry)

    def _parse_key(self, name: bytes) -> tuple[bytes, tuple[str, str]] | None:
        """The entry id and (namespace, model) of a record's Redis key; None for any other key
        (an exact answer's value is sealed with the same key, so its key must not pass)."""
        assert self.l2 is not None
        try:
            prefix, ns, model, tail = name.decode().split(":")
            if prefix != self.l2.settings.key_prefix or not tail.startswith(MARK):
                return None
            return bytes.fromhex(tail.removeprefix(MARK)), (unquote(ns), unquote(model))
        except ValueError:
            return None

    async def _rebuild(self) -> str:
        """Scans every record into the index; returns the stream position to follow from."""
        assert self._client is not None and self.l2 is not None
        started = time.monotonic()
        assert self._seals is not None
        position = await self._seals.start_position(self._client)
        # Invalidations may have been missed meanwhile: an answer under way is not indexed.
        self.invalidations.note("", "", None)
        self.index.clear()
        added = 0
        batch: list[bytes] = []
        # The generations of the scopes shared by records (all, namespace, model, both) read so
        # far, by key: each is read once per rebuild.
        shared: dict[str, Any] = {}
        pattern = f"{self.l2.settings.key_prefix}:*:*:{MARK}*"
        async for name in self._client.scan_iter(match=pattern, count=1000):
            batch.append(name)
            if len(batch) >= REBUILD_BATCH:
                added += await self._load(batch, shared)
                batch = []
        if batch:
            added += await self._load(batch, shared)
        seconds = time.monotonic() - started
        self.last_rebuild = (added, seconds)
        self.counts.rebuilds += 1
        log.info("semantic index rebuilt from redis: %d entries in %.2f s", added, seconds)
        self.on_rebuilt()
        return position

    async def _load(self, names: list[bytes], shared: dict[str, Any]) -> int:
        """Adds a batch of records, read in one MGET with the generations of their scopes that
        are not in `shared` (there go those of the scopes records share: all but the entry's)."""
        assert self._client is not None and self.l2 is not None
        wanted = self._generation_keys(names, shared)
        values = await self._client.mget([*names, *wanted])
        read = dict(zip(wanted, values[len(names) :], strict=True))
        own = f"{self.l2.settings.key_prefix}:gen-entry-"
        shared.update((key, value) for key, value in read.items() if not key.startswith(own))
        known = ChainMap(read, shared)
        records = []
        for name, data in zip(names, values, strict=False):
            record = self._record(name, data, known) if isinstance(data, bytes) else None
            if record is not None:
                records.append(record)
        return self.index.add_many(records)

    async def _scope_generations(self, names: list[bytes]) -> dict[str, Any]:
        """The generations (by key) of the scopes of the records named, in one MGET."""
        assert self._client is not None
        wanted = self._generation_keys(names, {})
        return dict(zip(wanted, await self._client.mget(wanted), strict=True)) if wanted else {}

    def _generation_keys(self, names: list[bytes], skip: Mapping[str, Any]) -> list[str]:
        """The generation keys of the scopes of the records named, each once, but those in
        `skip`."""
        assert self.l2 is not None
        wanted: dict[str, None] = {}
        for name in names:
            parsed = self._parse_key(name)
            if parsed is not None:
                keys = self.l2.generation_keys(*parsed[1], parsed[0])
                wanted.update((key, None) for key in keys if key not in skip)
        return list(wanted)

    async def _follow(self) -> None:
        """Keeps the index in step with the stream; on any Redis fault, waits, then rebuilds."""
        assert self._client is not None and self.l2 is not None
        position: str | None = None
        failing = False
        while True:
            try:
                if position is None:
                    position = await self._rebuild()
                    # The scan is a sync point: lookups need not wait for the first stream read,
                    # which blocks up to follow_block_ms when nothing is written.
                    self._synced_at = time.monotonic()
                reply: Any = await self._client.xread(
                    {self._stream: position}, count=1000, block=self.settings.follow_block_ms
                )
                self._synced_at = time.monotonic()
                if failing:
                    log.info("semantic tier back in step with redis")
                    failing = False
                for _, messages in reply or ():
                    # Read after the messages: an invalidation appended before a record that an
                    # answer under way during it stored has already raised its generation.
                    self._heard = await self._scope_generations(
                        [fields.get(b"k", b"") for _, fields in messages]
                    )
                    for message_id, fields in messages:
                        self._message(message_id, fields)
                        position = message_id.decode()
            except (RedisError, OSError, TimeoutError) as exc:
                if self._closing:
                    return
                self._synced_at = None
                position = None
                self.counts.follower_errors += 1
                if not failing:
                    log.warning("semantic tier lost redis (%s): no semantic hits until back", exc)
                    failing = True
                await asyncio.sleep(self.l2.breaker.reset_s)


def make_semantic_tier(config: SemanticConfig, l2: RedisTier | None) -> SemanticTier | None:
    """The tier, or None (said in one log line) when its embedder or rule cannot be loaded: the
    gateway then serves without it."""
    try:
        embedder = Embedder(config.embedder_dir, threads=config.embed_threads)
        rule, numpy_because = load_rule(config.embedder_dir)
    except EmbedderUnavailable as exc:
        log.warning("semantic cache tier off: %s", exc)
        return None
    except (OSError, ValueError, KeyError) as exc:
        log.warning("semantic cache tier off: decision rule unusable (%s)", exc)
        return None
    if numpy_because:
        log.warning("semantic decision rule scores in numpy, not compiled: %s", numpy_because)
    return SemanticTier(config, embedder, rule, l2)
