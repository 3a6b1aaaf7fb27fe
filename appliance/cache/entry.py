"""A cached answer and its compact binary encoding for Redis.

Layout (little-endian): version u8, finish_reason u8 (1 stop, 2 length), prompt_tokens u32,
completion_tokens u32, token count u32, token ids int32 × count, then the UTF-8 text to the end.
"""

from __future__ import annotations

import array
import struct
import sys
from dataclasses import dataclass

VERSION = 1
_HEADER = struct.Struct("<BBIII")
# Only complete answers are cached: ended by a stop condition or by max_tokens.
FINISH_CODES = {"stop": 1, "length": 2}
_FINISH_NAMES = {code: name for name, code in FINISH_CODES.items()}
# An int object of a token id as the allocator hands it out (28 bytes, in blocks of 16).
_INT_BYTES = 32
# The answer object, its attribute dict and two ints, and what a store keeps beside it per entry
# (its key, the tuple of expiry and labels, the ordered dict's slot).
_OBJECT_BYTES = 512


class CorruptEntryError(ValueError):
    """Bytes in the cache that are not an entry of this version (treated as a miss)."""


@dataclass(frozen=True)
class CachedAnswer:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # a key of FINISH_CODES
    prompt_tokens: int
    completion_tokens: int

    def size(self) -> int:
        """Bytes the process holds for this entry (what L1's and the semantic index's byte
        bounds count): the object, its text as Python stores it (1, 2 or 4 bytes a character,
        the widest deciding), the tuple of token ids and an int object per id (ids decoded
        from Redis or read from the engine are each their own object)."""
        ids = self.token_ids
        return _OBJECT_BYTES + sys.getsizeof(self.text) + sys.getsizeof(ids) + _INT_BYTES * len(ids)


def encode(answer: CachedAnswer) -> bytes:
    ids = array.array("i", answer.token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    header = _HEADER.pack(
        VERSION,
        FINISH_CODES[answer.finish_reason],
        answer.prompt_tokens,
        answer.completion_tokens,
        len(answer.token_ids),
    )
    return header + ids.tobytes() + answer.text.encode()


def decode(data: bytes) -> CachedAnswer:
    if len(data) < _HEADER.size:
        raise CorruptEntryError("entry shorter than its header")
    version, finish, prompt_tokens, completion, count = _HEADER.unpack_from(data)
    if version != VERSION:
        raise CorruptEntryError(f"entry version {version}, expected {VERSION}")
    if finish not in _FINISH_NAMES:
        raise CorruptEntryError(f"entry finish reason {finish} unknown")
    end = _HEADER.size + 4 * count
    if len(data) < end:
        raise CorruptEntryError("entry truncated")
    ids = array.array("i")
    ids.frombytes(data[_HEADER.size : end])
    if sys.byteorder != "little":
        ids.byteswap()
    try:
        text = data[end:].decode()
    except UnicodeDecodeError as exc:
        raise CorruptEntryError("entry text is not UTF-8") from exc
    return CachedAnswer(text, tuple(ids), _FINISH_NAMES[finish], prompt_tokens, completion)
