"""Types of command-line values, checked by argparse: a bad one is its one-line usage error
(exit 2) naming the option, before the command does anything."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from appliance.listen import is_address
from appliance.logline import escape

# A command stopped by Ctrl-C (SIGINT) exits 128 + 2, as a shell reports a process it killed.
INTERRUPTED_EXIT = 130


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage error is one line, what is wrong and where to read more,
    and exit 2 (argparse's own prints its usage block first). Its subcommands' parsers are of
    this class too (`add_subparsers` makes them of the parent's class), and a subcommand's
    unknown option is refused by the subcommand's parser, naming its help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Subcommands)

    def error(self, message: str) -> NoReturn:
        self.exit(2, escape(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n")


class _Subcommands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subcommands whose parser refuses the arguments it does not know (argparse's passes them up
    to the top-level parser, whose error would name the top-level help)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        super().__call__(parser, namespace, values, option_string)
        # Set only by subcommand actions: this one's, or a nested one's that already refused.
        unknown = vars(namespace).pop(argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if unknown:
            assert values is not None
            self._name_parser_map[values[0]].error(f"unrecognized arguments: {' '.join(unknown)}")


def positive(kind: type[int] | type[float], at_most: float = math.inf) -> Callable[[str], float]:
    """An integer or a finite number greater than 0 and at most `at_most`."""
    return _ranged(kind, at_most, zero=False)


def non_negative(
    kind: type[int] | type[float], at_most: float = math.inf
) -> Callable[[str], float]:
    """An integer or a finite number of 0 or more and at most `at_most`."""
    return _ranged(kind, at_most, zero=True)


def _ranged(kind: type[int] | type[float], at_most: float, zero: bool) -> Callable[[str], float]:
    what = "an integer" if kind is int else "a number"
    floor = "of 0 or more" if zero else "greater than 0"
    bound = "" if at_most == math.inf else f" and at most {at_most:g}"

    def parse(text: str) -> float:
        value = integer(text) if kind is int else number(text)
        # NaN fails the range; an int is always finite (and too long for a float to hold).
        low = value >= 0 if zero else value > 0
        if not (low and value <= at_most) or (
            isinstance(value, float) and not math.isfinite(value)
        ):
            raise argparse.ArgumentTypeError(f"must be {what} {floor}{bound}, got {text}")
        return value

    return parse


positive_int = positive(int)
positive_float = positive(float)

# Torch CPU threads: far past any host's cores, and far below what torch's int32 overflows on.
MAX_THREADS = 1024
threads = positive(int, at_most=MAX_THREADS)


non_negative_float = non_negative(float)


def address(text: str) -> str:
    """HOST:PORT to connect to (port 1 to 65535), or a gRPC `unix:` target."""
    if not (text.startswith("unix:") or is_address(text)):
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port of 1 to 65535, got {text}"
        )
    return text


def listen_address(text: str) -> str:
    """HOST:PORT to listen on (port 0: the system picks one)."""
    if not is_address(text, any_port=True):
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port of 0 to 65535, got {text}"
        )
    return text


def utf8_text(text: str) -> str:
    """A value that goes onto the wire or into a UTF-8 file: argv bytes that are not UTF-8 reach
    Python as lone surrogates, which no encoder takes."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not UTF-8 text, got {text!a}") from None
    return text


def os_error_line(exc: OSError) -> str:
    """A refusal of the system (a file or folder it could not read or write) as its one line:
    the path, then the reason."""
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc}"


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text}") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text}") from None
