"""A generation request as the gateway's core sees it, and its validation before anything is sent
to the engine.

Front ends translate their wire format (the gRPC messages, OpenAI's JSON) into an IncomingRequest of
plain values; `check` turns it into a CheckedRequest, the only request type the stages after it read,
and `tokenize` into the PreparedRequest the engine gets.

Pure logic over the request and the model's text side, so every bad input is tested without servers.
Every size is bounded here, before any expensive work: the number of messages before one is read,
text that cannot fit the model's input (more characters than its longest token spans times the input
limit) before it is normalized or tokenized. Tokenizing releases the GIL (the tokenizer's batch
entry point), so a long input on a worker thread never holds the event loop.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import math
import os
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jsonschema_rs
import numpy as np
import numpy.typing as npt

from appliance import namespace as namespaces
from appliance.backends.base import (
    GREEDY,
    NO_ENGINE_LIMITS,
    EngineLimits,
    Guide,
    Sampling,
    Speculation,
    top_logprobs_refusal,
    unserved_refusal,
)
from appliance.cache.policy import CachePolicy
from appliance.gateway.errors import CONTEXT_LENGTH_EXCEEDED, RequestError, invalid
from appliance.text.tokenizer import CHAT_ROLES, ChatTemplateError, ModelText

if TYPE_CHECKING:
    from appliance.gateway.tool_calls import ToolChat

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_REQUEST_ID_LENGTH = 128
# Messages of one chat request (OpenAI's own limit); each costs work before the count of its tokens
# is known, so the count is checked before any message is read.
MAX_MESSAGES = 2048
# A model name a cache administration call may name (served or not: a fleet's Redis holds the
# answers of every gateway's models).
MAX_MODEL_NAME_LENGTH = 256
# Bytes of a guide's schema, expression or grammar.
MAX_GUIDE_BYTES = 64 * 1024
# Python's regular-expression parser without its compiler (typeshed knows it only by its old
# name, sre_parse). A regex guide is parsed on the event loop, not compiled: compiling folds every
# character of a case-insensitive class (3,700 classes of every code point: over a minute).
REGEX_PARSER: Any = importlib.import_module("re._parser")
# Bytes of a regex guide: parsing alternatives that share a long prefix takes time growing with
# the square of the text, so a regex is kept short; longer structures are JSON Schema or EBNF
# guides (checked by jsonschema-rs, compiled by the engine).
MAX_REGEX_GUIDE_BYTES = 2048
# Levels of JSON (objects and arrays) a JSON Schema may nest: xgrammar's compile time grows with
# the cube of a schema's nesting (127 nested objects, which the metaschema check takes, compile for
# seconds); OpenAI's structured outputs take 10 levels of nested objects, 20 levels of JSON.
MAX_SCHEMA_DEPTH = 64
GUIDE_KINDS = ("json", "json_schema", "regex", "ebnf_grammar")
# Below this, logits / temperature overflows float32 for ordinary logits: 0 means greedy instead.
MIN_TEMPERATURE = 1e-2
# OpenAI's range.
MAX_TEMPERATURE = 2.0
# OpenAI's range of top_logprobs.
MAX_TOP_LOGPROBS = 20
# How much of a client's value an error message echoes.
ECHO_CHARS = 64
_invalid = invalid


def echo(value: str) -> str:
    """A client's value for an error message: quoted, escaped, at most ECHO_CHARS characters."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    return f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"


def echo_name(name: str) -> str:
    """A field name a client sent, for an error message: as it is when a plain identifier (as
    OpenAI names an unknown field), else quoted, escaped and cut (echo)."""
    return name if name.isidentifier() and len(name) <= ECHO_CHARS else echo(name)


def echo_value(value: object) -> str:
    """Any JSON value a client sent, for an error message: a string as echo shows it, a short
    integer as it is, anything else by its type."""
    if isinstance(value, str):
        return echo(value)
    if isinstance(value, int) and not isinstance(value, bool):
        digits = len(str(abs(value)))
        return str(value) if digits <= 20 else f"an integer of {digits} digits"
    return f"a value of type {type(value).__name__}"


@dataclass(frozen=True)
class Limits:
    max_input_tokens: int
    max_output_tokens: int
    default_max_tokens: int
    # Prompt + completion must fit the model's context.
    context_length: int
    # Characters of input text that cannot fit max_input_tokens whatever they are: the longest
    # token's byte length × max_input_tokens (× 2 for normalizers that drop characters).
    max_input_chars: int = 1 << 62


@dataclass(slots=True)
class IncomingRequest:
    """A request as a front end received it, in plain values and not yet checked. None: the
    client left the field out."""

    # "" when the client named none (the route stage names the known ones).
    model: str = ""
    # One of the two inputs: a prompt, or chat messages as (role, content).
    prompt: str | None = None
    messages: Sequence[tuple[str, str]] | None = None
    # The client's id ("": the check makes one).
    request_id: str = ""
    # "": the one the client's key holds, else "default".
    namespace: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    # A CachePolicy value (a number: front ends pass what the client sent).
    cache_policy: int = 0
    # The client's say on the semantic tier: True asks it, False never, None the default.
    semantic_cache: bool | None = None
    ttft_budget_ms: int | None = None
    # A grammar for the answer: its kind as the client named it, and its text.
    guide: Guide | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None
    # Speculative decoding: False off, True asked for, None the model's default.
    speculation: bool | None = None
    # A chat with tools or tool-call history, in structure, in place of `messages`: the check
    # bounds its size, then writes it as messages (tool_calls.ToolChat.fallback) and validates them.
    tool_chat: ToolChat | None = None


_POLICIES = {p.value: p for p in CachePolicy}


def too_many_messages(count: int) -> RequestError | None:
    """The refusal of a chat of `count` messages, asked before any of them is read."""
    if count > MAX_MESSAGES:
        return _invalid(f"messages holds {count} messages; at most {MAX_MESSAGES} are accepted")
    return None


def _sampling(req: IncomingRequest) -> Sampling:
    temperature = req.temperature if req.temperature is not None else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise _invalid(f"temperature must be >= 0, got {temperature}", field="temperature")
    if 0 < temperature < MIN_TEMPERATURE or temperature > MAX_TEMPERATURE:
        raise _invalid(
            f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and "
            f"{MAX_TEMPERATURE:g}, got {temperature:g}",
            field="temperature",
        )
    top_p = req.top_p if req.top_p is not None else 1.0
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise _invalid(f"top_p must be in (0, 1], got {top_p}", field="top_p")
    top_k = req.top_k if req.top_k is not None else 0
    if top_k < 0:
        raise _invalid(f"top_k must be >= 0 (0 turns it off), got {top_k}", field="top_k")
    seed = req.seed
    if temperature == 0:
        if seed is None:
            return GREEDY
        return Sampling(GREEDY.temperature, GREEDY.top_k, GREEDY.top_p, seed=seed)
    return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def _messages(messages: Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
    refusal = too_many_messages(len(messages))
    if refusal is not None:
        raise refusal
    if not messages:
        raise _invalid("messages is empty: send at least one message", field="messages")
    for i, (role, _) in enumerate(messages):
        check_role(i, role)
    if messages[-1][0] == "assistant":
        raise _invalid(
            "the last message must not be from the assistant: nothing to answer", field="messages"
        )
    return messages


def check_role(i: int, role: str, more: tuple[str, ...] = ()) -> None:
    """Refuses message `i`'s role unless it is a chat role (or one of `more`), naming it by its
    index in the request."""
    if role not in CHAT_ROLES and role not in more:
        raise _invalid(
            f"messages[{i}].role is {echo(role)}; expected one of {', '.join(CHAT_ROLES + more)}",
            field=f"messages[{i}].role",
        )


# Non-starters (combining marks) a text may hold in a row as it is normalized: UAX #15's
# Stream-Safe Text Format. CPython's normalize sorts each run of non-starters by insertion, in time
# quadratic in its length (64,000 marks in one message held the event loop for seconds); a longer
# run gets COMBINING GRAPHEME JOINER after each 30, as UAX #15's transform and Go's norm package do.
MAX_NON_STARTERS = 30
CGJ = "\u034f"
# Planes 0 and 1 hold every non-starter (test_stream_safe checks every plane).
NON_STARTER_PLANES = 0x20000
# Characters of a text normalized as it is: its longest run costs under a millisecond to sort,
# less than stream_safe's own fixed cost.
SHORT_TEXT = 1024


@functools.cache
def non_starters() -> npt.NDArray[np.bool_]:
    """Whether each code point below NON_STARTER_PLANES is a non-starter: of nonzero canonical
    combining class, or canonically decomposed into one first (U+0F73). Built on first use."""
    chars = list(map(chr, range(NON_STARTER_PLANES)))
    table = np.array(list(map(unicodedata.combining, chars)), dtype=np.bool_)
    for c, decomposition in zip(chars, map(unicodedata.decomposition, chars), strict=True):
        if decomposition and not decomposition.startswith("<"):
            first = unicodedata.normalize("NFD", c)[0]
            table[ord(c)] |= bool(unicodedata.combining(first))
    return table


def stream_safe(text: str) -> str:
    """`text` with CGJ after each MAX_NON_STARTERS non-starters of a longer run (vectorized: a
    scan in Python would cost more than the normalization)."""
    table = non_starters()
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    flags = table[np.minimum(codes, NON_STARTER_PLANES - 1)].astype(np.int8)
    edges = np.diff(flags, prepend=np.int8(0), append=np.int8(0))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    long = (ends - starts) > MAX_NON_STARTERS
    if not long.any():
        return text
    pieces, done = [], 0
    for start, end in zip(starts[long].tolist(), ends[long].tolist(), strict=True):
        for cut in range(start + MAX_NON_STARTERS, end, MAX_NON_STARTERS):
            pieces.append(text[done:cut])
            done = cut
    pieces.append(text[done:])
    return CGJ.join(pieces)


def nfc(text: str) -> str:
    """Canonical composition: the model and the cache key see the same text for equivalent input
    (checked in linear time; normalized in linear time, runs of non-starters bounded)."""
    if unicodedata.is_normalized("NFC", text):
        return text
    return unicodedata.normalize("NFC", text if len(text) <= SHORT_TEXT else stream_safe(text))


# Not frozen: a frozen dataclass's __init__ costs microseconds per request, and nothing changes or
# hashes a checked request.
@dataclass(slots=True)
class CheckedRequest:
    """A request whose fields are all valid, before tokenization (what a cache lookup needs)."""

    request_id: str
    namespace: str
    prompt: str | None
    messages: tuple[tuple[str, str], ...]
    max_tokens: int
    sampling: Sampling
    stops: tuple[str, ...]
    cache_policy: CachePolicy
    # The client's say on the semantic tier: True asks it, False never, None the default.
    semantic_cache: bool | None = None
    # Milliseconds to the first token the client gives (None: the model's default).
    ttft_budget_ms: int | None = None
    guide: Guide | None = None
    # Completion tokens before the end token or a stop string may end the answer.
    min_tokens: int = 0
    # The end token does not end the answer.
    ignore_eos: bool = False
    # Each completion token's log-probability is returned.
    logprobs: bool = False
    # Speculative decoding: False off, True asked for, None the model's default.
    speculation: bool | None = None
    # Alternatives per token returned with the log-probabilities (0: none).
    top_logprobs: int = 0
    # A chat with tools: the tokenize stage renders it (`messages` is its fallback rendering).
    tool_chat: ToolChat | None = None
    # The client set no max_tokens: `max_tokens` is the model's default, which the tokenize stage
    # lowers to what the context leaves after the prompt.
    default_max_tokens: bool = False

    @property
    def input_field(self) -> str:
        """The request field its input text is: "prompt" or "messages"."""
        return "prompt" if self.prompt is not None else "messages"


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stops: tuple[str, ...]
    guide: Guide | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: bool = False
    speculation: bool | None = None
    top_logprobs: int = 0


# Request ids the gateway makes: 16 hex digits drawn once per process, then the process's count in
# 16 more; unique without drawing random bytes per request (it is on a cache hit's path). An id
# names a request in logs and replies; it is no secret and grants nothing.
_ID_PREFIX = os.urandom(8).hex()
_ids = itertools.count()


def new_request_id() -> str:
    """32 hex digits no other request of any gateway process has."""
    return f"{_ID_PREFIX}{next(_ids):016x}"


def valid_request_id(request_id: str) -> bool:
    """1 to MAX_REQUEST_ID_LENGTH visible ASCII characters: it travels in headers (X-Request-Id,
    gRPC metadata) and log lines, where a control character, a space or non-ASCII text cannot."""
    return (
        0 < len(request_id) <= MAX_REQUEST_ID_LENGTH
        and request_id.isascii()
        and request_id.isprintable()
        and " " not in request_id
    )


def check(req: IncomingRequest, limits: Limits, namespace: str | None = None) -> CheckedRequest:
    """Checks every field and normalizes the text (NFC); raises RequestError. No tokenization.
    `namespace`: the one the client's credentials let it use, when they decided it."""
    request_id = req.request_id
    if not request_id:
        request_id = new_request_id()
    elif not valid_request_id(request_id):
        raise _invalid(
            f"request_id must be 1 to {MAX_REQUEST_ID_LENGTH} visible ASCII characters (letters, "
            "digits, punctuation; no spaces or control characters)",
            field="request_id",
        )
    namespace = namespace or req.namespace or "default"
    if (problem := namespaces.problem(namespace)) is not None:
        raise _invalid(f"namespace {problem}", field="namespace")
    cache_policy = _POLICIES.get(req.cache_policy)
    if cache_policy is None:
        names = ", ".join(f"{p.value} ({p.name})" for p in CachePolicy)
        raise _invalid(
            f"cache_policy {req.cache_policy} is not one of {names}", field="cache_policy"
        )

    if req.max_tokens is not None:
        max_tokens = req.max_tokens
        if max_tokens <= 0:
            raise _invalid(f"max_tokens must be >= 1, got {max_tokens}", field="max_tokens")
        if max_tokens > limits.max_output_tokens:
            raise _invalid(
                f"max_tokens {max_tokens} exceeds this model's limit of {limits.max_output_tokens}",
                field="max_tokens",
            )
    else:
        max_tokens = limits.default_max_tokens
    sampling = _sampling(req)

    raw_stops = req.stop
    if len(raw_stops) > MAX_STOP_STRINGS:
        raise _invalid(
            f"at most {MAX_STOP_STRINGS} stop strings, got {len(raw_stops)}", field="stop"
        )
    stops = tuple([nfc(s) for s in raw_stops]) if raw_stops else ()
    for s in stops:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise _invalid(
                f"stop strings must be 1 to {MAX_STOP_LENGTH} characters long", field="stop"
            )

    guide = _guide(req.guide) if req.guide is not None else None
    min_tokens = _min_tokens(req, max_tokens)
    logprobs, top_logprobs = _logprobs(req)
    ttft_budget_ms = req.ttft_budget_ms
    if ttft_budget_ms is not None and ttft_budget_ms <= 0:
        raise _invalid("ttft_budget_ms must be >= 1 when set", field="ttft_budget_ms")

    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] = ()
    tool_chat = None
    listed = req.messages
    if req.tool_chat is not None:
        # Writing it parses every past call's arguments: its size as sent is bounded first.
        _fits(req.tool_chat.chars(), limits, "messages")
        listed = req.tool_chat.fallback()
    if listed is not None:
        raw = _messages(listed)
        _fits(sum(len(c) for _, c in raw), limits, "messages")
        messages = tuple([(r, nfc(c)) for r, c in raw])
        if req.tool_chat is not None:
            tool_chat = req.tool_chat.with_text(nfc)
    elif req.prompt:
        _fits(len(req.prompt), limits, "prompt")
        prompt = nfc(req.prompt)
    else:
        raise _invalid("prompt is empty: send some text or chat messages", field="prompt")
    # Positional, in the fields' order: keywords cost a microsecond on a cache hit's path.
    return CheckedRequest(
        request_id,
        namespace,
        prompt,
        messages,
        max_tokens,
        sampling,
        stops,
        cache_policy,
        req.semantic_cache,
        ttft_budget_ms,
        guide,
        min_tokens,
        req.ignore_eos,
        logprobs,
        req.speculation,
        top_logprobs,
        tool_chat,
        req.max_tokens is None,
    )


def check_speculation(checked: CheckedRequest, model: str, speculation: Speculation) -> None:
    """Refuses a `speculation` the model cannot serve: drafts asked of a model without a drafter,
    or none asked of a model that drafts on every request with no per-request switch. Asked
    before the cache, so whether a request is refused never depends on what is cached."""
    refusal = speculation.refusal(model, checked.speculation)
    if refusal is not None:
        raise _invalid(refusal, field="speculation")


def check_guide(checked: CheckedRequest, model: str, guided: bool) -> None:
    """Refuses a guide for a model without guided decoding (`guided`: its backend's). Asked
    before the cache, so whether a request is refused never depends on what is cached."""
    if checked.guide is not None and not guided:
        raise _invalid(
            f"model '{model}' has no guided decoding (its inference server's configuration sets "
            "up none): send the request without response_format, a forcing tool_choice or a guide",
            field="guide",
        )


def check_inputs(checked: CheckedRequest, model: str, unserved: Mapping[str, str]) -> None:
    """Refuses a field the model's engine takes no input for (`unserved`: its backend's): a seed,
    min_tokens, logprobs, ignore_eos. Asked before the cache, so whether a request is refused
    never depends on what is cached."""
    refused = unserved_refusal(model, unserved, checked)
    if refused is not None:
        field, message = refused
        raise _invalid(message, field=field)


def _min_tokens(req: IncomingRequest, max_tokens: int) -> int:
    min_tokens = req.min_tokens
    if min_tokens is None:
        return 0
    if not 0 <= min_tokens <= max_tokens:
        raise _invalid(
            f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {min_tokens}",
            field="min_tokens",
        )
    return min_tokens


def check_top_logprobs(checked: CheckedRequest, model: str, limit: int) -> None:
    """Refuses more alternatives per token than the model returns (`limit`, its backend's
    max_top_logprobs: none from TensorRT-LLM's `tensorrt_llm` model). Asked before the cache, as
    an answer with log-probabilities is never cached anyway."""
    refusal = top_logprobs_refusal(model, limit, checked.top_logprobs)
    if refusal is not None:
        raise _invalid(refusal, field="top_logprobs")


def _logprobs(req: IncomingRequest) -> tuple[bool, int]:
    """Whether log-probabilities are returned, and how many alternatives per token (OpenAI's
    range; whether the model returns that many is `check_top_logprobs`'s question)."""
    top = req.top_logprobs
    if top is None:
        return req.logprobs, 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _invalid(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}",
            field="top_logprobs",
        )
    if top and not req.logprobs:
        raise _invalid("top_logprobs needs logprobs: set logprobs to true", field="top_logprobs")
    return req.logprobs, top


def _guide(asked: Guide) -> Guide:
    """The request's grammar, checked as far as the gateway can without the engine's tokenizer: a
    JSON Schema must be a valid schema, a regular expression must compile. An EBNF grammar is
    compiled by the engine, which refuses one that does not parse before generating anything."""
    kind = asked.kind
    if kind not in GUIDE_KINDS:
        names = ", ".join(GUIDE_KINDS)
        raise _invalid(f"guide.type {echo(kind)} is not one of {names}", field="guide")
    text = asked.text
    if len(text) > MAX_GUIDE_BYTES or len(text.encode()) > MAX_GUIDE_BYTES:
        raise _invalid(f"guide.guide is longer than {MAX_GUIDE_BYTES} bytes", field="guide")
    if kind == "json":
        if text:
            raise _invalid(
                "guide.guide must be empty for the json type (any JSON value)", field="guide"
            )
        return Guide(kind, "")
    if not text:
        raise _invalid(f"guide.guide is empty: the {kind} guide needs its text", field="guide")
    if kind == "json_schema":
        check_json_schema(text)
    elif kind == "regex":
        if len(text.encode()) > MAX_REGEX_GUIDE_BYTES:
            raise _invalid(
                f"a regex guide is at most {MAX_REGEX_GUIDE_BYTES} bytes (a longer structure: "
                "a json_schema or ebnf_grammar guide)",
                field="guide",
            )
        try:
            REGEX_PARSER.parse(text)
        except (re.error, RecursionError, OverflowError) as exc:
            raise _invalid(
                f"guide.guide is not a valid regular expression: {exc}", field="guide"
            ) from None
    return Guide(kind, text)


def check_json_schema(text: str) -> None:
    """RequestError unless `text` is a JSON Schema object its draft's metaschema accepts (the
    one its "$schema" names among drafts 4, 6, 7, 2019-09 and 2020-12; 2020-12 without)."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _invalid(f"the JSON Schema is not valid JSON: {exc}", field="guide") from None
    if not isinstance(schema, dict):
        raise _invalid("the JSON Schema must be a JSON object", field="guide")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise _invalid(
            f"the JSON Schema is nested {depth} levels deep (objects and arrays); the limit is "
            f"{MAX_SCHEMA_DEPTH}: flatten it, or name repeated parts in $defs and $ref them",
            field="guide",
        )
    long_regex = _long_regex(schema, "")
    if long_regex is not None:
        where, size = long_regex
        raise _invalid(
            f"the JSON Schema's regular expression at {where} is {size} bytes; the limit is "
            f"{MAX_REGEX_GUIDE_BYTES}",
            field="guide",
        )
    try:
        jsonschema_rs.meta.validate(schema, registry=_KNOWN_DRAFTS_ONLY)
    except jsonschema_rs.ValidationError as exc:
        where = "/".join(str(p) for p in exc.instance_path) or "the top level"
        raise _invalid(
            f"the JSON Schema is not valid at {where}: {exc.message}", field="guide"
        ) from None
    except jsonschema_rs.ReferencingError:
        meta = schema.get("$schema")
        raise _invalid(
            f"the JSON Schema's $schema {echo(str(meta))} is not a draft checked here: name "
            "draft 4, 6, 7, 2019-09 or 2020-12, or leave $schema out",
            field="guide",
        ) from None
    except (ValueError, RecursionError):  # jsonschema-rs: nested past its limit, or not UTF-8
        raise _invalid(
            "the JSON Schema is nested too deeply or holds text that is not valid Unicode",
            field="guide",
        ) from None


def _depth(value: object) -> int:
    """Levels of objects and arrays in a JSON value (1 for an empty object), walked without
    recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children: Iterable[object]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


# A schema's keywords whose values are instance data, not schemas: nothing in them is a pattern.
_INSTANCE_DATA = frozenset({"enum", "const", "default", "examples"})


def _long_regex(value: object, path: str) -> tuple[str, int] | None:
    """Where the first regular expression of a schema (a `pattern`, a `patternProperties` name)
    longer than MAX_REGEX_GUIDE_BYTES is, and its bytes; None if there is none. Called on a
    schema nested at most MAX_SCHEMA_DEPTH levels."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _long_regex(item, f"{path}/{i}")
            if found is not None:
                return found
        return None
    if not isinstance(value, dict):
        return None
    for key, item in value.items():
        where = f"{path}/{key}" if path else str(key)
        if key == "pattern" and isinstance(item, str):
            size = len(item.encode(errors="surrogatepass"))
            if size > MAX_REGEX_GUIDE_BYTES:
                return where, size
            continue
        if key == "patternProperties" and isinstance(item, dict):
            for name in item:
                size = len(str(name).encode(errors="surrogatepass"))
                if size > MAX_REGEX_GUIDE_BYTES:
                    return where, size
        if key in _INSTANCE_DATA:
            continue
        found = _long_regex(item, where)
        if found is not None:
            return found
    return None


# A registry of no resources: a "$schema" other than a draft's is refused, never fetched (a
# registry that resolves a URI fetches it over the network).
_KNOWN_DRAFTS_ONLY = jsonschema_rs.Registry([])


def _subject(field: str) -> str:
    """How a refusal of the input's size names it: "prompt is" or "the messages are"."""
    return "the messages are" if field == "messages" else f"{field} is"


def _fits(chars: int, limits: Limits, field: str) -> None:
    """Text of `chars` characters can fit the model's input (checked before it is normalized;
    NFC composes, so it never makes text longer)."""
    if chars > limits.max_input_chars:
        raise _invalid(
            f"{_subject(field)} {chars} characters, more than fit this model's limit of "
            f"{limits.max_input_tokens} input tokens",
            reason=CONTEXT_LENGTH_EXCEEDED,
            field=field,
        )


def context_limit(limits: Limits, engine: EngineLimits) -> tuple[int, str]:
    """Most prompt + completion tokens a request may have, and which limit that is: the model's
    context (config.json) or its engine's max_seq_len, the smaller."""
    if engine.max_seq_len is not None and engine.max_seq_len < limits.context_length:
        return engine.max_seq_len, "the engine's max_seq_len"
    return limits.context_length, "the model's context"


def tokenize(
    checked: CheckedRequest,
    text: ModelText,
    limits: Limits,
    engine: EngineLimits = NO_ENGINE_LIMITS,
) -> PreparedRequest:
    """The prompt's token ids, checked against the model's limits and the engine's (`engine`: its
    backend's, the smaller applies); raises RequestError. A request without max_tokens gets the
    model's default, lowered to what the context leaves after the prompt."""
    if checked.prompt is not None:
        prompt_ids = text.encode_prompt(checked.prompt)
    else:
        try:
            prompt_ids = _encode_chat(checked, text)
        except ChatTemplateError as exc:
            raise _invalid(str(exc), field="messages") from exc
    field = checked.input_field
    prompt = len(prompt_ids)
    max_input, input_of = limits.max_input_tokens, ""
    if engine.max_input_len is not None and engine.max_input_len < max_input:
        max_input, input_of = engine.max_input_len, " (its engine's max_input_len)"
    if prompt > max_input:
        raise _invalid(
            f"{_subject(field)} {prompt} tokens; this model accepts at most {max_input} input "
            f"tokens{input_of}",
            reason=CONTEXT_LENGTH_EXCEEDED,
            field=field,
        )
    context, context_of = context_limit(limits, engine)
    max_tokens = checked.max_tokens
    if checked.default_max_tokens:
        max_tokens = max(min(max_tokens, context - prompt), checked.min_tokens, 1)
    if prompt + max_tokens > context:
        # Without max_tokens only min_tokens (or the one token every answer has) can pass it.
        asked = "max_tokens" if not checked.default_max_tokens else "min_tokens"
        raise _invalid(
            f"prompt ({prompt} tokens) + {asked} ({max_tokens}) exceeds {context_of} of "
            f"{context} tokens; lower {asked} or shorten the prompt",
            reason=CONTEXT_LENGTH_EXCEEDED,
            field=field,
        )
    return PreparedRequest(
        request_id=checked.request_id,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=checked.sampling,
        stops=checked.stops,
        guide=checked.guide,
        min_tokens=checked.min_tokens,
        ignore_eos=checked.ignore_eos,
        logprobs=checked.logprobs,
        speculation=checked.speculation,
        top_logprobs=checked.top_logprobs,
    )


def _encode_chat(checked: CheckedRequest, text: ModelText) -> list[int]:
    """A chat's token ids: a chat with tools through the model's template when it takes tools,
    else (and every other chat) its (role, content) messages."""
    chat = checked.tool_chat
    if chat is not None and text.takes_tools:
        return text.encode_chat(
            chat.template_messages(), tools=chat.tool_specs(), namespace=checked.namespace
        )
    return text.encode_chat(
        [{"role": r, "content": c} for r, c in checked.messages], namespace=checked.namespace
    )
