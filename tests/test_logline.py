"""The log's writer thread: logging never waits for stderr, the lines come out in order, and a
full queue drops lines with a count instead of blocking."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

from appliance.logline import LineWriter

# Far more than a pipe holds (64 KiB on Linux), so a writer on the logging thread would block.
LINES = 2000
TEXT = "x" * 200


@dataclass
class Pipe:
    """A pipe that nobody reads until `read` is called; `lines` then holds what came out."""

    read_end: int
    stream: TextIO  # the write end
    lines: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    def read(self) -> None:
        def read_all() -> None:
            chunks = []
            while chunk := os.read(self.read_end, 1 << 16):
                chunks.append(chunk)
            self.lines += b"".join(chunks).decode().splitlines()

        self._reader = threading.Thread(target=read_all, daemon=True)
        self._reader.start()

    def close(self) -> None:
        """Closes the write end (read what is left first) and waits for the reader's EOF."""
        if self._reader is None:
            self.read()
        self.stream.close()
        assert self._reader is not None
        self._reader.join(30)


@contextmanager
def unread_pipe() -> Iterator[Pipe]:
    read_end, write_end = os.pipe()
    pipe = Pipe(read_end, os.fdopen(write_end, "w"))
    try:
        yield pipe
    finally:
        pipe.close()
        os.close(read_end)


def writer_on(pipe: Pipe, **options: int) -> tuple[LineWriter, logging.Logger]:
    writer = LineWriter(pipe.stream, **options)
    writer.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger(f"test_logline.{id(writer)}")
    log.propagate = False
    log.addHandler(writer)
    log.setLevel(logging.INFO)
    return writer, log


def log_in_a_thread(log: logging.Logger, count: int) -> bool:
    """Logs `count` lines on a thread of its own; True when that thread finished within 30 s."""

    def log_all() -> None:
        for n in range(count):
            log.info("%d %s", n, TEXT)

    thread = threading.Thread(target=log_all, daemon=True)
    thread.start()
    thread.join(30)
    return not thread.is_alive()


def test_logging_does_not_wait_for_an_unread_stderr_and_loses_nothing() -> None:
    with unread_pipe() as pipe:
        writer, log = writer_on(pipe)
        assert log_in_a_thread(log, LINES)
        pipe.read()
        writer.close()  # writes what waits, then ends the writer thread
        pipe.close()
    assert pipe.lines == [f"{n} {TEXT}" for n in range(LINES)]


def test_a_full_queue_drops_lines_and_says_how_many() -> None:
    with unread_pipe() as pipe:
        writer, log = writer_on(pipe, capacity=8)
        assert log_in_a_thread(log, LINES)
        pipe.read()
        writer.close()
        pipe.close()
    notes = [line for line in pipe.lines if "log lines dropped" in line]
    written = [int(line.split()[0]) for line in pipe.lines if line not in notes]
    assert notes and written == sorted(written)  # in order, with gaps where lines were dropped
    dropped = sum(int(note.split()[0]) for note in notes)
    assert len(written) + dropped == LINES
    assert "8 lines were already waiting" in notes[0]


def test_flush_returns_once_every_line_is_written() -> None:
    with unread_pipe() as pipe:
        writer, log = writer_on(pipe)
        log.info("first")
        log.info("second")
        writer.flush()
        assert os.read(pipe.read_end, 1 << 16) == b"first\nsecond\n"
        writer.close()
