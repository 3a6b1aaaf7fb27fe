"""L1: an in-process LRU bounded by entries and bytes, with a TTL.

A hit here never leaves the event loop: a dict lookup and a move to the LRU end.

An invalidation also holds back, for `hold_s`, puts of the entries it named: a read of the shared
tier that began before the shared entry was unlinked can come back after L1 was emptied, and its
answer would otherwise be copied back into L1 and served until the TTL.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

from appliance.cache.entry import CachedAnswer

MAX_HOLDS = 64


class LruCache:
    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        hold_s: float = 1.0,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.hold_s = hold_s
        self._clock = clock
        # Invalidations still holding puts back: (namespace, model, entry, until); "" matches any;
        # `until` only grows, hold_s being fixed.
        self._holds: deque[tuple[str, str, bytes | None, float]] = deque()
        self.held = 0  # puts refused by a hold
        # key -> (expires_at, answer, labels); labels = (namespace, model) for invalidation.
        self._items: OrderedDict[bytes, tuple[float, CachedAnswer, tuple[str, str]]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: bytes) -> CachedAnswer | None:
        item = self._items.get(key)
        if item is None:
            return None
        if item[0] <= self._clock():
            self._drop(key)
            return None
        self._items.move_to_end(key)
        return item[1]

    def put(self, key: bytes, answer: CachedAnswer, labels: tuple[str, str]) -> None:
        size = answer.size()
        if size > self.max_bytes or self.max_entries == 0:
            return
        if self._holds and self._held(key, labels):
            self.held += 1
            return
        if key in self._items:
            self._drop(key)
        self._items[key] = (self._clock() + self.ttl_s, answer, labels)
        self.bytes += size
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            oldest = next(iter(self._items))
            self._drop(oldest)

    def invalidate(self, namespace: str, model: str, entry: bytes | None = None) -> int:
        """Drops entries of a namespace and/or model ("" matches any); `entry`: only that key's."""
        keys = list(self._items) if entry is None else [k for k in (entry,) if k in self._items]
        doomed = [
            k
            for k in keys
            if (not namespace or self._items[k][2][0] == namespace)
            and (not model or self._items[k][2][1] == model)
        ]
        for key in doomed:
            self._drop(key)
        if self.hold_s > 0:
            now = self._clock()
            self._expire_holds(now)
            self._holds.append((namespace, model, entry, now + self.hold_s))
            if len(self._holds) > MAX_HOLDS:
                # A burst of invalidations: one hold of everything keeps each put's check short.
                self._holds.clear()
                self._holds.append(("", "", None, now + self.hold_s))
        return len(doomed)

    def _held(self, key: bytes, labels: tuple[str, str]) -> bool:
        self._expire_holds(self._clock())
        return any(
            (not namespace or namespace == labels[0])
            and (not model or model == labels[1])
            and (entry is None or entry == key)
            for namespace, model, entry, _ in self._holds
        )

    def _expire_holds(self, now: float) -> None:
        while self._holds and self._holds[0][3] <= now:
            self._holds.popleft()

    def _drop(self, key: bytes) -> None:
        _, answer, _ = self._items.pop(key)
        self.bytes -= answer.size()
