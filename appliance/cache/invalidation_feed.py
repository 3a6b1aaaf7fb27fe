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

With a MAC key (`[cache.redis] mac_key_file`, which every gateway has) each message is sealed as the
entries are (seal.py), with its sender's sequence number and clock: a follower drops, counts and
logs (once a minute) a message without a tag or whose tag does not verify, so whatever can write to
Redis cannot empty every gateway's L1; and a replay of a sealed one: one heard already (same sender
and sequence number), or sealed more than REPLAY_WINDOW_S before Redis appended it. Messages
of a gateway of an older version carry no tag: during a rolling upgrade, the invalidations made
through the gateways not yet upgraded do not reach the L1 of those already upgraded (their L1 keeps
such an answer until its TTL): make invalidations through an upgraded gateway, or again once all
are. An older gateway reads a sealed message as before (it ignores the fields it does not know).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from redis.exceptions import RedisError

from appliance.cache.l2 import QUIET_LOG_S, RedisSettings, StreamClient
from appliance.cache.seal import Sealer
from appliance.cache.series import Described, Series
from appliance.logline import Throttled

log = logging.getLogger(__name__)

# (namespace, model, entry or None) -> entries dropped; "" matches any namespace or model.
Apply = Callable[[str, str, bytes | None], int]

BLOCK_MS = 1000  # one XREAD waits this long for a message
# The stream is trimmed to about this many messages; a follower reads up to as many at once.
MAX_LEN = 1000
# An append is one command: past this, the invalidation is reported as not reaching every gateway
# (redis-py's own retries against a dead server would otherwise hold the admin call for seconds).
PUBLISH_BUDGET_S = 2.0
# A sealed message appended to the stream (by Redis's clock) longer than this after its sender
# sealed it (by the sender's clock) is a replay: refused. Clocks of gateways and Redis may differ
# by up to this much.
REPLAY_WINDOW_S = 300.0


@dataclass
class _Counters:
    applied: int = 0  # invalidations made through other gateways and applied here
    cleared: int = 0  # times L1 was emptied: the follower had lost Redis, or fell behind
    errors: int = 0  # times the follower lost Redis
    corrupt: int = 0  # messages that could not be read (skipped)
    refused: int = 0  # messages not sealed with this gateway's key, or replayed (dropped)


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
        # Tells this gateway's own messages apart: it has applied them already.
        self.origin = os.urandom(8).hex()
        self._sealer = Sealer(settings.mac_key) if settings.mac_key else None
        self._sent = 0  # this gateway's messages so far: the sequence number of the last one
        # (sender, sequence number) of the sealed messages heard in the last REPLAY_WINDOW_S, and
        # when Redis appended each (ms, its clock; in stream order).
        self._heard: dict[tuple[str, int], int] = {}
        self._refusals = Throttled(log, QUIET_LOG_S)
        self._own = StreamClient(settings, BLOCK_MS / 1000 + 2.0)
        self._follower: asyncio.Task[None] | None = None
        self.following = False
        self._first_try = asyncio.Event()  # its first read of the stream's end answered or failed
        # start() returned first: the gateway listens, and L1 may take answers whose invalidations
        # come before the position the follower's first read will find.
        self._listening = False
        self.counts = _Counters()

    async def publish(self, namespace: str, model: str, entry: bytes | None) -> None:
        """Raises when Redis does not take it (the caller says the invalidation did not reach
        every gateway)."""
        self._sent += 1
        message = {
            "ns": namespace,
            "model": model,
            "entry": "" if entry is None else entry.hex(),
            "from": self.origin,
            "seq": str(self._sent),
            "at": str(int(time.time() * 1000)),
        }
        if self._sealer is not None:
            message = self._sealer.seal_message(self.stream, message)
        try:
            async with asyncio.timeout(PUBLISH_BUDGET_S):
                await self._own.client.xadd(
                    self.stream,
                    message,  # type: ignore[arg-type]
                    maxlen=MAX_LEN,
                    approximate=True,
                )
        except TimeoutError:
            raise TimeoutError(
                f"redis did not take the message within {PUBLISH_BUDGET_S:g} s"
            ) from None

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
            "l1_feed_refused_messages": c.refused,
        }

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.wait({self._follower}, timeout=1.0)
        await self._own.close()

    def _message(self, message_id: bytes, fields: dict[bytes, bytes]) -> None:
        origin = fields.get(b"from", b"").decode(errors="replace")
        if origin == self.origin:
            return
        if self._sealer is not None and not self._sealer.opens_message(self.stream, fields):
            why = "its tag does not verify" if b"tag" in fields else "it carries no tag"
            self._refuse(why)
            return
        try:
            namespace, model = fields[b"ns"].decode(), fields[b"model"].decode()
            entry = bytes.fromhex(fields[b"entry"].decode()) if fields[b"entry"] else None
            if self._sealer is not None:
                seq, at = int(fields[b"seq"]), int(fields[b"at"])
                appended = int(message_id.partition(b"-")[0])
        except (KeyError, UnicodeDecodeError, ValueError):
            self.counts.corrupt += 1
            return
        if self._sealer is not None:
            oldest = appended - REPLAY_WINDOW_S * 1000
            if (origin, seq) in self._heard:
                self._refuse("it is a replay of a message heard already")
                return
            if at < oldest:
                self._refuse(
                    f"it was sealed {(appended - at) // 1000} s before redis appended it "
                    "(a replay, or its sender's clock is that far behind redis's)"
                )
                return
            while self._heard and next(iter(self._heard.values())) < oldest:
                del self._heard[next(iter(self._heard))]  # sealed too long ago to come again
            self._heard[origin, seq] = appended
        self._apply(namespace, model, entry)
        self.counts.applied += 1

    def _refuse(self, why: str) -> None:
        self.counts.refused += 1
        self._refusals.warning(
            "an invalidation message on redis stream %s was dropped: %s. Only gateways with "
            "this gateway's [cache.redis] mac_key_file may invalidate its L1; a gateway of an "
            "older version sends no tag (upgrade it)",
            self.stream,
            why,
        )

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
                    last: Any = await client.xrevrange(self.stream, count=1)
                    position = last[0][0].decode() if last else "0-0"
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
