"""L1: an in-process LRU bounded by entries and bytes, with a TTL.

A hit here never leaves the event loop: a dict lookup and a move to the LRU end.

A put is refused when an invalidation since its mark names it: the mark is the invalidation count
(`Invalidations.sequence`) taken before the answer's generation began, or before the read of the
shared tier it was copied from (the cascade takes it at L1's lookup). However long the generation
or the read took, the answer of a question dropped meanwhile is not stored.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

from appliance.cache.entry import CachedAnswer

# Invalidations a cache remembers; a put marked before the oldest of them is refused whatever
# it names.
MAX_RECORD = 1024


class Invalidations:
    """The recent invalidations of an in-process store, numbered: what a put compares its mark
    against."""

    def __init__(self) -> None:
        self.sequence = 0  # invalidations so far: the mark of a put begun now
        # (sequence, namespace, model, entry or None); "" matches any; the newest last.
        self._recent: deque[tuple[int, str, str, bytes | None]] = deque(maxlen=MAX_RECORD)

    def note(self, namespace: str, model: str, entry: bytes | None) -> None:
        self.sequence += 1
        self._recent.append((self.sequence, namespace, model, entry))

    def since(self, mark: int, key: bytes, labels: tuple[str, str]) -> bool:
        """Whether an invalidation after `mark` names the entry of this key and (namespace,
        model); True too when the record no longer reaches back to `mark` (it cannot say)."""
        if mark >= self.sequence:
            return False
        if not self._recent or self._recent[0][0] > mark + 1:
            return True
        for sequence, namespace, model, entry in reversed(self._recent):
            if sequence <= mark:
                return False
            if (
                (not namespace or namespace == labels[0])
                and (not model or model == labels[1])
                and (entry is None or entry == key)
            ):
                return True
        return False


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
        self.invalidations = Invalidations()
        self.held = 0  # puts refused: an invalidation since their mark named them
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

    def put(
        self, key: bytes, answer: CachedAnswer, labels: tuple[str, str], mark: int | None = None
    ) -> None:
        """`mark`: `invalidations.sequence` before the answer's generation (or read) began; None
        for an answer no invalidation can have overtaken."""
        size = answer.size()
        if size > self.max_bytes or self.max_entries == 0:
            return
        if mark is not None and self.invalidations.since(mark, key, labels):
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
        self.invalidations.note(namespace, model, entry)
        return len(doomed)

    def _drop(self, key: bytes) -> None:
        _, answer, _ = self._items.pop(key)
        self.bytes -= answer.size()
