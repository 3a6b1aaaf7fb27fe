"""Backends and cache tiers of one's own, as a third party writes them and the configuration names
them (`package.module:Class`). Each backend answers a request with its prompt's token ids, back to
back, up to max_tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import grpc

from appliance.backends.base import (
    NO_ENGINE_LIMITS,
    NO_SPECULATION,
    Backend,
    BackendError,
    EngineLimits,
    GenerationRequest,
    Speculation,
    Tokens,
)
from appliance.cache.entry import CachedAnswer
from appliance.cache.tiers import CacheQuery, CacheTier

if TYPE_CHECKING:
    from pathlib import Path

    from appliance.config import ModelConfig
    from appliance.gateway.server import RunningGateway


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


class InstanceAttributes(_Echo):
    """Not a subclass of Backend, with every member: the ones the gateway reads as values are
    set in __init__, as a backend written like the built-in TritonBackend before it subclassed
    Backend sets them."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.speculation = NO_SPECULATION
        self.max_top_logprobs = 0
        self.guided = False
        self.unserved: dict[str, str] = {}
        self.engine_limits = NO_ENGINE_LIMITS

    @classmethod
    def from_config(cls, config: ModelConfig) -> InstanceAttributes:
        return cls(config.backend)


@dataclass
class DataclassBackend:
    """Not a subclass of Backend: a dataclass whose fields are the members read as values."""

    address: str
    max_batch_size: int
    speculation: Speculation
    max_top_logprobs: int
    guided: bool
    unserved: dict[str, str]
    engine_limits: EngineLimits

    @classmethod
    def from_config(cls, config: ModelConfig) -> DataclassBackend:
        return cls(config.backend, 4, NO_SPECULATION, 0, False, {}, NO_ENGINE_LIMITS)

    async def wait_ready(self, timeout_s: float) -> None:
        return None

    async def readiness(self, timeout_s: float) -> tuple[bool, str]:
        return True, ""

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Tokens, None]:
        for token_id in list(request.prompt_ids)[: request.max_tokens]:
            yield Tokens([token_id])

    def cancel_all(self) -> None:
        return None

    async def close(self) -> None:
        return None


class SetsGuided(EchoSubclass):
    """A subclass of Backend that sets on its instances a member Backend defines as a read-only
    property: Python refuses the assignment when the class is made."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.guided = True  # type: ignore[misc]


@dataclass
class GuidedField(_Echo, Backend):
    """A dataclass subclass of Backend whose field without a default is a member Backend defines
    as a read-only property: its __init__ sets it, and Python refuses that."""

    guided: bool

    @classmethod
    def from_config(cls, config: ModelConfig) -> GuidedField:
        return cls(True)


@asynccontextmanager
async def plugin_gateway(
    tokenizer_dir: Path, kind: str, **config: Any
) -> AsyncIterator[RunningGateway]:
    """A gateway whose model "tiny" is served by the class `kind` of this module (`config`: more
    gateway_config arguments); drained on leaving."""
    from appliance.gateway.models import load_models
    from appliance.gateway.server import start_server
    from tests.support import gateway_config

    spec = f"{__name__}:{kind}"
    settings = gateway_config(tokenizer_dir, "engine.invalid:1", backend_kind=spec, **config)
    models = await load_models(settings)
    gateway = await start_server(settings, models)
    try:
        yield gateway
    finally:
        await gateway.drain(0.5)


class FailsToStart(EchoSubclass):
    """A subclass whose from_config fails, as one whose device or file is missing does."""

    @classmethod
    def from_config(cls, config: ModelConfig) -> FailsToStart:
        raise RuntimeError("no device /dev/accel0\n(more detail on a second line)")


class ResetsMidStream(_Echo, Backend):
    """Streams its prompt's first token id, then fails as the Triton client does when the engine
    restarts under a stream (the connection reset): UNAVAILABLE."""

    @classmethod
    def from_config(cls, config: ModelConfig) -> ResetsMidStream:
        return cls(config.backend)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Tokens, None]:
        self.streams += 1
        yield Tokens(list(request.prompt_ids)[:1])
        raise BackendError(
            grpc.StatusCode.UNAVAILABLE,
            f"inference server at {self.address} closed the stream before the end",
        )


class Stalls(_Echo, Backend):
    """Accepts every stream and then sends nothing more, forever: no token at all for a request
    with max_tokens 2, its prompt's first token id for any other. Counts the streams ended under
    it (the gateway's cancellation of the engine request)."""

    max_batch_size = 1

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.ended = 0

    @classmethod
    def from_config(cls, config: ModelConfig) -> Stalls:
        return cls(config.backend)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Tokens, None]:
        self.streams += 1
        try:
            if request.max_tokens != 2:
                yield Tokens(list(request.prompt_ids)[:1])
            await asyncio.Event().wait()
        finally:
            self.ended += 1


class Breaks(_Echo, Backend):
    """Streams its prompt's first token id, then fails with an exception that is no BackendError
    (a bug of its own, against the Backend contract), or fails so before any token for a request
    with max_tokens 2."""

    @classmethod
    def from_config(cls, config: ModelConfig) -> Breaks:
        return cls(config.backend)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Tokens, None]:
        self.streams += 1
        if request.max_tokens != 2:
            yield Tokens(list(request.prompt_ids)[:1])
        raise RuntimeError("a bug of the backend's own")


class Overruns(_Echo, Backend):
    """Sends its prompt's first token id three at a time and never ends, whatever max_tokens
    says (an engine that ignores request_output_len). Counts the streams ended under it."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.ended = 0

    @classmethod
    def from_config(cls, config: ModelConfig) -> Overruns:
        return cls(config.backend)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Tokens, None]:
        self.streams += 1
        try:
            while True:
                yield Tokens(list(request.prompt_ids)[:1] * 3)
                await asyncio.sleep(0)
        finally:
            self.ended += 1


class ReadinessBreaks(EchoSubclass):
    """Ready at start-up; every readiness check after that raises (a bug of its own, against the
    Backend contract, which says a readiness check never raises)."""

    @classmethod
    def from_config(cls, config: ModelConfig) -> ReadinessBreaks:
        return cls(config.backend)

    async def readiness(self, timeout_s: float) -> tuple[bool, str]:
        raise RuntimeError("a bug of the backend's own")


class OverrunsToItsEnd(_Echo, Backend):
    """Sends its prompt's first token id three times and then the end id in one response,
    whatever max_tokens says: the end comes after more tokens than the request asked for."""

    @classmethod
    def from_config(cls, config: ModelConfig) -> OverrunsToItsEnd:
        return cls(config.backend)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Tokens, None]:
        self.streams += 1
        assert request.end_id is not None
        yield Tokens([*list(request.prompt_ids)[:1] * 3, request.end_id])
