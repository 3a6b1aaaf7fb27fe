"""Backends and cache tiers of one's own, as a third party writes them and the configuration names
them (`package.module:Class`). Each backend answers a request with its prompt's token ids, back to
back, up to max_tokens."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, ClassVar

import grpc

from appliance.backends.base import Backend, BackendError, GenerationRequest, Tokens
from appliance.cache.entry import CachedAnswer
from appliance.cache.tiers import CacheQuery, CacheTier

if TYPE_CHECKING:
    from appliance.config import ModelConfig


class _Echo:
    """The members a plugin author thinks essential: where it is, how many it runs at once, whether
    it is ready, the stream, and ending generations."""

    max_batch_size = 4

    def __init__(self, address: str) -> None:
        self._address = address
        self._cancelled = False
        self.streams = 0

    @property
    def address(self) -> str:
        return self._address

    async def wait_ready(self, timeout_s: float) -> None:
        return None

    async def readiness(self, timeout_s: float) -> tuple[bool, str]:
        return True, ""

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Tokens, None]:
        self.streams += 1
        for token_id in list(request.prompt_ids)[: request.max_tokens]:
            if self._cancelled:
                raise BackendError(grpc.StatusCode.CANCELLED, "the gateway is draining")
            yield Tokens([token_id])

    def cancel_all(self) -> None:
        self._cancelled = True

    async def close(self) -> None:
        return None


class EchoBackend(_Echo):
    """Not a subclass of Backend: it lacks the members the gateway reads with a default there."""

    @classmethod
    def from_config(cls, config: ModelConfig) -> EchoBackend:
        return cls(config.backend)


class EchoSubclass(_Echo, Backend):
    """A subclass of Backend defining only what has no default there."""

    @classmethod
    def from_config(cls, config: ModelConfig) -> EchoSubclass:
        return cls(config.backend)


class StreamOnly(Backend):
    """A subclass of Backend that defines the stream and nothing else it needs."""

    @classmethod
    def from_config(cls, config: ModelConfig) -> StreamOnly:
        return cls()

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Tokens, None]:
        yield Tokens([1])


class MemoTier(CacheTier):
    """A tier defining what CacheTier has no default for (its name and lookup), and store."""

    name = "memo"

    def __init__(self) -> None:
        self.answers: dict[bytes, CachedAnswer] = {}

    async def lookup(self, query: CacheQuery) -> CachedAnswer | None:
        return self.answers.get(query.key)

    def store(self, query: CacheQuery, answer: CachedAnswer) -> None:
        self.answers[query.key] = answer


class LookupOnly:
    """A tier with a name and a lookup that is not a subclass of CacheTier."""

    name = "lookup_only"

    async def lookup(self, query: CacheQuery) -> CachedAnswer | None:
        return None


class Unnamed(CacheTier):
    """A subclass of CacheTier without a lookup."""

    name = "unnamed"


class FailsAfterOne(_Echo, Backend):
    """Streams its prompt's first token id, then fails as an engine does that broke while
    generating, with the status FAILURES names for the request's max_tokens."""

    FAILURES: ClassVar[dict[int, grpc.StatusCode]] = {
        2: grpc.StatusCode.INTERNAL,
        3: grpc.StatusCode.UNKNOWN,
        4: grpc.StatusCode.DATA_LOSS,
        5: grpc.StatusCode.INVALID_ARGUMENT,
    }

    @classmethod
    def from_config(cls, config: ModelConfig) -> FailsAfterOne:
        return cls(config.backend)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Tokens, None]:
        self.streams += 1
        yield Tokens(list(request.prompt_ids)[:1])
        code = self.FAILURES[request.max_tokens]
        raise BackendError(code, "inference server: Executor failed process requestId 3")
