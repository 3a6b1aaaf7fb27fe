"""Strict reading of operator-written TOML files, shared by the three CLIs' configuration files.

Every refusal has one shape, `FILE:LINE: key 'TABLE.KEY': what is wrong`, and an unknown key lists the
known ones, so a typo is found from the message alone and never becomes a silent default. Each
package raises its own error class (a subclass of :class:`Table` sets ``error``) so its CLI's
one-line error handling catches it. Standard library only: engine_build and host_tuning import this
without the gateway's dependencies.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar, NoReturn, Self

from appliance.textfile import TextFileError, read_bytes

CREDENTIALS_PREFIX = "$CREDENTIALS_DIRECTORY/"
# Larger is no configuration, spec or profile (the largest real ones are a few KiB): a wrong path
# (a log, /dev/zero) is refused after reading this much.
MAX_FILE_BYTES = 1 << 20


class TomlError(ValueError):
    """A file that cannot be used; the message names the file, line and key."""


def line_of(text: str, table: str, key: str | None) -> int:
    """Best-effort line number of `key` inside `[table]` (or of the table header) for messages."""
    header = re.compile(r"^\s*\[+\s*([^\]]+?)\s*\]+\s*(#.*)?$")
    in_table = table == ""
    table_line = 0
    # A key that is itself a table ([models.x] for key 'x' of table 'models') is found by its header.
    subtable = f"{table}.{key}" if table else key
    for number, line in enumerate(text.splitlines(), start=1):
        m = header.match(line)
        if m:
            name = m.group(1).replace('"', "").replace("'", "").replace(" ", "")
            if key is not None and name == subtable:
                return number
            in_table = name == table
            if in_table:
                table_line = number
            continue
        if (
            in_table
            and key is not None
            and re.match(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=", line)
        ):
            return number
    return table_line


def loads(text: str, source: Path, error: type[Exception] = TomlError) -> dict[str, Any]:
    """The decoded document of `text`, read from `source` (named in the message)."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{source}: not valid TOML: {exc}") from exc


def read(path: Path, what: str, error: type[Exception] = TomlError) -> tuple[str, dict[str, Any]]:
    """The text and the decoded document of `path`; `what` names the file in the messages."""
    try:
        text = read_bytes(path, MAX_FILE_BYTES).decode("utf-8")
    except TextFileError as exc:
        raise error(f"{path}: cannot read {what}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: {what} is not UTF-8 text: {exc.reason}") from exc
    return text, loads(text, path, error)


# A refusal of one value, named 'SECTION.KEY'; a loader's checks of a whole document take one, so
# the same checks serve a file (the message names its line) and a value built in code.
Fail = Callable[[str, str], NoReturn]


def refusal(error: type[Exception]) -> Fail:
    """Refuses with `error` naming the key only: the value was not read from a file."""

    def fail(dotted: str, message: str) -> NoReturn:
        raise error(f"key '{dotted}': {message}")

    return fail


def refusal_in(tables: Mapping[str, Table]) -> Fail:
    """Refuses naming the file and the line of 'SECTION.KEY' among `tables`, by section."""

    def fail(dotted: str, message: str) -> NoReturn:
        section, key = dotted.split(".", 1)
        tables[section].fail(key, message)

    return fail


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
SIZE_FORM = "a number with a unit, such as 80GiB, 81920MiB or 80GB"


def parse_size(text: str) -> int | None:
    """Bytes in `text` ("80GiB", "81920MiB", "80GB"); None when it is not that form.

    A bare number is refused on purpose: "80" meant as GiB would otherwise be 80 bytes.
    """
    m = _SIZE.match(text)
    if m is None:
        return None
    # Exact (a float of 400 digits is inf): a caller's range check names a size too large.
    return int(Decimal(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


class Table:
    """Pulls typed values out of one TOML table and complains precisely."""

    error: ClassVar[type[Exception]] = TomlError

    def __init__(self, path: Path, text: str, table: str, data: dict[str, Any], known: set[str]):
        self.path, self.text, self.table, self.data = path, text, table, data
        unknown = sorted(set(data) - known)
        if unknown:
            also = f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""
            self.fail(unknown[0], f"unknown key{also}; known keys are {', '.join(sorted(known))}")

    def sub(self, key: str, known: set[str]) -> Self:
        """The table under `key` (empty when absent), read with the same error class."""
        name = f"{self.table}.{key}" if self.table else key
        data = self.get(key, dict, {})
        return type(self)(self.path, self.text, name, data, known)

    def fail(self, key: str | None, message: str) -> NoReturn:
        line = line_of(self.text, self.table, key)
        where = f"{self.table}.{key}" if key and self.table else (key or self.table)
        raise self.error(f"{self.path}:{line}: key '{where}': {message}")

    def get(self, key: str, kind: type, default: Any) -> Any:
        if key not in self.data:
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value) if abs(value) < 2**1023 else math.inf  # refused below
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.fail(key, f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        if isinstance(value, float) and not math.isfinite(value):  # TOML has nan and inf
            self.fail(key, f"expected a finite number, got {value!r}")
        return value

    def str_list(self, key: str, default: tuple[str, ...] = ()) -> tuple[str, ...]:
        value = self.get(key, list, None)
        if value is None:
            return default
        if not all(isinstance(v, str) for v in value):
            self.fail(key, f"expected a list of strings, got {value!r}")
        return tuple(value)

    def int_list(self, key: str, default: tuple[int, ...] = ()) -> tuple[int, ...]:
        value = self.get(key, list, None)
        if value is None:
            return default
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            self.fail(key, f"expected a list of integers, got {value!r}")
        return tuple(value)

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value = str(self.get(key, str, default))
        if value not in choices:
            self.fail(key, f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    def size(self, key: str, default: int | None) -> int | None:
        """A byte size written with its unit ("80GiB"); see :func:`parse_size`."""
        value = self.get(key, str, None)
        if value is None:
            return default
        size = parse_size(value)
        if size is None:
            self.fail(key, f"expected {SIZE_FORM}, got {value!r}")
        return size

    def file_path(self, key: str, base: Path) -> Path | None:
        """A path relative to `base`; a leading `$CREDENTIALS_DIRECTORY/` names a systemd
        credential of the unit (LoadCredential=), where secrets are passed."""
        value: str = self.get(key, str, "")
        if not value:
            return None
        if value.startswith(CREDENTIALS_PREFIX):
            directory = os.environ.get("CREDENTIALS_DIRECTORY")
            if not directory:
                self.fail(
                    key,
                    "$CREDENTIALS_DIRECTORY is not set: systemd sets it for a unit with "
                    "LoadCredential=; elsewhere give the file's path",
                )
            return Path(directory) / value.removeprefix(CREDENTIALS_PREFIX)
        path = Path(value).expanduser()
        return path if path.is_absolute() else base / path

    def positive(self, key: str, kind: type, default: Any, at_most: float = math.inf) -> Any:
        value = self.get(key, kind, default)
        if value is not None and value <= 0:
            self.fail(key, f"must be greater than 0, got {value!r}")
        if value is not None and value > at_most:
            self.fail(key, f"must be at most {at_most}, got {value!r}")
        return value

    def at_least(self, key: str, minimum: int, default: int) -> int:
        value: int = self.get(key, int, default)
        if value < minimum:
            self.fail(key, f"must be {minimum} or more, got {value!r}")
        return value

    def require(self, key: str) -> str:
        if key not in self.data:
            self.fail(None, f"missing required key '{key}'")
        value = self.get(key, str, "")
        if not value:
            self.fail(key, "must not be empty")
        return str(value)
