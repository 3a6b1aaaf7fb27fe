"""Open `ModelStreamInfer` streams kept between requests, each carrying one request at a time.

Opening a stream costs both ends a call set-up (headers, a handler, the server's per-stream state)
before the request itself can go out; a stream that stays open takes the next request as one message.
A request leaves its stream here only after its final response, so nothing of it can arrive on the
stream afterwards; a request that ends any other way (cancelled, failed, out of time) takes its stream
down with it. One request per stream also keeps an in-band error attributable: Triton clears the id
of an error the backend reports, so on a stream shared by several requests it would name none.

An open stream holds Triton's graceful stop: Triton waits for its streams to close, idle ones too (up
to its exit timeout); our engine server ends an idle stream at once. So a stream is kept for `idle_s`
at most, and the owner closes every kept stream as soon as the server stops answering readiness
checks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Stream(Protocol):
    def done(self) -> bool: ...

    def cancel(self) -> bool: ...


S = TypeVar("S", bound=Stream)


class StreamPool(Generic[S]):
    def __init__(self, open_stream: Callable[[], S], keep: int, idle_s: float) -> None:
        self._open = open_stream
        self._keep = keep
        self._idle_s = idle_s
        self._idle: list[tuple[S, asyncio.TimerHandle]] = []

    def __len__(self) -> int:
        return len(self._idle)

    def take(self) -> tuple[S, bool]:
        """A stream for one request, and whether it carried one before (a kept stream may have
        ended since, e.g. the server restarted: the caller retries on a new one if it fails before
        answering)."""
        while self._idle:
            stream, expiry = self._idle.pop()
            expiry.cancel()
            if not stream.done():
                return stream, True
        return self._open(), False

    def new(self) -> S:
        return self._open()

    def give_back(self, stream: S) -> None:
        """After its request's final response: kept for the next request, or closed."""
        if stream.done() or len(self._idle) >= self._keep:
            stream.cancel()
            return
        expiry = asyncio.get_running_loop().call_later(self._idle_s, self._expire, stream)
        self._idle.append((stream, expiry))

    def _expire(self, stream: S) -> None:
        for i, (kept, _) in enumerate(self._idle):
            if kept is stream:
                del self._idle[i]
                stream.cancel()
                return

    def close_idle(self) -> None:
        """Closes every kept stream (the server stops, or the owner does)."""
        idle, self._idle = self._idle, []
        for stream, expiry in idle:
            expiry.cancel()
            stream.cancel()
