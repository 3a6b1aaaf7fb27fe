"""Invalidations made through one gateway reach every gateway's L1.

L1 lives in each gateway's process: an invalidation sent to one gateway (CacheAdmin.Invalidate, the
CLI) drops that gateway's copies and the shared Redis entries, and the other gateways would go on
answering the dropped question from their L1 until its TTL. So the gateway that invalidates appends
one message to a Redis stream once the shared entries are unlinked, and every gateway follows the
stream with a blocking XREAD and drops the same entries from its own L1.

A gateway that loses Redis may miss messages. L1 keeps answering meanwhile (Redis is never a
dependency), and when the follower hears Redis again it empties L1: what it may have missed is
unknown, and the entries come back from L2 on the next requests. So does a follower that fell so
far behind that the stream's trimming may have dropped messages it had not read. A gateway starts
listening once its follower has read where the stream ends: an invalidation published before that
point found an L1 with nothing in it. One that stops waiting for that read (2 s) empties L1 when the
read comes: the answers L1 took meanwhile may have been invalidated before the position it found.

The messages are sealed with the gateways' MAC key, and a follower drops one without a valid tag or
replayed (sealed_stream.py), so whatever can write to Redis cannot empty every gateway's L1. During a
rolling upgrade from a version that did not seal them (sealed_stream.py says what to do), an
invalidation made through a gateway not yet upgraded does not reach the upgraded ones' L1, which
keeps such an answer until its TTL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from redis.exceptions import RedisError

from appliance.cache.l2 import RedisSettings, StreamClient
from appliance.cache.sealed_stream import SealedStream
from appliance.cache.series import Described, Series

log = logging.getLogger(__name__)

# (namespace, model, entry or None) -> entries dropped; "" matches any namespace or model.
Apply = Callable[[str, str, bytes | None], int]

BLOCK_MS = 1000  # one XREAD waits this long for a message
# The stream is trimmed to about this many messages; a follower reads up to as many at once.
MAX_LEN = 1000


@dataclass
class _Counters:
    applied: int = 0  # invalidations made through other gateways and applied here
    cleared: int = 0  # times L1 was emptied: the follower had lost Redis, or fell behind
    errors: int = 0  # times the follower lost Redis
    corrupt: int = 0  # messages that could not be read (skipped)


class InvalidationFeed:
    """Publishes this gateway's invalidations and applies everyone else's."""

    series: ClassVar[Described] = {
        "l1_feed_in_step": Series(
            "1 while L1 follows the other gateways' invalidations on Redis.", gauge=True
        ),
        "l1_peer_invalidations": (
            "Invalidations made through other gateways and applied to this gateway's L1."
        ),
        "l1_feed_clears": (
            "Times L1 was emptied on hearing Redis again, or after falling behind the stream's "
            "trimming (invalidations may have been missed)."
        ),
        "l1_feed_errors": "Times L1 lost the Redis stream of the other gateways' invalidations.",
        "l1_feed_corrupt_messages": (
            "Invalidation messages on the Redis stream that could not be read (skipped)."
        ),
        "l1_feed_refused_messages": (
            "Invalidation messages on the Redis stream without this gateway's MAC, or replayed "
            "(dropped)."
        ),
    }

    def __init__(self, settings: RedisSettings, apply: Apply) -> None:
        self.stream = f"{settings.key_prefix}:inv-log"
        self._apply = apply
        self._retry_s = settings.breaker_reset_s
        self._seals = SealedStream(
            self.stream, settings.mac_key, log, "an invalidation message", "invalidate its L1"
        )
        # Tells this gateway's own messages apart: it has applied them already.
        self.origin = self._seals.origin
        self._own = StreamClient(settings, BLOCK_MS / 1000 + 2.0)
        self._follower: asyncio.Task[None] | None = None
        self.following = False
        self._first_try = asyncio.Event()  # its first read of the stream's end answered or failed
        # start() returned first: the gateway listens, and L1 may take answers whose invalidations
        # come before the position the follower's first read will find.
        self._listening = False
        # close() began: a read that ignored its cancellation ends when close() shuts the client
        # under it, which is not Redis lost.
        self._closing = False
        self.counts = _Counters()

    async def publish(self, namespace: str, model: str, entry: bytes | None) -> None:
        """Raises when Redis does not take it (the caller says the invalidation did not reach
        every gateway)."""
        fields = {"ns": namespace, "model": model, "entry": "" if entry is None else entry.hex()}
        await self._seals.append(self._own.client, fields, MAX_LEN)

    async def start(self, wait_s: float = 2.0) -> None:
        """Starts following; returns once the follower has read where the stream ends, has
        failed to (it empties L1 when it hears Redis), or after `wait_s`."""
        if self._follower is None:
            self._follower = asyncio.get_running_loop().create_task(self._follow())
        try:
            async with asyncio.timeout(wait_s):
                await self._first_try.wait()
        except TimeoutError:
            pass
        self._listening = True

    def counters(self) -> dict[str, int]:
        c = self.counts
        return {
            "l1_feed_in_step": int(self.following),
            "l1_peer_invalidations": c.applied,
            "l1_feed_clears": c.cleared,
            "l1_feed_errors": c.errors,
            "l1_feed_corrupt_messages": c.corrupt,
            "l1_feed_refused_messages": self._seals.refused,
        }

    async def close(self) -> None:
        self._closing = True
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.wait({self._follower}, timeout=1.0)
        await self._own.close()

    def _message(self, message_id: bytes, fields: dict[bytes, bytes]) -> None:
        origin = fields.get(b"from", b"").decode(errors="replace")
        if origin == self.origin:
            return
        try:
            if not self._seals.admits(message_id, fields):
                return
            namespace, model = fields[b"ns"].decode(), fields[b"model"].decode()
            entry = bytes.fromhex(fields[b"entry"].decode()) if fields[b"entry"] else None
        except (KeyError, UnicodeDecodeError, ValueError):
            self.counts.corrupt += 1
            return
        self._apply(namespace, model, entry)
        self.counts.applied += 1

    def _batch(self, messages: list[tuple[bytes, dict[bytes, bytes]]]) -> str:
        """Applies one read's messages; returns the position after them. A full read may mean
        the follower was MAX_LEN or more behind, and trimming (which keeps about MAX_LEN) may
        then have dropped messages between its position and the first one returned."""
        for message_id, fields in messages:
            self._message(message_id, fields)
        if len(messages) >= MAX_LEN:
            self._clear("it fell behind the stream's trimming")
        return messages[-1][0].decode()

    def _clear(self, why: str) -> None:
        dropped = self._apply("", "", None)
        self.counts.cleared += 1
        log.info(
            "L1 emptied (%d entries): %s, so other gateways' invalidations may have been missed",
            dropped,
            why,
        )

    async def _follow(self) -> None:
        """From the stream's end at start (L1 is empty then, unless start() stopped waiting for
        this read); after a fault, from the end again with L1 emptied."""
        client = self._own.client
        position: str | None = None
        lost = False
        while True:
            try:
                if position is None:
                    position = await self._seals.start_position(client)
                    if lost:
                        self._clear("it hears redis again")
                        lost = False
                    elif self._listening and not self._first_try.is_set():
                        self._clear("the gateway was listening before the follower read the stream")
                    self.following = True
                    self._first_try.set()
                reply: Any = await client.xread(
                    {self.stream: position}, count=MAX_LEN, block=BLOCK_MS
                )
                for _, messages in reply or ():
                    if messages:
                        position = self._batch(messages)
            except Exception as exc:  # Redis's faults, and any other: the follower never dies
                if self._closing:
                    return
                self._first_try.set()
                self.following = False
                position = None
                self.counts.errors += 1
                if not isinstance(exc, RedisError | OSError | TimeoutError):
                    log.exception("L1's invalidation follower failed; starting over")
                if not lost:
                    log.warning(
                        "L1 lost redis (%s): other gateways' invalidations do not reach it "
                        "until back",
                        exc,
                    )
                    lost = True
                await asyncio.sleep(self._retry_s)
