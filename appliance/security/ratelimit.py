"""Per-key rate limits: requests per second (a token bucket) and streams open at once.

They run before the request is validated or looked up, so one key's flood is refused for the cost of a
few additions and never reaches the cache, the tokenizer or admission (which shares the engine
between everyone's requests: per-model slots and time budgets). A refusal is RESOURCE_EXHAUSTED with
the time after which a retry can succeed.
"""

from __future__ import annotations

import math
import time

import grpc

from appliance.gateway.errors import RequestError
from appliance.security.api_keys import RateLimits

# A stream slot frees when some stream ends: no better estimate than "soon".
STREAM_RETRY_MS = 100
# The longest retry hint: a rate a keys file may hold (any above 0) can put the next token
# further away than a float holds.
MAX_RETRY_MS = 86_400_000


class _Bucket:
    __slots__ = ("last", "streams", "tokens")

    def __init__(self, burst: float) -> None:
        self.tokens = burst
        self.last = time.monotonic()
        self.streams = 0


def _burst(limits: RateLimits, rate: float) -> float:
    """Requests a key may make at once above its rate (its own burst, else one second's)."""
    return float(limits.burst or max(1.0, rate))


def _refilled(bucket: _Bucket, rate: float, burst: float, now: float) -> float:
    """The bucket's tokens at `now` (time.monotonic())."""
    return min(burst, bucket.tokens + (now - bucket.last) * rate)


class RateLimiter:
    """The buckets and stream counts of every key, keyed by key id (the event loop's only)."""

    def __init__(self) -> None:
        self._buckets: dict[str, _Bucket] = {}

    def take(self, key_id: str, limits: RateLimits) -> None:
        """One request of `key_id`; RequestError(RESOURCE_EXHAUSTED) when over its rate."""
        rate = limits.rate_per_s
        if rate is None:
            return
        burst = _burst(limits, rate)
        bucket = self._buckets.get(key_id)
        if bucket is None:
            bucket = self._buckets[key_id] = _Bucket(burst)
        now = time.monotonic()
        bucket.tokens = _refilled(bucket, rate, burst, now)
        bucket.last = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return
        wait_ms = math.ceil(min((1.0 - bucket.tokens) / rate * 1000, MAX_RETRY_MS))
        raise RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"key '{key_id}' is over its rate limit of {rate:g} requests/s (burst {burst:g}); "
            f"retry in {wait_ms} ms",
            retry_after_ms=wait_ms,
        )

    def has_room(self, key_id: str, limits: RateLimits) -> bool:
        """Whether `take` and `open_stream` would pass now; nothing is taken or counted."""
        bucket = self._buckets.get(key_id)
        if bucket is None:
            return True
        rate = limits.rate_per_s
        if rate is not None and _refilled(bucket, rate, _burst(limits, rate), time.monotonic()) < 1:
            return False
        return limits.max_streams is None or bucket.streams < limits.max_streams

    def open_stream(self, key_id: str, limits: RateLimits) -> bool:
        """Counts a stream of `key_id`; RequestError when it has its limit open. True when counted
        (then `close_stream` must follow)."""
        if limits.max_streams is None:
            return False
        bucket = self._buckets.get(key_id)
        if bucket is None:
            bucket = self._buckets[key_id] = _Bucket(float(limits.burst or 1))
        if bucket.streams >= limits.max_streams:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"key '{key_id}' has {bucket.streams} requests in flight, its limit; retry "
                "when one ends",
                retry_after_ms=STREAM_RETRY_MS,
            )
        bucket.streams += 1
        return True

    def close_stream(self, key_id: str) -> None:
        bucket = self._buckets.get(key_id)
        if bucket is not None and bucket.streams > 0:
            bucket.streams -= 1
