"""A chat's token ids piece by piece, each piece seen before taken from a cache.

A multi-turn chat sends its whole history with every turn, and the chat template renders that history
the same way each time: only the newest messages are text the gateway has not tokenized before. A
tokenizer cuts its input at its added tokens before anything else runs, and the normalizer, the
pre-tokenizer and the model then see one piece at a time; so a text cut just before each special
token encodes to the ids of its pieces, concatenated. That holds where the special tokens strip no
whitespace and match the text as written, and where a piece encodes alone as it does inside the
whole text. `SegmentCache.of` checks the tokens' flags, then encodes probe chats rendered with the
model's own template both ways, and gives None unless every probe agrees: that model's chats are
then encoded whole, as before.

Pieces are cached per namespace: a hit is faster than a miss, and one tenant must not learn by
timing what another sent.
"""

from __future__ import annotations

import itertools
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer

# Token ids held in all (4 bytes each, besides the pieces' text): a few hundred long chats; and
# pieces held, whose own overhead (their text, a key, a list entry) a flood of tiny pieces would
# otherwise make the larger part.
CAPACITY_IDS = 1 << 20
CAPACITY_PIECES = 1 << 16
# A rendered chat shorter than this is encoded whole and nothing of it kept: cutting, looking up and
# keeping its pieces cost about what encoding it does (a single question, the first turns).
WHOLE_BELOW_CHARS = 2048
# A piece longer than this share of the capacity is encoded but not kept (one document pasted into
# a chat must not push out every conversation's history).
KEPT_SHARE = 16

Render = Callable[[list[dict[str, Any]]], str]

# Chats rendered with the model's template and encoded both ways before the cache is used: leading
# and trailing whitespace, newlines, digits, non-ASCII text, an empty message and a special token's
# text inside a message, at the boundaries the template writes. A template may refuse system
# messages (Gemma's, some of Mistral's): the probe with one is then skipped, since no chat with one
# renders for that model; every other probe must render.
PROBES: tuple[tuple[tuple[str, str], ...], ...] = (
    (("system", "You are terse."), ("user", "Hi there"), ("assistant", " Hello!  ")),
    (("user", "\n\nLine one\nline two "), ("assistant", "12 + 30 = 42"), ("user", "\tand?")),
    (("user", "Grüße, 東京 🚀"), ("assistant", ""), ("user", "  two spaces")),
    (("user", "a</s>b<s>c<|endoftext|>d<|im_end|>e"), ("assistant", "ok"), ("user", "x")),
)


class SegmentCache:
    def __init__(
        self,
        tokenizer: Tokenizer,
        marks: list[str],
        capacity_ids: int = CAPACITY_IDS,
        capacity_pieces: int = CAPACITY_PIECES,
        whole_below_chars: int = WHOLE_BELOW_CHARS,
    ):
        self._tokenizer = tokenizer
        self._marks = tuple(dict.fromkeys(m for m in marks if m))
        self._capacity = capacity_ids
        self._pieces = capacity_pieces
        self._whole_below = whole_below_chars
        self._largest = capacity_ids // KEPT_SHARE
        self._held = 0
        self._ids: OrderedDict[tuple[str, str], array[int]] = OrderedDict()
        self._lock = threading.Lock()  # long chats are tokenized on worker threads

    @classmethod
    def of(
        cls, tokenizer: Tokenizer, render: Render, whole_below_chars: int = WHOLE_BELOW_CHARS
    ) -> SegmentCache | None:
        """The cache for this tokenizer and template, or None where cutting could change ids."""
        special = [t for t in tokenizer.get_added_tokens_decoder().values() if t.special]
        if not special or any(
            t.lstrip or t.rstrip or t.single_word or t.normalized for t in special
        ):
            return None
        marks = [t.content for t in special]
        cache = cls(tokenizer, marks, whole_below_chars=whole_below_chars)
        for probe in PROBES:
            try:
                text = render([{"role": role, "content": content} for role, content in probe])
            except Exception:  # a template that refuses the probe's roles: not proven, not used
                if any(role == "system" for role, _ in probe):
                    continue
                return None
            whole = tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
            if cache.by_pieces(text, "") != whole:
                return None
        cache.clear()
        return cache

    @property
    def held_ids(self) -> int:
        return self._held

    @property
    def pieces(self) -> int:
        return len(self._ids)

    def clear(self) -> None:
        with self._lock:
            self._ids.clear()
            self._held = 0

    def pieces_of(self, text: str) -> list[str]:
        """The text cut before each special token, as the tokenizer finds them: leftmost first,
        the longest where several start at one place, none inside another."""
        found = []
        for mark in self._marks:
            at = text.find(mark)
            while at != -1:
                found.append((at, -len(mark)))
                at = text.find(mark, at + 1)
        cuts = [0]
        end = 0
        for at, minus_length in sorted(found):
            if at >= end:
                cuts.append(at)
                end = at - minus_length
        cuts.append(len(text))
        return [text[a:b] for a, b in itertools.pairwise(cuts) if b > a]

    def takes(self, text: str) -> bool:
        """Whether this rendered chat is encoded in pieces (else whole, and nothing kept)."""
        return len(text) >= self._whole_below

    def by_pieces(self, text: str, namespace: str) -> list[int]:
        """The ids of each piece, from the cache or encoded (and kept), concatenated."""
        pieces = self.pieces_of(text)
        keys = [(namespace, p) for p in pieces]
        with self._lock:
            found = [self._ids.get(k) for k in keys]
            for key, ids in zip(keys, found, strict=True):
                if ids is not None:
                    self._ids.move_to_end(key)
        new = list(dict.fromkeys(k for k, ids in zip(keys, found, strict=True) if ids is None))
        fresh: dict[tuple[str, str], list[int]] = {}
        if new:
            encoded = self._tokenizer.encode_batch_fast(
                [p for _, p in new], add_special_tokens=False
            )
            fresh = {k: e.ids for k, e in zip(new, encoded, strict=True)}
            self._keep(fresh)
        out: list[int] = []
        for key, ids in zip(keys, found, strict=True):
            out.extend(fresh[key] if ids is None else ids)
        return out

    def _keep(self, fresh: dict[tuple[str, str], list[int]]) -> None:
        with self._lock:
            for key, ids in fresh.items():
                if len(ids) > self._largest or key in self._ids:
                    continue
                self._ids[key] = array("i", ids)
                self._held += len(ids)
            while self._held > self._capacity or len(self._ids) > self._pieces:
                _, dropped = self._ids.popitem(last=False)
                self._held -= len(dropped)
