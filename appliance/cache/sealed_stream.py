"""Messages on a Redis stream every gateway follows, sealed with the gateways' MAC key.

Two streams carry messages that change every gateway's in-process state: the invalidation feed's
(`PREFIX:inv-log`, L1; invalidation_feed.py) and the semantic tier's (`PREFIX:sem-log`, its index:
new entries and invalidations; semantic.py). Whatever can write to Redis can append to them.

Each message carries its sender's id, sequence number and Redis's clock when it was sealed (fields
`from`, `seq`, `at`: the sender asks Redis's TIME), and is appended under a stream id of that
millisecond (`AT-*`). With a MAC key (`[cache.redis] mac_key_file`, which every gateway has) it is
sealed as the entries are (seal.py), and a follower drops, counts and logs (once per QUIET_LOG_S)
a message without a tag or whose tag does not verify; and a replay of a sealed one: one whose
stream id is not of the millisecond it was sealed in (a copy appended again), or one heard already
(same sender and sequence number; a copy appended within the same millisecond). A follower reads
from where the stream ends when it starts, and never from before Redis's clock then: a copy
appended under its original id (after the stream was deleted) comes before that point, so a
gateway that starts refuses the messages sealed before it as the others do. Without a key every
message is taken, as before messages were sealed.

Rolling upgrade, decided: messages of a gateway of a version that did not seal them carry no tag,
and those of a version that sealed them by its own clock are not of their stream id's millisecond:
the upgraded gateways drop both (accepting them would keep the hole open). While the fleet is
mixed, what a gateway not yet upgraded announces does not reach the upgraded ones (each stream's
module says what that leaves behind): make invalidations through an upgraded gateway, or again once
all are. An older gateway reads a sealed message as before (it ignores the fields it does not
know, and its `at` is the millisecond Redis appended it).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

import redis.asyncio as redis
from redis.exceptions import ResponseError

from appliance.cache.l2 import QUIET_LOG_S
from appliance.cache.seal import MESSAGE_TAG, Sealer
from appliance.logline import Throttled

# An append is one command: past this, the message is reported as not reaching every gateway
# (redis-py's own retries against a dead server would otherwise hold the admin call for seconds).
PUBLISH_BUDGET_S = 2.0
# Appends refused because another gateway appended in a later millisecond since this one asked
# Redis's clock, before the message is reported as not taken.
APPEND_TRIES = 3
_LAST_SEQ = 2**64 - 1  # the highest sequence part of a stream id


async def redis_ms(client: redis.Redis) -> int:
    """Redis's clock (TIME), in milliseconds: the millisecond of a stream id it would give now."""
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _stream_id(text: bytes | str) -> tuple[int, int]:
    ms, _, seq = (text.decode() if isinstance(text, bytes) else text).partition("-")
    return int(ms), int(seq or 0)


class SealedStream:
    """One stream's messages: sealed as this gateway sends them, checked as it reads them."""

    def __init__(
        self, stream: str, mac_key: bytes | None, logger: logging.Logger, what: str, power: str
    ) -> None:
        """`what` names a message ("an invalidation message") and `power` what a gateway may do
        with one ("invalidate its L1") in the line that says one was dropped."""
        self.stream = stream
        # Tells this gateway's own messages apart.
        self.origin = os.urandom(8).hex()
        self.refused = 0  # messages dropped: not sealed with this gateway's key, or replayed
        self._sealer = Sealer(mac_key) if mac_key else None
        self._sent = 0  # this gateway's messages so far: the sequence number of the last one
        # (sender, sequence number) of the sealed messages heard in the millisecond of the last
        # one, and that millisecond (Redis's clock; in stream order).
        self._heard: dict[tuple[str, int], int] = {}
        self._refusals = Throttled(logger, QUIET_LOG_S)
        self._what = what
        self._power = power

    def seal(self, fields: Mapping[str, str | bytes], at: int) -> dict[str, str | bytes]:
        """The message to append under a stream id of millisecond `at` (Redis's clock, asked
        just before: redis_ms): `fields` with this gateway's id, sequence number and `at`, and
        with a key its tag."""
        self._sent += 1
        message = {**fields, "from": self.origin, "seq": str(self._sent), "at": str(at)}
        if self._sealer is not None:
            message = self._sealer.seal_message(self.stream, message)
        return message

    async def append(
        self, client: redis.Redis, fields: Mapping[str, str | bytes], max_len: int
    ) -> None:
        """Seals `fields` and appends them to the stream (trimmed to about `max_len`); raises
        TimeoutError when Redis has not taken them within PUBLISH_BUDGET_S, or RedisError."""
        try:
            async with asyncio.timeout(PUBLISH_BUDGET_S):
                for tries_left in reversed(range(APPEND_TRIES)):
                    at = await redis_ms(client)
                    try:
                        await client.xadd(
                            self.stream,
                            self.seal(fields, at),  # type: ignore[arg-type]
                            id=f"{at}-*",
                            maxlen=max_len,
                            approximate=True,
                        )
                        return
                    except ResponseError:
                        # Another gateway appended in a later millisecond since TIME answered
                        # (or the stream's last id is ahead of Redis's clock): ask it again.
                        if not tries_left:
                            raise
        except TimeoutError:
            raise TimeoutError(
                f"redis did not take the message within {PUBLISH_BUDGET_S:g} s"
            ) from None

    async def start_position(self, client: redis.Redis) -> str:
        """Where a follower that starts (or starts over) reads from: the stream's end, and never
        before Redis's clock now. Returns once Redis's clock has passed that millisecond, so a
        message sealed later comes after the position, and one sealed before it, before."""
        last: Any = await client.xrevrange(self.stream, count=1)
        now = await redis_ms(client)
        while await redis_ms(client) <= now:
            await asyncio.sleep(0.001)
        end = _stream_id(last[0][0]) if last else (0, 0)
        ms, seq = max(end, (now, _LAST_SEQ))
        return f"{ms}-{seq}"

    def admits(self, message_id: bytes, fields: Mapping[bytes, bytes]) -> bool:
        """Whether a message read from the stream may be applied: without a key, always; with
        one, when its tag verifies and it is no replay (a refusal is counted and logged).
        ValueError or KeyError: its tag verifies but its `seq`, `at` or id cannot be read."""
        if self._sealer is None:
            return True
        if not self._sealer.opens_message(self.stream, fields):
            why = "its tag does not verify" if MESSAGE_TAG in fields else "it carries no tag"
            return self._refuse(why)
        origin = fields.get(b"from", b"").decode(errors="replace")
        seq, at = int(fields[b"seq"]), int(fields[b"at"])
        appended = _stream_id(message_id)[0]
        if at != appended:
            return self._refuse(
                f"redis appended it {(appended - at) / 1000:g} s after its sender sealed it "
                "(a replay, or a gateway of an older version sealed it by its own clock)"
            )
        if (origin, seq) in self._heard:
            return self._refuse("it is a replay of a message heard already")
        while self._heard and next(iter(self._heard.values())) < appended:
            # A copy of an earlier millisecond's message would be refused by its id.
            del self._heard[next(iter(self._heard))]
        self._heard[origin, seq] = appended
        return True

    def _refuse(self, why: str) -> bool:
        self.refused += 1
        self._refusals.warning(
            "%s on redis stream %s was dropped: %s. Only gateways with this gateway's "
            "[cache.redis] mac_key_file may %s; a gateway of an older version sends no tag "
            "(upgrade it)",
            self._what,
            self.stream,
            why,
            self._power,
        )
        return False
