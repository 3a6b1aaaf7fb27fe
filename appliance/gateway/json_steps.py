"""Client JSON parsed and written in bounded steps, so that no one call holds the event loop.

`json.loads` and `json.dumps` hold the GIL from their start to their end: on a worker thread, one
call over megabytes of small values (tens to hundreds of milliseconds) still stops the event loop
for all of it. So a text longer than `STEP_CHARS` is parsed here a piece at a time, each piece by
the json module's C scanner: an array or object whose text ends within `STEP_CHARS` of its start
is one piece (one C call on a copy of at most that window), a longer one is walked by the json
module's own pure-Python object and array parsers, whose values are pieces again; a string or
number is one piece. The result is the value `json.loads` makes, and the same errors (ValueError,
RecursionError) for a text it refuses. The containers walked are remembered (`Parsed.walked`) so
that `dumps` writes them a field or an item at a time and every other value in one C call, which
its source's size bounds; a long string is written in slices (JSON escapes a character at a time,
so the slices' texts join into the whole's). Between the steps the interpreter hands the GIL to
the event loop at its switch interval. The total work stays close to one C call's.

One difference: a walked container costs the interpreter two frames, so a text longer than
`STEP_CHARS` whose containers longer than `STEP_CHARS` nest more than about 490 deep raises
RecursionError, where `json.loads` reaches about 990; callers take both as text that does not
parse.
"""

from __future__ import annotations

import json
import json.decoder
import json.encoder
import json.scanner
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# Characters of JSON text parsed in one C call, and of a string written in one.
STEP_CHARS = 64 * 1024
# The first window an array or object is tried in; each next one is 4 times longer.
_FIRST_WINDOW = 256

_WHITESPACE = re.compile(r"[ \t\n\r]*")
# The json module's pure-Python object and array parsers (its decoder's own, which call the scanner
# they are given for each value).
_OBJECT = json.decoder.JSONObject  # type: ignore[attr-defined]
_ARRAY = json.decoder.JSONArray  # type: ignore[attr-defined]
# What json.dumps(value, ensure_ascii=False, sort_keys=...) builds at each call, built once.
_PLAIN = json.JSONEncoder(ensure_ascii=False)
_SORTED = json.JSONEncoder(ensure_ascii=False, sort_keys=True)
# json.dumps(text, ensure_ascii=False) of a str, in C.
_STRING = json.encoder.encode_basestring


@dataclass(frozen=True)
class Parsed:
    """A JSON text's value, and the ids of its arrays and objects that were walked (not parsed
    in one call): `dumps` writes those a field or an item at a time."""

    value: Any
    walked: frozenset[int] = field(default=frozenset())


def loads(text: str, step: int = STEP_CHARS) -> Parsed:
    """`json.loads(text)`, in steps of at most `step` characters each when `text` is longer.
    Raises what json.loads raises for a text it refuses (ValueError, RecursionError)."""
    if len(text) <= step:
        return Parsed(json.loads(text))
    if text.startswith("\ufeff"):  # as json.loads refuses a str that starts with one
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    scanner = _Scanner(step)
    start = _WHITESPACE.match(text, 0).end()  # type: ignore[union-attr]
    try:
        value, end = scanner.scan(text, start)
    except StopIteration as exc:
        raise json.JSONDecodeError("Expecting value", text, exc.value) from None
    end = _WHITESPACE.match(text, end).end()  # type: ignore[union-attr]
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return Parsed(value, frozenset(scanner.walked))


class _Scanner:
    """The scanner the json module's object and array parsers call for each value."""

    def __init__(self, step: int) -> None:
        self.step = step
        decoder = json.JSONDecoder()
        # The C scanner: one value at an index, whole.
        self.whole: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(
            decoder  # type: ignore[arg-type]
        )
        self.memo: dict[str, str] = {}
        self.walked: set[int] = set()

    def scan(self, text: str, at: int) -> tuple[Any, int]:
        try:
            first = text[at]
        except IndexError:
            raise StopIteration(at) from None
        if first != "{" and first != "[":
            return self.whole(text, at)
        window = _FIRST_WINDOW
        while True:
            if len(text) - at <= window:
                return self.whole(text, at)
            try:
                value, end = self.whole(text[at : at + window], 0)
            except (StopIteration, ValueError, RecursionError):
                # Cut short by the window (or invalid: walking it finds the same error).
                if window >= self.step:
                    break
                window *= 4
                continue
            return value, at + end
        if first == "{":
            value, end = _OBJECT((text, at + 1), True, self.scan, None, None, self.memo)
        else:
            value, end = _ARRAY((text, at + 1), self.scan)
        self.walked.add(id(value))
        return value, end


def dumps(parsed: Parsed, *, sort_keys: bool = False, step: int = STEP_CHARS) -> str:
    """`json.dumps(parsed.value, ensure_ascii=False, sort_keys=sort_keys)`: the containers
    `loads` walked are written a field or an item at a time, a string longer than `step` in
    slices, every other value in one call."""
    if not parsed.walked and not (isinstance(parsed.value, str) and len(parsed.value) > step):
        return (_SORTED if sort_keys else _PLAIN).encode(parsed.value)
    return "".join(list(_pieces(parsed.value, parsed.walked, sort_keys, step)))


def string(text: str, step: int = STEP_CHARS) -> str:
    """`json.dumps(text, ensure_ascii=False)`, in slices of `step` characters."""
    if len(text) <= step:
        return _STRING(text)
    return "".join(list(_pieces(text, frozenset(), False, step)))


def _small(value: Any, encoder: json.JSONEncoder) -> str:
    """A value parsed in one call, written in one (its commonest kinds without the encoder's
    set-up)."""
    kind = type(value)
    if kind is str:
        return _STRING(value)
    if kind is int:
        return int.__repr__(value)
    return encoder.encode(value)


def _pieces(value: Any, walked: frozenset[int], sort_keys: bool, step: int) -> Iterator[str]:
    encoder = _SORTED if sort_keys else _PLAIN
    if type(value) is str and len(value) > step:
        yield '"'
        for at in range(0, len(value), step):
            yield _STRING(value[at : at + step])[1:-1]
        yield '"'
    elif id(value) not in walked:
        yield _small(value, encoder)
    else:
        is_dict = type(value) is dict
        yield "{" if is_dict else "["
        items = (sorted(value.items()) if sort_keys else value.items()) if is_dict else value
        for i, entry in enumerate(items):
            if is_dict:
                name, item = entry
                head = (", " if i else "") + string(name, step) + ": "
            else:
                item, head = entry, ", " if i else ""
            if id(item) in walked or (type(item) is str and len(item) > step):
                yield head
                yield from _pieces(item, walked, sort_keys, step)
            else:
                yield head + _small(item, encoder)
        yield "}" if is_dict else "]"


def sorted_object(fields: dict[str, str]) -> str:
    """The text `json.dumps(..., sort_keys=True)` writes for an object whose fields' values are
    written already (`fields`: name -> the value's JSON text)."""
    return (
        "{" + ", ".join(f"{_PLAIN.encode(name)}: {fields[name]}" for name in sorted(fields)) + "}"
    )
