"""Client JSON parsed and written in bounded steps, so that no one call holds the event loop.

`json.loads` and `json.dumps` hold the GIL from their start to their end: on a worker thread, one
call over megabytes of small values (tens to hundreds of milliseconds) still stops the event loop
for all of it. So a text longer than `STEP_CHARS` is parsed here a piece at a time, each piece by
the json module's C scanner: an array or object whose text ends within `STEP_CHARS` of its start
is one piece (one C call on a copy of at most that window), a longer one is walked by the json
module's own pure-Python object and array parsers, whose values are pieces again; a string or
number is one piece. `loads` gives the value `json.loads` makes; `rewrite` gives the texts
`json.dumps` writes of it (as parsed, and with sorted keys), each piece written as soon as it is
parsed and let go, so that no large value is ever held (a large value alive is walked by every
full collection of the garbage collector, on whichever thread it runs, the event loop's too);
a long string is written in slices. Both raise what `json.loads` raises for a text it refuses
(ValueError, RecursionError). Between the steps the interpreter hands the GIL to the event loop at
its switch interval.

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
from collections.abc import Callable
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


def loads(text: str, step: int = STEP_CHARS) -> Any:
    """`json.loads(text)`, in steps of at most `step` characters each when `text` is longer.
    Raises what json.loads raises for a text it refuses (ValueError, RecursionError)."""
    if len(text) <= step:
        return json.loads(text)
    value, _ = _scan_all(text, _Scanner(step, write=False))
    return value


def rewrite(text: str, step: int = STEP_CHARS) -> tuple[str, str]:
    """`json.dumps(json.loads(text), ensure_ascii=False)` and the same with `sort_keys=True`,
    in steps when `text` is longer than `step`: each array or object parsed in one call is
    written at once and let go, so no value larger than a step is ever held (a large value
    held is walked by every full collection of the garbage collector, on whichever thread it
    runs). Raises what json.loads raises for a text it refuses."""
    if len(text) <= step:
        value = json.loads(text)
        return _PLAIN.encode(value), _SORTED.encode(value)
    written, _ = _scan_all(text, _Scanner(step, write=True))
    return written  # type: ignore[no-any-return]


def _scan_all(text: str, scanner: _Scanner) -> tuple[Any, int]:
    if text.startswith("\ufeff"):  # as json.loads refuses a str that starts with one
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    start = _WHITESPACE.match(text, 0).end()  # type: ignore[union-attr]
    try:
        value, end = scanner.scan(text, start)
    except StopIteration as exc:
        raise json.JSONDecodeError("Expecting value", text, exc.value) from None
    end = _WHITESPACE.match(text, end).end()  # type: ignore[union-attr]
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value, end


class _Scanner:
    """The scanner the json module's object and array parsers call for each value. With
    `write`, each value it gives back is its two texts (json.dumps's, then with sorted keys)."""

    def __init__(self, step: int, write: bool) -> None:
        self.step = step
        self.write = write
        decoder = json.JSONDecoder()
        # The C scanner: one value at an index, whole.
        self.whole: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(
            decoder  # type: ignore[arg-type]
        )
        self.memo: dict[str, str] = {}

    def scan(self, text: str, at: int) -> tuple[Any, int]:
        try:
            first = text[at]
        except IndexError:
            raise StopIteration(at) from None
        if first != "{" and first != "[":
            value, end = self.whole(text, at)
            return self._whole(value), end
        window = _FIRST_WINDOW
        while True:
            if len(text) - at <= window:
                value, end = self.whole(text, at)
                return self._whole(value), end
            try:
                value, end = self.whole(text[at : at + window], 0)
            except (StopIteration, ValueError, RecursionError):
                # Cut short by the window (or invalid: walking it finds the same error).
                if window >= self.step:
                    break
                window *= 4
                continue
            return self._whole(value), at + end
        if first == "{":
            value, end = _OBJECT((text, at + 1), True, self.scan, None, None, self.memo)
        else:
            value, end = _ARRAY((text, at + 1), self.scan)
        return self._walked(value), end

    def _whole(self, value: Any) -> Any:
        """A value parsed in one call: as it is, or written."""
        if not self.write:
            return value
        if type(value) is str and len(value) > self.step:
            text = string(value, self.step)
            return text, text
        return _small(value, _PLAIN), _small(value, _SORTED)

    def _walked(self, value: Any) -> Any:
        """An array or object walked: as it is, or written from its items' texts."""
        if not self.write:
            return value
        if type(value) is dict:
            names = list(value)
            texts = list(value.values())
            fields = [f"{string(name, self.step)}: " for name in names]
            plain = ", ".join([fields[i] + texts[i][0] for i in range(len(names))])
            ordered = ", ".join(
                [fields[i] + texts[i][1] for i in sorted(range(len(names)), key=names.__getitem__)]
            )
            return "{" + plain + "}", "{" + ordered + "}"
        return (
            "[" + ", ".join([w[0] for w in value]) + "]",
            "[" + ", ".join([w[1] for w in value]) + "]",
        )


def string(text: str, step: int = STEP_CHARS) -> str:
    """`json.dumps(text, ensure_ascii=False)`, in slices of `step` characters (JSON escapes a
    character at a time, so the slices' texts join into the whole's)."""
    if len(text) <= step:
        return _STRING(text)
    return (
        '"'
        + "".join([_STRING(text[at : at + step])[1:-1] for at in range(0, len(text), step)])
        + '"'
    )


def _small(value: Any, encoder: json.JSONEncoder) -> str:
    """A value parsed in one call, written in one (its commonest kinds without the encoder's
    set-up)."""
    kind = type(value)
    if kind is str:
        return _STRING(value)
    if kind is int:
        return int.__repr__(value)
    return encoder.encode(value)


def sorted_object(fields: dict[str, str]) -> str:
    """The text `json.dumps(..., sort_keys=True)` writes for an object whose fields' values are
    written already (`fields`: name -> the value's JSON text)."""
    return (
        "{" + ", ".join(f"{_PLAIN.encode(name)}: {fields[name]}" for name in sorted(fields)) + "}"
    )
