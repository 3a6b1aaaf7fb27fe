"""Authenticated Redis entries: a keyed BLAKE2b tag over the Redis key and the value.

Redis is shared by every gateway of the appliance and reachable by whatever can reach its port; an
entry written there by anything but a gateway (or moved to another tenant's key) must never be served.
Each value is stored as TAG || BODY with TAG = BLAKE2b-128(len(key) || key || BODY) keyed with a
secret every gateway of the appliance shares (`[cache.redis] mac_key_file`). A value whose tag does
not verify is a counted miss (`l2_forged_entries`), never an answer.

A message on a Redis stream is sealed the same way, the stream's name standing for the key and the
BODY being its fields but the tag, by name, each name and value length-prefixed; the tag is the
field `tag` (hex), so a reader that does not check it reads the other fields as before.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

TAG_BYTES = 16
_PERSON = b"appliance-l2-v1"
# The field of a stream message that holds its tag.
MESSAGE_TAG = b"tag"


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

    def seal_message(
        self, stream: str, fields: Mapping[str, str | bytes]
    ) -> dict[str, str | bytes]:
        """The fields of a message for `stream` (a text value as Redis stores it: UTF-8), with
        its tag added."""
        body = _fields(
            {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}
        )
        return {**fields, MESSAGE_TAG.decode(): self._tag(stream.encode(), body).hex()}

    def opens_message(self, stream: str, fields: Mapping[bytes, bytes]) -> bool:
        """Whether a message read from `stream` carries the tag of its other fields."""
        try:
            tag = bytes.fromhex(fields[MESSAGE_TAG].decode("ascii"))
        except (KeyError, UnicodeDecodeError, ValueError):
            return False
        body = _fields({k: v for k, v in fields.items() if k != MESSAGE_TAG})
        return hmac.compare_digest(tag, self._tag(stream.encode(), body))


def _fields(fields: Mapping[bytes, bytes]) -> bytes:
    """Fields by name, each name and value prefixed by its length: one encoding per message."""
    parts = []
    for name in sorted(fields):
        for part in (name, fields[name]):
            parts += [len(part).to_bytes(4, "little"), part]
    return b"".join(parts)
