"""Log lines a client cannot forge or flood.

Clients choose request ids, model names, namespaces and prompts; any of them may hold a newline, a
carriage return or a terminal escape. A record's message is written as one line with such characters
escaped, so a value can never start a line of its own in the journal. A traceback keeps its lines
but each is indented, so only a record's first line starts at column 0.

A fault a client can cause at will (an undecodable body, say) is logged at most once per interval
with the count of the ones not logged, so a flood of bad requests is one line every few seconds,
not one line each.

Nor can the log stall the process. Under systemd stderr is the journal's socket, and a write to it
blocks while the journal falls behind; a gateway writing its access lines on the event loop would
stop answering with it. A line is formatted on the thread that logs it and written by a thread of
its own (`LineWriter`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import queue
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from logging import _SysExcInfoType

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

# Control characters (C0, DEL, C1) and the Unicode line and paragraph separators.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
_ESCAPES.update({0x2028: "\\u2028", 0x2029: "\\u2029"})
# What json.dumps leaves as it is (with ensure_ascii=False) of those: DEL, C1 (U+0085 is a line
# break to Python's str.splitlines, U+009B a terminal's CSI) and the line and paragraph separators.
_JSON_ESCAPES = {c: f"\\u{c:04x}" for c in (*range(0x7F, 0xA0), 0x2028, 0x2029)}


def escape(text: str) -> str:
    """The text with every character that could break or rewrite a line escaped."""
    if text.isascii() and text.isprintable():
        return text
    return text.translate(_ESCAPES)


class _SecondFormatter(logging.Formatter):
    """formatTime with the seconds' text kept while the second lasts: a busy gateway writes many
    lines a second, and strftime is most of a line's time stamp. Milliseconds are added as the
    base class adds them."""

    _second: tuple[int, str | None, str] = (-1, None, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second = int(record.created)
        kept, kept_fmt, text = self._second  # one read: another thread may replace it
        if kept != second or kept_fmt != datefmt:
            text = time.strftime(datefmt or self.default_time_format, self.converter(second))
            self._second = (second, datefmt, text)
        if datefmt or not self.default_msec_format:
            return text
        return self.default_msec_format % (text, record.msecs)


class OneLineFormatter(_SecondFormatter):
    """A record is one line; a traceback follows it indented."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape(super().formatMessage(record))

    def formatException(self, ei: _SysExcInfoType) -> str:
        text = super().formatException(ei)
        return "\n".join("    " + escape(line) for line in text.splitlines())

    def formatStack(self, stack_info: str) -> str:
        return "\n".join("    " + escape(line) for line in stack_info.splitlines())


@functools.cache
def _field_names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(kind) if f.name != "inter_token_us")


class JsonFormatter(_SecondFormatter):
    """One JSON object a line: time, level, logger, message, and an access record's fields.

    json.dumps escapes the C0 control characters and the rest (DEL, C1, U+2028, U+2029) are
    escaped after it, as JSON's \\uXXXX, so a client's value can neither break the line nor reach
    a terminal as an escape sequence."""

    converter = staticmethod(time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "access", None)
        if fields is not None:
            # An access record's fields are flat values, copied one by one; the gaps between
            # tokens (one number per token) are left to the histograms.
            if dataclasses.is_dataclass(fields) and not isinstance(fields, type):
                out.update((name, getattr(fields, name)) for name in _field_names(type(fields)))
            else:
                out.update(fields)
                out.pop("inter_token_us", None)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        line = json.dumps(out, ensure_ascii=False, default=str)
        return line if line.isascii() else line.translate(_JSON_ESCAPES)


# Lines formatted and not yet written: at a few hundred bytes an access line, tens of seconds of a
# busy gateway's lines (tens of MB at most) while stderr is not read. Past it a line is dropped
# and counted.
QUEUED_LINES = 65_536
# After the first line of a write the writer waits this long for more: one wake-up of its thread
# per write, not per line, so it takes the interpreter's lock from the event loop rarely.
GATHER_S = 0.01
# At exit (logging.shutdown flushes, then closes) each waits this long at most for the writer: a
# stderr nobody reads must not keep the process from ending.
EXIT_FLUSH_S = 5.0


class LineWriter(logging.Handler):
    """Formats each record on the thread that logs it; writes the lines to `stream` on a thread of
    its own, in order, within `GATHER_S` of being logged. When `capacity` lines wait, a new one is
    dropped and counted, and the next write says how many were."""

    def __init__(self, stream: TextIO, capacity: int = QUEUED_LINES) -> None:
        super().__init__()
        self.stream = stream
        self._capacity = capacity
        self._start()
        # A thread does not survive a fork: the child starts its own writer.
        os.register_at_fork(after_in_child=functools.partial(_restart, weakref.ref(self)))

    def _start(self) -> None:
        # A line, an Event set once every line before it is written (flush), or None (close).
        self._lines: queue.SimpleQueue[str | threading.Event | None] = queue.SimpleQueue()
        self._waiting = 0  # lines queued, not yet taken by the writer
        self._dropped = 0
        # Not the handler's lock: logging.shutdown holds that while it flushes, which waits on the
        # writer.
        self._counting = threading.Lock()
        self._writer = threading.Thread(target=self._write, name="log-writer", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        with self._counting:
            if self._waiting >= self._capacity:
                self._dropped += 1
                return
            self._waiting += 1
        self._lines.put(line)

    def _write(self) -> None:
        while True:
            items = [self._lines.get()]
            if isinstance(items[0], str):
                time.sleep(GATHER_S)
            while True:
                try:
                    items.append(self._lines.get_nowait())
                except queue.Empty:
                    break
            lines = [item for item in items if isinstance(item, str)]
            with self._counting:
                self._waiting -= len(lines)
                dropped, self._dropped = self._dropped, 0
            if dropped:
                lines.append(self.format(_dropped_record(dropped, self._capacity)))
            with contextlib.suppress(OSError, ValueError):  # stderr closed: nowhere to say so
                self.stream.write("".join(line + "\n" for line in lines))
                self.stream.flush()
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()
            if None in items:
                return

    def flush(self, timeout_s: float = EXIT_FLUSH_S) -> None:
        """Returns once every line logged before the call is written, or after `timeout_s`."""
        if self._writer.is_alive():
            written = threading.Event()
            self._lines.put(written)
            written.wait(timeout_s)

    def close(self) -> None:
        """Writes what is queued (for `EXIT_FLUSH_S` at most), then ends the writer."""
        if self._writer.is_alive():
            self._lines.put(None)
            self._writer.join(EXIT_FLUSH_S)
        super().close()


def _restart(writer: weakref.ref[LineWriter]) -> None:
    alive = writer()
    if alive is not None:
        alive._start()


def _dropped_record(count: int, capacity: int) -> logging.LogRecord:
    return logging.LogRecord(
        __name__,
        logging.WARNING,
        __file__,
        0,
        "%d log lines dropped: %d lines were already waiting for stderr to be read",
        (count, capacity),
        None,
    )


def flush() -> None:
    """Returns once every line logged so far is written."""
    for handler in logging.getLogger().handlers:
        handler.flush()


def last_line(text: str) -> None:
    """A process's last words on stderr (why it stops), after every line it logged before."""
    flush()
    print(escape(text), file=sys.stderr, flush=True)


def configure(level: str, log_format: str = "text") -> None:
    """The process's root logger: stderr (the journal under systemd) through a `LineWriter`, one
    line a record, escaped text or JSON. Called again (the configuration file is read after the
    command line), it replaces the handler's formatter and the level."""
    root = logging.getLogger()
    formatter: logging.Formatter = (
        JsonFormatter() if log_format == "json" else OneLineFormatter(FORMAT)
    )
    if not root.handlers:
        root.addHandler(LineWriter(sys.stderr))
    for handler in root.handlers:
        handler.setFormatter(formatter)
    root.setLevel(level.upper())


class Throttled:
    """One warning per `interval_s` at most; the next one says how many were not logged."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.suppressed = 0
        self._next = 0.0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self.suppressed += 1
            return
        self._next = now + self.interval_s
        if self.suppressed:
            message += " (%d more since the last such line, not logged)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self.logger.warning(message, *args)
