"""An HTTP request's JSON body decoded without holding the event loop.

`json.loads` holds the GIL from its start to its end, and its cost grows with the number of values a
body holds, not only with its bytes: a body of the size limit made of small values would stop every
other client for the whole decode, and a worker thread would not help. So a body up to
`INLINE_BYTES` is decoded on the event loop (its size bounds its cost to a few milliseconds), and a
larger one in a worker process, which also counts the values the body holds and refuses more than
`MAX_VALUES` before anything is sent back: what the event loop then unpickles is bounded too.

The worker process starts with the first large body (a spawned interpreter that imports only this
module and the standard library) and is replaced if it dies; the body waiting on it is refused with
503 and a retry hint, never a 500.

An object that names a key twice is refused wherever it is: JSON parsers disagree on which value
wins, so a proxy that checked one field and the gateway would read two different requests.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

# Bodies up to this size are decoded on the event loop.
INLINE_BYTES = 64 * 1024
# JSON values (objects, arrays, strings, numbers, literals, object keys not counted) a body may
# hold: a chat of the longest accepted history in text parts stays well below it.
MAX_VALUES = 32_768
# Arrays and objects a body may nest one in another: far more than a request needs (a tool's
# schema nests tens), and one limit whatever decodes the body. Python's parser alone stops near
# its recursion limit less the stack it runs on (deeper in the worker process than on the event
# loop), and what the gateway does with a body next recurses too: pickling the worker's result
# back, writing a schema out.
MAX_DEPTH = 256


class BodyError(ValueError):
    """A body that is not a request: the message says what is wrong with it."""


class BodyBusy(RuntimeError):
    """The decoding worker failed; the client may retry."""


def _kind(value: object) -> str:
    kinds: dict[type, str] = {dict: "an object", list: "an array", str: "a string"}
    return kinds.get(type(value), "a value")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that names each key once: parsers disagree on which of two same-named
    fields wins (Python's json takes the last, others the first), so neither is guessed at."""
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                shown = json.dumps(key)
                if len(shown) > 66:
                    shown = shown[:64] + '..."'
                raise BodyError(
                    f"the request body names {shown} twice in one object; send each field once"
                )
            seen.add(key)
    return data


def _constant(name: str) -> float:
    """NaN, Infinity and -Infinity, which Python's json reads and JSON does not have: a proxy
    or a client's own parser that checked the body would refuse it."""
    raise BodyError(f"the request body is not valid JSON: {name} is no JSON value")


def decode(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; BodyError says why it is not one."""
    try:
        data = json.loads(body, object_pairs_hook=_object, parse_constant=_constant)
    except BodyError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BodyError(f"the request body is not valid JSON: {exc}") from None
    except ValueError:  # an integer past the digits Python reads (sys.get_int_max_str_digits)
        raise BodyError(
            f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
            "digits; no field takes one"
        ) from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(data, dict):
        raise BodyError(f"the request body must be a JSON object, got {_kind(data)}")
    # A body nests no deeper than it has brackets: most bodies need no walk.
    if body.count(b"{") + body.count(b"[") > MAX_DEPTH and depth_over(data, MAX_DEPTH):
        raise _too_deep()
    return data


def _too_deep() -> BodyError:
    return BodyError(
        f"the request body is nested too deeply: arrays and objects at most {MAX_DEPTH} deep"
    )


def depth_over(data: object, limit: int) -> bool:
    """Whether `data` (as json.loads makes it) nests arrays and objects more than `limit` deep;
    walked a level at a time, looking at containers only, and stopped past `limit`."""
    level: list[Any] = [data] if type(data) in (dict, list) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[Any] = []
        for value in level:
            for child in value.values() if type(value) is dict else value:
                if type(child) is dict or type(child) is list:
                    below.append(child)
        level = below
    return False


def count_values(data: object, limit: int) -> int:
    """Values in `data`, counting stops past `limit` (returns limit + 1)."""
    count = 0
    pending = [data]
    while pending:
        value = pending.pop()
        count += 1
        if count > limit:
            return count
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return count


def decode_bounded(body: bytes) -> dict[str, Any] | str:
    """The worker's job: the decoded object, or the refusal's message (BodyError's text)."""
    try:
        data = decode(body)
    except BodyError as exc:
        return str(exc)
    if count_values(data, MAX_VALUES) > MAX_VALUES:
        return f"the request body holds more than {MAX_VALUES} JSON values"
    return data


class BodyDecoder:
    """Decodes request bodies: small ones inline, large ones in one worker process."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def decode(self, body: bytes) -> dict[str, Any]:
        if len(body) <= INLINE_BYTES:
            return decode(body)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn")
            )
        pool = self._pool
        try:
            result = await asyncio.get_running_loop().run_in_executor(pool, decode_bounded, body)
        except BrokenProcessPool:
            if self._pool is pool:
                self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise BodyBusy("the request body's decoder stopped; retry the request") from None
        if isinstance(result, str):
            raise BodyError(result)
        return result

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
