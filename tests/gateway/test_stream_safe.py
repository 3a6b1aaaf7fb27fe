"""Text is normalized (NFC) in time linear in its length, whatever combining marks it holds."""

from __future__ import annotations

import sys
import unicodedata

import pytest

from appliance.gateway.request import CGJ, MAX_NON_STARTERS, nfc, non_starters


def _longest_run(text: str) -> int:
    longest = run = 0
    for c in unicodedata.normalize("NFD", text):
        run = run + 1 if unicodedata.combining(c) else 0
        longest = max(longest, run)
    return longest


def test_a_long_run_of_combining_marks_is_cut_as_uax15_does() -> None:
    """CPython sorts a run of combining marks by insertion: 64,000 of them held the event loop
    for seconds in one normalize call. Past 30 in a row, a COMBINING GRAPHEME JOINER goes after
    each 30 (UAX #15's Stream-Safe Text Format), which bounds every run."""
    marks = "\u0301\u0316" * 2000
    text = "a" + marks + " b\u0301"
    out = nfc(text)
    assert _longest_run(out) <= MAX_NON_STARTERS
    cut = CGJ.join(marks[i : i + MAX_NON_STARTERS] for i in range(0, len(marks), 30))
    assert out == unicodedata.normalize("NFC", "a" + cut + " b\u0301")


@pytest.mark.parametrize(
    "text",
    [
        "plain",
        "e\u0301 caf\u00e9",
        "\u0412\u0435\u0301\u0440\u0430",
        "\u1100\u1161\u11a8",  # Hangul jamo compose
        "a" + "\u0301" * MAX_NON_STARTERS + "b",  # 30 in a row: no joiner
        "\u0f73" * 3,  # decomposes into two non-starters each
        "\U0001d15e\U0001d165" + "x",
    ],
)
def test_text_with_short_runs_is_plain_nfc(text: str) -> None:
    assert nfc(text) == unicodedata.normalize("NFC", text)


def test_the_table_knows_every_non_starter() -> None:
    """Every character of nonzero combining class, or whose canonical decomposition starts with
    one, in every plane (the table covers the planes that hold them)."""
    table = non_starters()
    for cp in range(sys.maxunicode + 1):
        c = chr(cp)
        decomposed = unicodedata.normalize("NFD", c)
        expected = bool(unicodedata.combining(c) or unicodedata.combining(decomposed[0]))
        assert (cp < len(table) and bool(table[cp])) == expected, hex(cp)
