"""L1: an in-process LRU bounded by entries and bytes, with a TTL.

A hit here never leaves the event loop: a dict lookup and a move to the LRU end.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from appliance.cache.entry import CachedAnswer


class LruCache:
    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
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
        return len(doomed)

    def _drop(self, key: bytes) -> None:
        _, answer, _ = self._items.pop(key)
        self.bytes -= answer.size()
