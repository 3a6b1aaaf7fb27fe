"""Messages on a Redis stream every gateway follows, sealed with the gateways' MAC key.

Two streams carry messages that change every gateway's in-process state: the invalidation feed's
(`PREFIX:inv-log`, L1; invalidation_feed.py) and the semantic tier's (`PREFIX:sem-log`, its index:
new entries and invalidations; semantic.py). Whatever can write to Redis can append to them.

Each message carries its sender's id, sequence number and clock (fields `from`, `seq`, `at`). With
a MAC key (`[cache.redis] mac_key_file`, which every gateway has) it is sealed as the entries are
(seal.py), and a follower drops, counts and logs (once per QUIET_LOG_S) a message without a tag or
whose tag does not verify; and a replay of a sealed one: one heard already (same sender and
sequence number), or sealed more than REPLAY_WINDOW_S before Redis appended it. Without a key every
message is taken, as before messages were sealed.

Rolling upgrade, decided: messages of a gateway of a version that did not seal them carry no tag,
and the upgraded gateways drop them (accepting unsealed messages would keep the hole open). While
the fleet is mixed, what a gateway not yet upgraded announces does not reach the upgraded ones
(each stream's module says what that leaves behind): make invalidations through an upgraded
gateway, or again once all are. An older gateway reads a sealed message as before (it ignores the
fields it does not know).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping

import redis.asyncio as redis

from appliance.cache.l2 import QUIET_LOG_S
from appliance.cache.seal import MESSAGE_TAG, Sealer
from appliance.logline import Throttled

# A sealed message appended to the stream (by Redis's clock) longer than this after its sender
# sealed it (by the sender's clock) is a replay: refused. Clocks of gateways and Redis may differ
# by up to this much.
REPLAY_WINDOW_S = 300.0
# An append is one command: past this, the message is reported as not reaching every gateway
# (redis-py's own retries against a dead server would otherwise hold the admin call for seconds).
PUBLISH_BUDGET_S = 2.0


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
        # (sender, sequence number) of the sealed messages heard in the last REPLAY_WINDOW_S, and
        # when Redis appended each (ms, its clock; in stream order).
        self._heard: dict[tuple[str, int], int] = {}
        self._refusals = Throttled(logger, QUIET_LOG_S)
        self._what = what
        self._power = power

    def seal(self, fields: Mapping[str, str | bytes]) -> dict[str, str | bytes]:
        """The message to append: `fields` with this gateway's id, sequence number and clock,
        and with a key its tag."""
        self._sent += 1
        message = {
            **fields,
            "from": self.origin,
            "seq": str(self._sent),
            "at": str(int(time.time() * 1000)),
        }
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
                await client.xadd(
                    self.stream,
                    self.seal(fields),  # type: ignore[arg-type]
                    maxlen=max_len,
                    approximate=True,
                )
        except TimeoutError:
            raise TimeoutError(
                f"redis did not take the message within {PUBLISH_BUDGET_S:g} s"
            ) from None

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
        appended = int(message_id.partition(b"-")[0])
        oldest = appended - REPLAY_WINDOW_S * 1000
        if (origin, seq) in self._heard:
            return self._refuse("it is a replay of a message heard already")
        if at < oldest:
            return self._refuse(
                f"it was sealed {(appended - at) // 1000} s before redis appended it "
                "(a replay, or its sender's clock is that far behind redis's)"
            )
        while self._heard and next(iter(self._heard.values())) < oldest:
            del self._heard[next(iter(self._heard))]  # sealed too long ago to come again
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
