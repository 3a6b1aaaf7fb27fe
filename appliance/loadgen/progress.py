"""What a running bench shows: one line redrawn in place on a terminal, a line every few seconds
otherwise (logs, CI), so a long sweep is never silent and never floods a log."""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    def __init__(self, stream: TextIO, interval_s: float | None = None) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.interval_s = interval_s if interval_s is not None else (0.1 if self.tty else 5.0)
        self.label = ""
        self.goal = ""
        self.started = 0.0
        self.shown = 0.0
        self.width = 0

    def start(self, label: str, goal: str) -> None:
        self.label, self.goal = label, goal
        self.started = self.shown = time.monotonic()
        if not self.tty:
            self._write(f"{label}: started ({goal})")

    def update(self, done: int, errors: int, in_flight: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.shown < self.interval_s:
            return
        self.shown = now
        self._write(
            f"{self.label}: {done} done, {errors} errors, {in_flight} in flight, "
            f"{now - self.started:.1f} s of {self.goal}"
        )

    def end(self, done: int, errors: int) -> None:
        self.update(done, errors, 0, force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0

    def say(self, line: str) -> None:
        """A line of its own (between levels): never overwritten."""
        if self.tty and self.width:
            self.stream.write("\n")
            self.width = 0
        self.stream.write(line + "\n")
        self.stream.flush()

    def _write(self, line: str) -> None:
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
