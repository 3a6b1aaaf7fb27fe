"""Stop strings over streamed text.

A stop string can straddle two deltas, so the tail of the text that could still become one is held
back until the next delta decides; the client never sees text that a stop string later removes.
"""

from __future__ import annotations


class StopMatcher:
    """Feeds deltas, returns what is safe to emit, and says when a stop string was reached."""

    __slots__ = ("_held", "_longest", "_stops", "stopped")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Text to emit now; once a stop string is found, the text before it and nothing after."""
        if not self._stops:
            return delta
        if self.stopped or not delta:
            return ""
        text = self._held + delta
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back tail at the end of the stream: no stop string completed it."""
        text, self._held = self._held, ""
        return "" if self.stopped else text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
