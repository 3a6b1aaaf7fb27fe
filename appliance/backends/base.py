"""What the gateway needs from an inference backend, whatever serves the model.

The pipeline talks to this protocol only: a Triton-protocol server (TritonBackend), a fallback model or
another engine plug in without touching it. A backend streams token ids for a GenerationRequest; text,
stop strings and caching stay in the gateway.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol, cast

import grpc

from appliance.plugins import PluginError, check_members, load_class
from engine_build.guides import GUIDE_TYPES as GUIDE_TYPES

if TYPE_CHECKING:
    from appliance.config import ModelConfig

# The backend kinds a model's `backend_kind` names without an import path.
BACKEND_KINDS = {"triton": "appliance.backends.triton:TritonBackend"}


# BackendError.reason of a prompt the engine refused as too long (OpenAI's error code for it).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class BackendError(Exception):
    """A failure talking to the inference server; carries the status the gateway's client gets."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # What a program can branch on, in OpenAI's words (RequestError.reason), where the
        # engine's words say it: e.g. "context_length_exceeded" for a prompt it refused as too long.
        self.reason = reason
        # The request's field the engine refused (RequestError.field), where its words say it:
        # "guide" for a guide its compiler refused.
        self.field = field


@dataclass(frozen=True)
class Sampling:
    """TensorRT-LLM's sampling inputs: greedy is top_k=1 (temperature 0 maps to it)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int | None


GREEDY = Sampling(temperature=1.0, top_k=1, top_p=1.0, seed=None)


@dataclass(frozen=True)
class Guide:
    """Grammar-constrained decoding: the engine masks tokens the grammar cannot take next.
    `kind` is one of GUIDE_TYPES; `text` the schema, expression or grammar ("" for "json")."""

    kind: str
    text: str


@dataclass(frozen=True)
class Speculation:
    """What a model does with speculative decoding: whether it drafts (`drafts`), and whether a
    request can turn drafting off (`switchable`). Read from the model's configuration."""

    drafts: bool = False
    switchable: bool = False

    def refusal(self, model: str, asked: bool | None) -> str | None:
        """Why a request's `speculation` (None: the model's default) cannot be served by `model`;
        None when it can."""
        if asked is None or asked == self.drafts or self.switchable:
            return None
        if asked:
            return (
                f"model '{model}' has no speculative decoding (no drafter): send the request "
                "without speculation, or with speculation false"
            )
        return (
            f"model '{model}' speculates on every request and cannot turn it off per request: "
            "send the request without speculation false"
        )


NO_SPECULATION = Speculation()


@dataclass(frozen=True)
class EngineLimits:
    """The engine's own bounds on one request, as its configuration declares them (TensorRT-LLM's
    `max_input_len` and `max_seq_len` parameters); None: not declared, and the model's context
    (config.json) bounds a request alone."""

    # Most prompt tokens the engine takes; a longer prompt is refused by it.
    max_input_len: int | None = None
    # Most prompt + completion tokens; the engine ends an answer that reaches it.
    max_seq_len: int | None = None


NO_ENGINE_LIMITS = EngineLimits()
# Backend.unserved of a backend that serves every field (the default).
NO_UNSERVED: Mapping[str, str] = MappingProxyType({})


def top_logprobs_refusal(model: str, limit: int, asked: int) -> str | None:
    """Why `asked` alternatives per token cannot be served by `model`, which returns at most
    `limit` (Backend.max_top_logprobs); None when they can."""
    if asked <= limit:
        return None
    if limit == 0:
        return (
            f"model '{model}' returns no alternatives per token: its inference server gives the "
            "chosen token's log-probability alone; ask for none (top_logprobs 0, or logprobs 0 "
            "on /v1/completions)"
        )
    return f"model '{model}' returns at most {limit} alternatives per token, not {asked}"


class InputFields(Protocol):
    """The request fields a model serves only when its engine takes an input for them (a checked
    request and a GenerationRequest both have them)."""

    @property
    def sampling(self) -> Sampling: ...

    @property
    def min_tokens(self) -> int: ...

    @property
    def logprobs(self) -> bool: ...

    @property
    def ignore_eos(self) -> bool: ...


def unserved_refusal(
    model: str, unserved: Mapping[str, str], request: InputFields
) -> tuple[str, str] | None:
    """The first field `request` sets that `model` takes no input for, and why it is refused
    (`unserved`: Backend.unserved); None when the model serves every field it sets."""
    if not unserved:
        return None
    asked = {
        "seed": request.sampling.seed is not None,
        "min_tokens": request.min_tokens > 0,
        "logprobs": request.logprobs,
        "ignore_eos": request.ignore_eos,
    }
    for field, lacks in unserved.items():
        if asked[field]:
            return field, f"model '{model}' {lacks}: send the request without {field}"
    return None


@dataclass(frozen=True)
class GenerationRequest:
    """One generation as a backend sees it: token ids in, token ids out.

    `request_id` is the gateway's own id for the engine (unique per gateway process), never a
    client's: a client's id is not unique across clients, and cancelling by id must not reach
    another client's generation. `timeout_s` None means the caller bounds the call itself.
    """

    request_id: str
    prompt_ids: Sequence[int]
    max_tokens: int
    end_id: int | None
    pad_id: int | None
    sampling: Sampling
    timeout_s: float | None
    guide: Guide | None = None
    # The end id (end_id) and stop strings cannot end the generation before this many new tokens.
    min_tokens: int = 0
    # The end id does not end the generation (TensorRT-LLM's end_id -1).
    ignore_eos: bool = False
    # Each new token's log-probability comes back in Tokens.logprobs.
    logprobs: bool = False
    # False: decode without drafts; True: with them; None: the model's default.
    speculation: bool | None = None
    # The most likely alternatives per new token returned in Tokens.top (0: none; at most the
    # backend's max_top_logprobs).
    top_logprobs: int = 0


# One alternative of a generated token: its id and log-probability.
Alternative = tuple[int, float]


class Tokens(list[int]):
    """The new token ids of one engine response; `logprobs` holds one log-probability per id when
    the request asked for them (GenerationRequest.logprobs), else None. `draft_tokens` and
    `accepted_draft_tokens`: the generation's speculative draft tokens so far, proposed and
    accepted, when the model reports them (else None). A response may carry counts and no ids.
    `top`: for each id, the request's top_logprobs most likely alternatives, most likely first,
    when it asked for them (else None). `cached_tokens`: the prompt tokens the engine took from
    its prefix cache instead of computing them, when the model reports them (else None; a
    backend may report them on one response only)."""

    logprobs: list[float] | None = None
    top: list[list[Alternative]] | None = None
    draft_tokens: int | None = None
    accepted_draft_tokens: int | None = None
    cached_tokens: int | None = None


class Backend(Protocol):
    """One served model on one inference server.

    A backend of one's own (`backend_kind = "package.module:Class"`) subclasses this class: it
    defines the abstract members (no default fits every engine), and inherits the others, whose
    defaults say "not known yet" or "not served". `backend_kind` refuses a class that lacks one.
    """

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where the backend is, for messages an operator reads."""

    @property
    @abc.abstractmethod
    def max_batch_size(self) -> int:
        """Generations the backend runs at once at full speed (the model's admission slots, unless
        its max_in_flight says)."""

    @property
    def speculation(self) -> Speculation:
        """What the model does with speculative decoding (NO_SPECULATION until it is known, and
        by default: a request asking for drafts is refused)."""
        return NO_SPECULATION

    @property
    def max_top_logprobs(self) -> int:
        """Most alternatives per generated token the model returns with log-probabilities (0: it
        returns none, or that is not known yet; the default)."""
        return 0

    @property
    def guided(self) -> bool:
        """Whether the model decodes under a guide (False: it has no guided decoding, or that is
        not known yet; the default)."""
        return False

    @property
    def unserved(self) -> Mapping[str, str]:
        """The request fields the model takes no input for (`seed`, `min_tokens`, `logprobs`,
        `ignore_eos`), each with what its engine lacks, as unserved_refusal words it (empty
        until that is known, and by default: the backend serves them all)."""
        return NO_UNSERVED

    @property
    def engine_limits(self) -> EngineLimits:
        """The engine's bounds on prompt and prompt + completion tokens, where it declares them
        (NO_ENGINE_LIMITS until they are known, and by default: the model's context bounds a
        request alone)."""
        return NO_ENGINE_LIMITS

    @abc.abstractmethod
    async def wait_ready(self, timeout_s: float) -> None:
        """Returns once the backend can take requests; BackendError (UNAVAILABLE) after timeout_s."""

    @abc.abstractmethod
    async def readiness(self, timeout_s: float) -> tuple[bool, str]:
        """One readiness check, answered or not within `timeout_s` in all: (ready, why not).
        Never raises."""

    @abc.abstractmethod
    def stream(self, request: GenerationRequest) -> AsyncGenerator[Tokens, None]:
        """The new token ids of each step until the generation ends.

        Raises BackendError with the status the client should get. Closing the iterator early
        (the caller stopped reading, was cancelled, or hit a stop string) cancels the generation.
        """

    @abc.abstractmethod
    def cancel_all(self) -> None:
        """Ends every generation in flight, and every one started from now on (the drain period
        is over): they raise CANCELLED."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Releases connections; no call is made afterwards."""


class BackendKind(Protocol):
    """A backend class: makes the backend of one model from its configuration."""

    def from_config(self, config: ModelConfig) -> Backend: ...


def backend_kind(spec: str) -> BackendKind:
    """The backend class a model's `backend_kind` names (a BACKEND_KINDS name or
    `package.module:Class`), with every member of Backend (check_members: a class that is not a
    subclass of it must have them all); PluginError (a ValueError) says what to fix in one line."""
    found = load_class(spec, BACKEND_KINDS, "backend kind")
    if not callable(getattr(found, "from_config", None)):
        raise PluginError(
            f"backend kind {spec!r}: {found.__qualname__} has no from_config(model_config)"
        )
    check_members(found, Backend, spec, "backend kind", structural=True)
    return cast(BackendKind, found)
