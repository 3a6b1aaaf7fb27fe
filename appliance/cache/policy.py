"""The cache-policy rules of a request, in one place.

DEFAULT reads and writes; REFRESH skips the read and overwrites; BYPASS neither reads nor writes;
ONLY reads and answers NOT_FOUND on a miss, never reaching the engine (UNAVAILABLE instead when a
tier could not be asked, e.g. Redis behind an open breaker: the answer may be there). A request whose answer is not
deterministic (sampled without a seed), or a gateway without a cache, can only bypass, and asking it
for ONLY is a failed precondition.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CachePolicy(enum.IntEnum):
    DEFAULT = 0
    BYPASS = 1
    REFRESH = 2
    ONLY = 3


@dataclass(frozen=True, slots=True)
class CachePlan:
    read: bool
    write: bool
    # A miss ends the request (NOT_FOUND, or UNAVAILABLE when a tier was not asked) instead of
    # generating.
    only: bool


_PLANS = {
    CachePolicy.DEFAULT: CachePlan(read=True, write=True, only=False),
    CachePolicy.REFRESH: CachePlan(read=False, write=True, only=False),
    CachePolicy.BYPASS: CachePlan(read=False, write=False, only=False),
    CachePolicy.ONLY: CachePlan(read=True, write=False, only=True),
}
_UNCACHEABLE = _PLANS[CachePolicy.BYPASS]


class OnlyNotPossible(Exception):
    """ONLY was asked of a request that cannot be answered from the cache."""


def plan(policy: CachePolicy, cacheable: bool) -> CachePlan:
    if cacheable:
        return _PLANS[policy]
    if policy == CachePolicy.ONLY:
        raise OnlyNotPossible(
            "cache_policy ONLY needs a cacheable request: temperature 0 or a seed, and a "
            "gateway with the cache enabled"
        )
    return _UNCACHEABLE
