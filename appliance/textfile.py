"""Reading a file a user names (a configuration, prompts, calibration or evaluation text) whole,
bounded.

At most `max_bytes` + 1 bytes are read whatever the file is (a pipe, /dev/zero or a file that
grows after its size was looked at), so a wrong path costs a bounded read and one line. Each
caller puts its own option or path before the reason and raises its own CLI error.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TextFileError", "numbered_lines", "read_bytes", "read_text"]


class TextFileError(ValueError):
    """Why the file cannot be read, in one line that does not repeat its path."""


def read_bytes(path: Path, max_bytes: int) -> bytes:
    """The file's bytes; TextFileError when it cannot be read or holds more than `max_bytes`."""
    try:
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as exc:
        raise TextFileError(exc.strerror or type(exc).__name__) from None
    if len(data) > max_bytes:
        raise TextFileError(f"more than {max_bytes:,} bytes")
    return data


def read_text(path: Path, max_bytes: int) -> str:
    """The file's UTF-8 text, without the byte order mark some editors put first; TextFileError
    when it cannot be read, holds more than `max_bytes` bytes, or is not UTF-8."""
    data = read_bytes(path, max_bytes)
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise TextFileError(f"not UTF-8 text (byte {exc.start:,})") from None


def numbered_lines(text: str) -> list[tuple[int, str]]:
    """The lines of `text` with their numbers from 1, as an editor counts them: split at "\n"
    (a "\r" before it dropped) only, not at the form feeds, U+0085 or U+2028 that str.splitlines
    also splits at, which a line of text or a JSON string may hold."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [(n, line.removesuffix("\r")) for n, line in enumerate(lines, 1)]
