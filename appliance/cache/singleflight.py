"""Single-flight: concurrent identical misses share one backend request, streamed live to all.

The first request for a key starts a Flight: a task that runs the generation and records every
event. Every request for the key (the first one too) follows the flight: it gets the events recorded
so far, then each new one as it arrives. A follower that goes away just stops following; the
generation is cancelled only when nobody follows it any more, so a leader's client cancelling does
not take the answer away from the followers waiting for it. A request that has not decided yet
whether it wants the answer holds the flight: it counts as a follower until it releases it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Flight(Generic[T]):
    def __init__(self, source: AsyncIterator[T], on_done: Callable[[Flight[T]], None]) -> None:
        self.events: list[T] = []
        self.error: BaseException | None = None
        self.done = False
        self.abandoned = False  # nobody follows it any more; its task is being cancelled
        self.written = False  # its answer was written back to the cache (once per flight)
        # What its leader set before it began (the cache query whose marks its answer's store
        # compares against): a follower's own came later.
        self.owner: object = None
        self.followers = 0
        self._changed = asyncio.Event()
        # Set once the source is being read (its first step has started).
        self.started = asyncio.Event()
        self._on_done = on_done
        self._task = asyncio.get_running_loop().create_task(self._run(source))
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A task cancelled before its first step never runs _run, nor its finally: the flight
        ends here then (it would otherwise stay registered, never done)."""
        if not self.done:
            self.error = asyncio.CancelledError()
            self.done = True
            self._on_done(self)
            self._notify()

    async def _run(self, source: AsyncIterator[T]) -> None:
        self.started.set()
        try:
            async for event in source:
                self.events.append(event)
                self._notify()
        except asyncio.CancelledError:
            self.error = asyncio.CancelledError()
        except Exception as exc:
            self.error = exc
        finally:
            self.done = True
            self._on_done(self)
            self._notify()

    async def wait(self) -> None:
        """Returns once the flight's task has ended, however it ended."""
        await asyncio.gather(self._task, return_exceptions=True)

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def follow(self) -> AsyncGenerator[T, None]:
        """Every event from the first; raises the flight's error at the point it happened."""
        self.followers += 1
        index = 0
        try:
            while True:
                while index < len(self.events):
                    yield self.events[index]
                    index += 1
                if self.done:
                    if self.error is not None:
                        # One error for every follower: each raise starts its traceback anew, so
                        # it holds this follower's frames, not every earlier one's.
                        raise self.error.with_traceback(None)
                    return
                await self._changed.wait()
        finally:
            self.release()

    def hold(self) -> None:
        """Counts the caller as a follower before it follows: the generation goes on for it while
        it decides (a follow of its own counts once more; release the hold after it)."""
        self.followers += 1

    def release(self) -> bool:
        """Ends a hold (or a follow); True when it was the last and the generation is cancelled."""
        self.followers -= 1
        if self.followers == 0 and not self.done:
            self.abandoned = True
            self._task.cancel()
            return True
        return False


class SingleFlight(Generic[T]):
    """The flights in progress, by key."""

    def __init__(self) -> None:
        self._flights: dict[bytes, Flight[T]] = {}
        self.started = 0
        self.joined = 0

    def __len__(self) -> int:
        return len(self._flights)

    def join(
        self,
        key: bytes,
        start: Callable[[], AsyncIterator[T]],
        joinable: Callable[[Flight[T]], bool] = lambda _: True,
    ) -> tuple[Flight[T], bool]:
        """The flight for key, started with `start()` if there is none or the one there is not
        `joinable` (its followers keep it); True when this call led."""
        flight = self._flights.get(key)
        if flight is not None and not flight.done and not flight.abandoned and joinable(flight):
            self.joined += 1
            return flight, False
        self.started += 1
        flight = Flight(start(), lambda f: self._finished(key, f))
        self._flights[key] = flight
        return flight, True

    def _finished(self, key: bytes, flight: Flight[T]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
