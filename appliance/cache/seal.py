"""Authenticated Redis entries: a keyed BLAKE2b tag over the Redis key and the value.

Redis is shared by every gateway of the appliance and reachable by whatever can reach its port; an
entry written there by anything but a gateway (or moved to another tenant's key) must never be served.
Each value is stored as TAG || BODY with TAG = BLAKE2b-128(len(key) || key || BODY) keyed with a
secret every gateway of the appliance shares (`[cache.redis] mac_key_file`). A value whose tag does
not verify is a counted miss (`l2_forged_entries`), never an answer.
"""

from __future__ import annotations

import hashlib
import hmac

TAG_BYTES = 16
_PERSON = b"appliance-l2-v1"


class Sealer:
    def __init__(self, key: bytes) -> None:
        if not 16 <= len(key) <= 64:  # BLAKE2b takes keys of up to 64 bytes
            raise ValueError(
                f"the cache MAC key has {len(key)} bytes; it needs 16 to 64 "
                "(the configuration derives 32 from mac_key_file)"
            )
        self._key = key

    def _tag(self, redis_key: bytes, body: bytes) -> bytes:
        mac = hashlib.blake2b(digest_size=TAG_BYTES, key=self._key, person=_PERSON)
        mac.update(len(redis_key).to_bytes(4, "little"))
        mac.update(redis_key)
        mac.update(body)
        return mac.digest()

    def seal(self, redis_key: bytes, body: bytes) -> bytes:
        return self._tag(redis_key, body) + body

    def open(self, redis_key: bytes, value: bytes) -> bytes | None:
        """The body of a value sealed under `redis_key`, or None when the tag does not verify."""
        if len(value) < TAG_BYTES:
            return None
        body = value[TAG_BYTES:]
        if not hmac.compare_digest(value[:TAG_BYTES], self._tag(redis_key, body)):
            return None
        return body
