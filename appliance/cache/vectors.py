"""The semantic tier's in-process vector index: entries by scope, bounded by entries, bytes and TTL.

A scope is everything that must be identical for two requests to share an answer (namespace, model
identity, sampling, stop strings, earlier chat messages), so each scope has its own usearch HNSW
index and a search never sees another scope's vectors. Vectors are kept once, in usearch (float32, so
the similarities are those the decision rule was tuned on). Eviction is least recently used across
all scopes; an expired entry is dropped when a search meets it or when it reaches the LRU end.
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

# Bytes an entry costs beyond its text and answer: the float32 vector, usearch's graph links at the
# default connectivity (about 2 × 16 neighbours × 4 bytes at level 0), and the Python objects.
ENTRY_OVERHEAD = 384 * 4 + 160 + 400


# Scopes up to this size are searched exhaustively (0.6 ms at 4096 entries here, against 0.4 ms for
# the graph): the graph, built with a narrow expansion_add, loses the nearest entry once a scope
# holds a cluster of near-identical questions ("rainfall in district N during week M" x 160 hid
# "What is the meaning of life?" from "What's the meaning of life?", cosine 0.98).
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
            entry.label = next(self._labels)
            pending.setdefault(entry.scope, []).append((entry.label, vector))
            self._by_label[entry.label] = entry
            self._lru[entry.entry_id] = entry
            self.bytes += entry.size
            added += 1
        self._insert(pending)
        while len(self._lru) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._lru.values())))
        return added

    def _insert(self, pending: dict[bytes, list[tuple[int, Vector]]]) -> None:
        for scope, rows in pending.items():
            index = self._scopes.get(scope)
            if index is None:
                index = self._scopes[scope] = _new_index(self.dim)
            labels = np.array([label for label, _ in rows], dtype=np.uint64)
            index.add(labels, np.ascontiguousarray(np.stack([v for _, v in rows]), np.float32))

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
        found = index.search(vector, min(k, len(index)), exact=exact)
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
        # One call for every candidate's vector (each usearch call costs about 10 µs).
        stored = index.get(np.array([e.label for e in live], dtype=np.uint64))
        return [(e, np.asarray(v, dtype=np.float32)) for e, v in zip(live, stored, strict=True)]

    def entries(self) -> list[tuple[Entry, Vector]]:
        """Every entry with its vector (least recently used first)."""
        return [
            (e, np.asarray(self._scopes[e.scope].get(e.label), dtype=np.float32))
            for e in self._lru.values()
        ]

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

    def invalidate(self, namespace: str, model: str) -> int:
        """Drops entries of a namespace and/or model ("" matches any)."""
        doomed = [
            e
            for e in self._lru.values()
            if (not namespace or e.labels[0] == namespace) and (not model or e.labels[1] == model)
        ]
        for entry in doomed:
            self._drop(entry)
        return len(doomed)

    def clear(self) -> None:
        self._scopes.clear()
        self._by_label.clear()
        self._lru.clear()
        self.bytes = 0

    def _drop(self, entry: Entry) -> None:
        self._lru.pop(entry.entry_id, None)
        if self._by_label.pop(entry.label, None) is None:
            return
        self.bytes -= entry.size
        index = self._scopes[entry.scope]
        index.remove(entry.label)
        if len(index) == 0:
            del self._scopes[entry.scope]

    def memory_bytes(self) -> int:
        """What usearch itself holds (vectors and graph), for the benchmark's memory figure."""
        return sum(int(index.memory_usage) for index in self._scopes.values())


def _new_index(dim: int) -> Any:
    """A usearch index for unit vectors (inner product = cosine). usearch is imported here, not
    at the top: onnxruntime (imported by the embedder module) must be loaded first; the other order
    crashes the process when onnxruntime loads (a native-library clash)."""
    from usearch.index import Index

    # expansion_add 32 (default 128): inserts 8x cheaper (a rebuild of 100k entries in seconds,
    # not minutes); the search keeps its default breadth, and the rule verifies every candidate.
    return Index(ndim=dim, metric="ip", dtype="f32", expansion_add=32)
