"""A regex guide is checked before the cache and the engine, on the event loop: parsed, not
compiled, and at most MAX_REGEX_GUIDE_BYTES long (parsing alternatives that share a long prefix
grows with the square of the text)."""

from __future__ import annotations

import re

import pytest

from appliance.backends.base import Guide
from appliance.gateway.errors import RequestError
from appliance.gateway.request import MAX_REGEX_GUIDE_BYTES, REGEX_PARSER, _guide


def test_a_regex_guide_is_parsed_not_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling a case-insensitive character class folds every character it holds: 3,700 of
    `[\\x00-\\U0010ffff]` in a 64 KiB guide took over a minute of the event loop. The check
    parses the pattern (linear in its text), which refuses what is no regular expression."""

    def compile_refused(*_: object) -> None:
        raise AssertionError("re.compile on the event loop")

    monkeypatch.setattr(re, "compile", compile_refused)
    pattern = "(?i)" + "[\\x00-\\U0010ffff]" * (MAX_REGEX_GUIDE_BYTES // 17)
    assert _guide(Guide("regex", pattern)).text == pattern
    monkeypatch.undo()
    for bad in ("a(b", "a{2,1}", "[z-a]", "a**", "\\1"):
        with pytest.raises(RequestError, match="not a valid regular expression"):
            _guide(Guide("regex", bad))


def test_a_regex_guide_over_its_limit_is_refused_before_it_is_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    half = MAX_REGEX_GUIDE_BYTES // 2
    guide = "a" * half + "|" + "a" * half
    parsed: list[str] = []
    real = REGEX_PARSER.parse

    def recorded(text: str, *args: object) -> object:
        parsed.append(text)
        return real(text, *args)

    monkeypatch.setattr(REGEX_PARSER, "parse", recorded)
    with pytest.raises(RequestError, match=f"at most {MAX_REGEX_GUIDE_BYTES} bytes"):
        _guide(Guide("regex", guide))
    assert guide not in parsed
