"""Messages on a Redis stream every gateway follows, sealed with the gateways' MAC key.

Two streams carry messages that change every gateway's in-process state: the invalidation feed's
(`PREFIX:inv-log`, L1; invalidation_feed.py) and the semantic tier's (`PREFIX:sem-log`, its index:
new entries and invalidations; semantic.py). Whatever can write to Redis can append to them.

Each message carries its sender's id, sequence number and Redis's clock when it was sealed (fields
`from`, `seq`, `at`: the sender asks Redis's TIME), and is appended under a stream id of that
millisecond (`AT-*`). When the stream's last id is ahead of that millisecond (another gateway
appended since TIME answered; Redis's clock went back: a failover to a replica whose clock lags, a
step of its clock), Redis refuses the id, and the message is sealed again with the millisecond
just after the last id and appended under it: `at` is always its id's millisecond. A Redis whose
ACL refuses TIME (one of an older release) is said once per QUIET_LOG_S: `at` is then the later of
this host's clock and that millisecond, and a follower starts from the stream's end. With a MAC key (`[cache.redis] mac_key_file`, which every gateway has) it is
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
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as redis
from redis.asyncio.client import Pipeline
from redis.exceptions import NoPermissionError, ResponseError

from appliance.cache.l2 import QUIET_LOG_S
from appliance.cache.seal import MESSAGE_TAG, Sealer
from appliance.logline import Throttled

# An append is one command: past this, the message is reported as not reaching every gateway
# (redis-py's own retries against a dead server would otherwise hold the admin call for seconds).
PUBLISH_BUDGET_S = 2.0
# Appends refused because the stream's last id was ahead of the millisecond asked (another gateway
# appended in a later one since TIME answered, or Redis's clock went back), before the message is
# reported as not taken: each retry appends just after the last id.
APPEND_TRIES = 5
# What Redis says when an XADD's explicit id is not after the stream's last one.
_BEHIND_TOP = "equal or smaller than the target stream top item"
_LAST_SEQ = 2**64 - 1  # the highest sequence part of a stream id


async def redis_ms(client: redis.Redis) -> int:
    """Redis's clock (TIME), in milliseconds: the millisecond of a stream id it would give now."""
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _local_ms() -> int:
    """This host's clock, in milliseconds: where Redis refuses TIME, a message is appended no
    earlier than it (a stream deleted, or trimmed empty, then still comes after every position a
    follower read)."""
    return time.time_ns() // 1_000_000


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
        self._no_time = Throttled(logger, QUIET_LOG_S)
        self._no_time_until = 0.0  # monotonic: until then, TIME is not asked (refused)
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
        self,
        client: redis.Redis,
        fields: Mapping[str, str | bytes],
        max_len: int,
        also: Callable[[Pipeline], object] | None = None,
    ) -> str:
        """Seals `fields` and appends them to the stream (trimmed to about `max_len`), after the
        commands `also` adds to the same round trip (they are not sent again on a retry); returns
        the message's id. Raises TimeoutError when Redis has not taken them within
        PUBLISH_BUDGET_S, or RedisError.

        The id's millisecond is Redis's clock (TIME), or just after the stream's last id when
        that is ahead of the clock: another gateway appended in a later millisecond since TIME
        answered, or the clock went back (a failover to a replica whose clock lags, a step of
        its clock). The message is sealed with the millisecond it is appended at."""
        try:
            async with asyncio.timeout(PUBLISH_BUDGET_S):
                at = await self._next_ms(client, behind_top=False)
                for tries_left in reversed(range(APPEND_TRIES)):
                    # A pipeline only with `also`: its errors quote every command's arguments.
                    pipe: Any = client if also is None else client.pipeline(transaction=False)
                    if also is not None:
                        also(pipe)
                    sent = pipe.xadd(
                        self.stream,
                        self.seal(fields, at),
                        id=f"{at}-*",
                        maxlen=max_len,
                        approximate=True,
                    )
                    try:
                        done = [await sent] if also is None else await pipe.execute()
                    except ResponseError as exc:
                        if _BEHIND_TOP not in str(exc) or not tries_left:
                            raise
                        also = None  # they were taken
                        at = await self._next_ms(client, behind_top=True)
                        continue
                    added = done[-1]
                    return added.decode() if isinstance(added, bytes) else str(added)
        except TimeoutError:
            raise TimeoutError(
                f"redis did not take the message within {PUBLISH_BUDGET_S:g} s"
            ) from None
        raise AssertionError("unreachable: the last try returns or raises")

    async def _next_ms(self, client: redis.Redis, behind_top: bool) -> int:
        """The millisecond to append at: Redis's clock, and after the stream's last id where
        that is known to be ahead (`behind_top`: an append was refused) or TIME is refused (then
        no earlier than this host's clock)."""
        now = await self._time(client)
        if now is not None and not behind_top:
            return now
        return max(now or _local_ms(), await self._top_ms(client) + 1)

    async def _time(self, client: redis.Redis) -> int | None:
        """Redis's clock (redis_ms), or None while Redis refuses TIME to this gateway's ACL user
        (an ACL of an older release: said once per QUIET_LOG_S, asked again after that)."""
        if time.monotonic() < self._no_time_until:
            return None
        try:
            return await redis_ms(client)
        except NoPermissionError as exc:
            self._no_time_until = time.monotonic() + QUIET_LOG_S
            self._no_time.warning(
                "redis refused TIME on stream %s (%s): messages are appended just after the "
                "stream's last id and a follower starts from the stream's end, so a copy of a "
                "message appended again after the stream was deleted is not refused; give the "
                "ACL user [cache.redis] username names the rules the ansible redis role writes "
                "to users.acl (+time)",
                self.stream,
                exc,
            )
            return None

    async def _top_ms(self, client: redis.Redis) -> int:
        """The millisecond of the stream's last id; 0 for an empty stream."""
        last: Any = await client.xrevrange(self.stream, count=1)
        return _stream_id(last[0][0])[0] if last else 0

    async def start_position(self, client: redis.Redis) -> str:
        """Where a follower that starts (or starts over) reads from: the stream's end, and never
        before Redis's clock now. Returns once Redis's clock has passed that millisecond, so a
        message sealed later comes after the position, and one sealed before it, before. While
        Redis refuses TIME: the stream's end."""
        last: Any = await client.xrevrange(self.stream, count=1)
        end = _stream_id(last[0][0]) if last else (0, 0)
        now = await self._time(client)
        if now is not None:
            while await redis_ms(client) <= now:
                await asyncio.sleep(0.001)
            end = max(end, (now, _LAST_SEQ))
        return f"{end[0]}-{end[1]}"

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
