"""The cache as the gateway uses it: look up L1 then L2, store in both (L2 off the request path)."""

from __future__ import annotations

import asyncio
import logging

from appliance.cache.entry import CachedAnswer
from appliance.cache.l1 import LruCache
from appliance.cache.l2 import RedisTier
from appliance.cache.metrics import CacheMetrics
from appliance.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)


class ResponseCache:
    def __init__(self, l1: LruCache, l2: RedisTier | None, metrics: CacheMetrics) -> None:
        self.l1 = l1
        self.l2 = l2
        self.metrics = metrics
        self._writes: set[asyncio.Task[None]] = set()

    async def lookup(
        self, namespace: str, model: str, key: bytes
    ) -> tuple[CachedAnswer, pb.CacheTier] | None:
        """The cached answer and the tier that had it (CacheTier), or None on a miss."""
        answer = self.l1.get(key)
        if answer is not None:
            self.metrics.l1_hits += 1
            return answer, pb.CACHE_TIER_EXACT_L1
        if self.l2 is not None:
            answer = await self.l2.get(namespace, model, key)
            if answer is not None:
                self.metrics.l2_hits += 1
                self.l1.put(key, answer, (namespace, model))
                return answer, pb.CACHE_TIER_EXACT_L2
        self.metrics.misses += 1
        return None

    def store(self, namespace: str, model: str, key: bytes, answer: CachedAnswer) -> None:
        """L1 now; L2 in a background task whose failure is counted, never seen by a client."""
        self.metrics.writes += 1
        self.l1.put(key, answer, (namespace, model))
        if self.l2 is not None:
            task = asyncio.get_running_loop().create_task(
                self._write_l2(namespace, model, key, answer)
            )
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _write_l2(self, namespace: str, model: str, key: bytes, answer: CachedAnswer) -> None:
        assert self.l2 is not None
        if not await self.l2.put(namespace, model, key, answer):
            self.metrics.write_failures += 1

    async def invalidate(self, namespace: str, model: str) -> tuple[int, int]:
        removed_l1 = self.l1.invalidate(namespace, model)
        removed_l2 = await self.l2.invalidate(namespace, model) if self.l2 is not None else 0
        log.info(
            "invalidated namespace=%r model=%r: l1 %d, l2 %d",
            namespace,
            model,
            removed_l1,
            removed_l2,
        )
        return removed_l1, removed_l2

    def counters(self) -> dict[str, int]:
        counters = self.metrics.as_dict()
        counters["l1_entries"] = len(self.l1)
        counters["l1_bytes"] = self.l1.bytes
        if self.l2 is not None:
            counters["breaker_open"] = int(self.l2.breaker.state != "closed")
        return counters

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(self._writes, timeout=1.0)
        if self.l2 is not None:
            await self.l2.close()
