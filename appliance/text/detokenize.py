"""Incremental detokenization from a per-token byte table.

Decoding a growing id list with the tokenizer on every token costs time that grows with the output, and
decoding each token on its own splits multi-byte characters and drops leading spaces (the bug of
Triton's ensemble, tensorrtllm_backend#332). Instead the table maps every token id to the exact bytes it
contributes, built once per model; streaming is then a lookup plus Python's incremental UTF-8 decoder,
which holds back an incomplete character until its last byte arrives. The deltas of a stream therefore
concatenate to `decode_text(ids)` for every id sequence, and that equals the tokenizer's own decode for
every sequence whose bytes are valid UTF-8 (invalid runs become U+FFFD per maximal invalid subpart, as in
`bytes.decode(errors="replace")`, where Hugging Face's ByteFallback decoder replaces every byte of a
run).
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_METASPACE = "▁"

# How a tokenizer removes the space its pre-tokenizer put in front of the first word.
StripRule = Literal["none", "first_char", "first_token"]


class UnsupportedTokenizerError(ValueError):
    """The tokenizer's decoder is not one whose bytes can be tabulated per token."""


@dataclass(frozen=True)
class TokenTable:
    """Bytes per token id; special tokens map to b"" (skipped, like skip_special_tokens=True)."""

    pieces: tuple[bytes, ...]
    # True where the token's bytes start with the space that stands for the metaspace marker.
    starts_with_marker: tuple[bool, ...]
    strip: StripRule

    def bytes_of(self, token_id: int) -> bytes:
        if 0 <= token_id < len(self.pieces):
            return self.pieces[token_id]
        return b""


def _bytes_to_unicode() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-character map used by ByteLevel tokenizers."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kinds(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return list(decoder.get("decoders", []))
    return [decoder]


def build_token_table(tokenizer: Tokenizer) -> TokenTable:
    """Tabulates the bytes of every token for the decoder families of Llama, Mistral, Qwen and GPT-2."""
    spec = json.loads(tokenizer.to_str())
    decoders = _decoder_kinds(spec.get("decoder"))
    types = [d.get("type") for d in decoders]
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    size = max(vocab.values(), default=-1) + 1
    pieces: list[bytes] = [b""] * size
    marker: list[bool] = [False] * size
    added = tokenizer.get_added_tokens_decoder()

    strip: StripRule
    if "ByteLevel" in types:
        table = _bytes_to_unicode()
        strip = "none"

        def to_bytes(piece: str) -> tuple[bytes, bool]:
            return bytes(table[c] for c in piece if c in table), False

    elif "Metaspace" in types or ("Replace" in types and "ByteFallback" in types):
        if "Metaspace" in types:
            meta = next(d for d in decoders if d.get("type") == "Metaspace")
            prepend = meta.get(
                "prepend_scheme", "always" if meta.get("add_prefix_space") else "never"
            )
            strip = "none" if prepend == "never" else "first_token"
        else:
            strip = "first_char" if "Strip" in types else "none"
        byte_fallback = "ByteFallback" in types

        def to_bytes(piece: str) -> tuple[bytes, bool]:
            m = _BYTE_TOKEN.match(piece) if byte_fallback else None
            if m:
                return bytes([int(m.group(1), 16)]), False
            return piece.replace(_METASPACE, " ").encode(), piece.startswith(_METASPACE)

    else:
        raise UnsupportedTokenizerError(
            f"tokenizer decoder {types or ['none']} is not supported for streaming; "
            "supported: ByteLevel (GPT-2/Llama-3 style) and Metaspace/ByteFallback (Llama-2 style)"
        )

    for piece, token_id in vocab.items():
        info = added.get(token_id)
        if info is not None and info.special:
            continue
        if info is not None:
            pieces[token_id] = info.content.encode()
            continue
        pieces[token_id], marker[token_id] = to_bytes(piece)
    return TokenTable(tuple(pieces), tuple(marker), strip)


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas that never split a character."""

    __slots__ = ("_at_start", "_table", "_utf8")

    def __init__(self, table: TokenTable) -> None:
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = True

    def push(self, token_id: int) -> str:
        data = self._table.bytes_of(token_id)
        if not data:
            return ""
        if self._at_start and self._table.strip == "first_token":
            self._at_start = False
            if self._table.starts_with_marker[token_id]:
                data = data[1:]
        text = self._utf8.decode(data)
        if self._at_start and text:
            self._at_start = False
            if self._table.strip == "first_char" and text[0] == " ":
                text = text[1:]
        return text

    def flush(self) -> str:
        """Whatever an unfinished character left behind, as U+FFFD, at the end of the stream."""
        text = self._utf8.decode(b"", final=True)
        if self._at_start and text:
            self._at_start = False
        return text


def decode_text(table: TokenTable, token_ids: list[int]) -> str:
    """The full decode that a stream's deltas add up to."""
    decoder = IncrementalDecoder(table)
    return "".join(decoder.push(t) for t in token_ids) + decoder.flush()
