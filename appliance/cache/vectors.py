"""The semantic tier's in-process vector index: entries by scope, bounded by entries, bytes and TTL.

A scope is everything that must be identical for two requests to share an answer (namespace, model
identity, sampling, stop strings, earlier chat messages), so each scope has its own usearch HNSW
index and a search never sees another scope's vectors. The graph holds int8 copies of the vectors: a
search reads a quarter of the bytes, which is what it costs right after a model run has evicted the
caches (docs/PERFORMANCE.md#lookup-at-100k-entries). The float32 vectors sit in blocks
beside it (1.5 kB an entry, where usearch's float32 graph took 1.7 kB); a search takes twice the candidates it returns from the graph and ranks them by the exact
vectors, so the similarities are those the decision rule was tuned on (the nearest entry found as
often as by a float32 graph, 564 against 567 of 600 questions). Eviction is least recently used
across all scopes; an expired entry is dropped when a search meets it or when it reaches the LRU
end.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from appliance.cache.embedder import Vector
from appliance.cache.entry import CachedAnswer

# Bytes an entry costs beyond its text and answer: the float32 vector, its int8 copy, usearch's graph
# links at the default connectivity (about 2 × 16 neighbours × 4 bytes at level 0), and the Python
# objects.
ENTRY_OVERHEAD = 384 * 4 + 384 + 160 + 400
# Bytes a scope costs beyond its entries: its own usearch index, which reserves room for a few
# hundred nodes and one search context at its first add (measured: 48 KB of RSS for a one-entry
# scope, searched). Every chat history and set of sampling parameters is a scope of its own.
SCOPE_OVERHEAD = 64 * 1024
# Threads of a usearch call. usearch keeps a search context per thread a call may use (0: every
# core) in each index for good (measured: 18 KB a thread; over 1 MB a scope at 64 cores). One
# question's search is one thread's work; a rebuild's batch adds run on the event loop either way.
USEARCH_THREADS = 1
# Graph candidates per candidate returned: the int8 ranking is re-done with the float32 vectors.
WIDEN = 2
# The float32 vectors live in blocks of this many rows, allocated as needed and never moved (a grown
# array would be copied, and held twice while it is).
BLOCK_ROWS = 1024


# Scopes up to this size are searched exhaustively (over the int8 copies, at a small cost over the
# graph; docs/PERFORMANCE.md#semantic-cache-tier): the graph, built with a narrow expansion_add,
# loses the nearest entry once a scope holds a cluster of near-identical questions ("rainfall in
# district N during week M" x 160 hid "What is the meaning of life?" from "What's the meaning of
# life?", cosine 0.98).
EXACT_SEARCH_UP_TO = 4096


@dataclass(slots=True)
class Entry:
    entry_id: bytes  # the exact cache key of the request whose answer this is
    scope: bytes
    text: str  # the question the vector was computed from
    answer: CachedAnswer
    labels: tuple[str, str]  # (namespace, model name) for invalidation
    expires: float  # on the index's clock
    label: int = 0  # usearch key
    slot: int = -1  # row of its float32 vector
    size: int = 0


class VectorIndex:
    def __init__(
        self,
        dim: int,
        max_entries: int,
        max_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dim = dim
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._clock = clock
        self._labels = itertools.count(1)
        self._scopes: dict[bytes, Any] = {}  # scope → usearch Index
        self._by_label: dict[int, Entry] = {}
        self._lru: OrderedDict[bytes, Entry] = OrderedDict()  # entry_id → entry
        self._blocks: list[Vector] = []  # slot s is row s % BLOCK_ROWS of block s // BLOCK_ROWS
        self._free: list[int] = []  # slots of dropped entries
        self._slots = 0  # slots ever handed out
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, entry_id: bytes) -> bool:
        return entry_id in self._lru

    def add(self, entry: Entry, vector: Vector) -> bool:
        """Adds (or replaces) an entry; False when it cannot fit at all or has expired."""
        return self.add_many([(entry, vector)]) == 1

    def add_many(self, items: list[tuple[Entry, Vector]]) -> int:
        """Adds entries (a rebuild adds hundreds at once, one usearch call per scope); returns
        how many were added."""
        now = self._clock()
        pending: dict[bytes, list[tuple[int, Vector]]] = {}
        added = 0
        for entry, vector in items:
            entry.size = ENTRY_OVERHEAD + len(entry.text.encode()) + entry.answer.size()
            if entry.size > self.max_bytes or self.max_entries == 0 or entry.expires <= now:
                continue
            if entry.entry_id in self._lru:
                self._insert(pending)  # the entry it replaces may be among them
                pending = {}
                self._drop(self._lru[entry.entry_id])
            if entry.scope not in self._scopes and entry.scope not in pending:
                if entry.size + SCOPE_OVERHEAD > self.max_bytes:
                    continue
                self.bytes += SCOPE_OVERHEAD
            entry.label = next(self._labels)
            entry.slot = self._slot()
            self._row(entry.slot)[:] = vector
            pending.setdefault(entry.scope, []).append((entry.label, vector))
            self._by_label[entry.label] = entry
            self._lru[entry.entry_id] = entry
            self.bytes += entry.size
            added += 1
        self._insert(pending)
        while len(self._lru) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._lru.values())))
        return added

    def _slot(self) -> int:
        if self._free:
            return self._free.pop()
        if self._slots == len(self._blocks) * BLOCK_ROWS:
            self._blocks.append(np.zeros((BLOCK_ROWS, self.dim), dtype=np.float32))
        self._slots += 1
        return self._slots - 1

    def _row(self, slot: int) -> Vector:
        row: Vector = self._blocks[slot // BLOCK_ROWS][slot % BLOCK_ROWS]
        return row

    def _insert(self, pending: dict[bytes, list[tuple[int, Vector]]]) -> None:
        for scope, rows in pending.items():
            index = self._scopes.get(scope)
            if index is None:
                index = self._scopes[scope] = _new_index(self.dim)
            labels = np.array([label for label, _ in rows], dtype=np.uint64)
            rows_in = np.ascontiguousarray(np.stack([v for _, v in rows]), np.float32)
            index.add(labels, rows_in, threads=USEARCH_THREADS)

    def search(
        self, scope: bytes, vector: Vector, k: int, exact: bool | None = None
    ) -> list[tuple[Entry, Vector]]:
        """Up to k live entries of the scope nearest to the vector, nearest first, each with its
        stored vector (the rule compares the two). `exact`: search exhaustively or through the
        graph (None: exhaustively up to EXACT_SEARCH_UP_TO entries)."""
        index = self._scopes.get(scope)
        if index is None or len(index) == 0:
            return []
        if exact is None:
            exact = len(index) <= EXACT_SEARCH_UP_TO
        found = index.search(
            vector, min(WIDEN * k, len(index)), exact=exact, threads=USEARCH_THREADS
        )
        now = self._clock()
        live: list[Entry] = []
        for label in found.keys.tolist():
            entry = self._by_label.get(label)
            if entry is None:
                continue
            if entry.expires <= now:
                self._drop(entry)
                continue
            live.append(entry)
        if not live:
            return []
        stored = np.stack([self._row(e.slot) for e in live])
        nearest = np.argsort(-(stored @ vector), kind="stable")[:k]
        return [(live[i], stored[i]) for i in nearest.tolist()]

    def entries(self) -> list[tuple[Entry, Vector]]:
        """Every entry with its vector (least recently used first)."""
        return [(e, self._row(e.slot).copy()) for e in self._lru.values()]

    def touch(self, entry: Entry) -> None:
        """Marks an entry as just used (it answered a request)."""
        if entry.entry_id in self._lru:
            self._lru.move_to_end(entry.entry_id)

    def remove(self, entry_id: bytes) -> bool:
        entry = self._lru.get(entry_id)
        if entry is None:
            return False
        self._drop(entry)
        return True

    def invalidate(self, namespace: str, model: str, entry: bytes | None = None) -> int:
        """Drops entries of a namespace and/or model ("" matches any); `entry`: only that id's."""
        if entry is None:
            candidates = list(self._lru.values())
        else:
            one = self._lru.get(entry)
            candidates = [] if one is None else [one]
        doomed = [
            e
            for e in candidates
            if (not namespace or e.labels[0] == namespace) and (not model or e.labels[1] == model)
        ]
        for gone in doomed:
            self._drop(gone)
        return len(doomed)

    def clear(self) -> None:
        self._scopes.clear()
        self._by_label.clear()
        self._lru.clear()
        self._blocks.clear()
        self._free.clear()
        self._slots = 0
        self.bytes = 0

    def _drop(self, entry: Entry) -> None:
        self._lru.pop(entry.entry_id, None)
        if self._by_label.pop(entry.label, None) is None:
            return
        self.bytes -= entry.size
        self._free.append(entry.slot)
        index = self._scopes[entry.scope]
        index.remove(entry.label)
        if len(index) == 0:
            del self._scopes[entry.scope]
            self.bytes -= SCOPE_OVERHEAD

    def memory_bytes(self) -> int:
        """What the vectors and graphs hold, for the benchmark's memory figure."""
        graphs = sum(int(index.memory_usage) for index in self._scopes.values())
        return graphs + len(self._blocks) * BLOCK_ROWS * self.dim * 4


def _new_index(dim: int) -> Any:
    """A usearch index for unit vectors (inner product = cosine). usearch is imported here, not
    at the top: onnxruntime (imported by the embedder module) must be loaded first; the other order
    crashes the process when onnxruntime loads (a native-library clash)."""
    from usearch.index import Index

    # expansion_add 32 (default 128): inserts 8x cheaper (a rebuild of 100k entries in seconds,
    # not minutes); the search keeps its default breadth, and the rule verifies every candidate.
    return Index(ndim=dim, metric="ip", dtype="i8", expansion_add=32)
