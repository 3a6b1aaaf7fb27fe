"""The canonical cache key: everything that changes the output, and nothing else.

Key = BLAKE2b-128 over a canonical encoding of, in order:
  key-schema version, namespace (tenant), model name, engine fingerprint, tokenizer fingerprint,
  prompt-template version, the input (raw prompt, or each message's role and content in order), and
  the normalized sampling parameters (max_tokens; greedy, or temperature/top_p/top_k/seed; the stop
  strings deduplicated and sorted), and the guide (its type and text) when the request has one; an
  unguided request's key has no guide field, so it is the key it was before guides existed. A chat
  with tools adds the canonical text of its tools, choice and structured messages (a template that
  takes tools renders them, not the (role, content) messages); a chat without has no such field.
Each field is written as its UTF-8 length (4 bytes, big-endian) then its bytes, so no two different
field lists encode alike. Text is NFC-normalized by the request validation before it gets here (the
model sees the same NFC text, so equal keys always mean equal model inputs); content is otherwise used
byte for byte: case and whitespace are never folded, because they change meaning (code, poetry).
Greedy requests drop temperature, top_p, top_k and seed: none of them changes a greedy answer.
Speculative decoding leaves a greedy answer as it is, so a request's `speculation` is not part of a
greedy key. A sampled answer keeps the target's distribution but draws its random numbers in another
order with drafts, so the same seed gives another answer: a sampled request that turns speculation
off adds a `speculation=off` field (the default and "on" add nothing, so keys stay as they were).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

KEY_SCHEMA = 1
_LEN = struct.Struct(">I")


@dataclass(frozen=True)
class ModelIdentity:
    """What identifies the model's behaviour: a rebuilt engine or new tokenizer gets new keys."""

    name: str
    engine_fingerprint: str
    tokenizer_fingerprint: str
    template_version: str


@dataclass(frozen=True)
class SamplingKey:
    max_tokens: int
    greedy: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stops: tuple[str, ...]
    # The grammar the answer was decoded under: (type, text), or None for free text.
    guide: tuple[str, str] | None = None
    # Completion tokens before the end token or a stop string may end the answer.
    min_tokens: int = 0
    # The end token does not end the answer.
    ignore_eos: bool = False
    # A sampled request decoded without speculative drafts (only ever set when not greedy).
    speculation_off: bool = False
    # A chat with tools: the canonical text of its tools and structured messages.
    tools: str | None = None
    # The client set no max_tokens: `max_tokens` is the default, lowered to what this many tokens
    # of context leave after the prompt; 0: the client's own max_tokens.
    default_within: int = 0


def _field(value: str) -> bytes:
    data = value.encode()
    return _LEN.pack(len(data)) + data


_SCHEMA_FIELD = _field(str(KEY_SCHEMA))
_PROMPT_FIELD = _field("prompt")


def _model_fields(model: ModelIdentity) -> bytes:
    """The model's four fields."""
    return b"".join(
        _field(value)
        for value in (
            model.name,
            model.engine_fingerprint,
            model.tokenizer_fingerprint,
            model.template_version,
        )
    )


@functools.lru_cache(maxsize=256)
def _head(namespace: str, model: ModelIdentity) -> hashlib.blake2b:
    """The hash state after the fields that every key of this namespace and model starts with
    (schema, namespace, model): a key starts from a copy, so they are hashed once, not per key.
    Never updated itself."""
    return hashlib.blake2b(_SCHEMA_FIELD + _field(namespace) + _model_fields(model), digest_size=16)


def _float(value: float) -> str:
    # float32 values from the wire: 9 significant digits round-trip them exactly.
    return format(value, ".9g")


def _sampling_fields(sampling: SamplingKey) -> bytes:
    """The encoded sampling parameters and stop strings (the last fields of a key)."""
    limit = f"max={sampling.max_tokens}"
    if sampling.default_within:
        limit = f"max=default {sampling.max_tokens} within {sampling.default_within}"
    if sampling.greedy:
        return _greedy_fields(limit, sampling.stops)
    seed = "" if sampling.seed is None else str(sampling.seed)
    params = (
        f"{limit};t={_float(sampling.temperature)};"
        f"p={_float(sampling.top_p)};k={sampling.top_k};seed={seed}"
    )
    return _field(params) + _stop_fields(sampling.stops)


@functools.lru_cache(maxsize=256)
def _greedy_fields(limit: str, stops: tuple[str, ...]) -> bytes:
    """A greedy request's sampling fields: the same few for most requests, so encoded once
    (equal arguments, strings, always encode alike)."""
    return _field(f"{limit};greedy") + _stop_fields(stops)


def _stop_fields(stops: tuple[str, ...]) -> bytes:
    unique = sorted(set(stops))
    return b"".join([_field(f"stops:{len(unique)}"), *map(_field, unique)])


def cache_key(
    namespace: str,
    model: ModelIdentity,
    prompt: str | None,
    messages: Sequence[tuple[str, str]],
    sampling: SamplingKey,
) -> bytes:
    digest = _head(namespace, model).copy()
    if prompt is not None:
        data = prompt.encode()
        digest.update(_PROMPT_FIELD + _LEN.pack(len(data)) + data)
    else:
        parts = [_field(f"messages:{len(messages)}")]
        for role, content in messages:
            parts.append(_field(role))
            parts.append(_field(content))
        digest.update(b"".join(parts))
    digest.update(_sampling_fields(sampling))
    if (
        sampling.min_tokens or sampling.ignore_eos
    ):  # absent at their defaults: keys stay as they were
        digest.update(
            _field(f"min_tokens={sampling.min_tokens};ignore_eos={sampling.ignore_eos:d}")
        )
    if sampling.guide is not None:
        digest.update(_field(f"guide:{sampling.guide[0]}") + _field(sampling.guide[1]))
    if sampling.speculation_off:
        digest.update(_field("speculation=off"))
    if sampling.tools is not None:
        digest.update(_field("tools") + _field(sampling.tools))
    return digest.digest()


def is_deterministic(sampling: SamplingKey) -> bool:
    """Only answers that would come out the same again may be cached."""
    return sampling.greedy or sampling.seed is not None
