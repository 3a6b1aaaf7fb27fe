"""A regex guide is checked in time linear in its text, before the cache and the engine."""

from __future__ import annotations

import re

import pytest

from appliance.backends.base import Guide
from appliance.gateway.errors import RequestError
from appliance.gateway.request import _guide


def test_a_regex_guide_is_parsed_not_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling a case-insensitive character class folds every character it holds: 3,700 of
    `[\\x00-\\U0010ffff]` in a 64 KiB guide took over a minute of the event loop. The check
    parses the pattern (linear in its text), which refuses what is no regular expression."""

    def compile_refused(*_: object) -> None:
        raise AssertionError("re.compile on the event loop")

    monkeypatch.setattr(re, "compile", compile_refused)
    pattern = "(?i)" + "[\\x00-\\U0010ffff]" * 3700
    assert _guide(Guide("regex", pattern)).text == pattern
    monkeypatch.undo()
    for bad in ("a(b", "a{2,1}", "[z-a]", "a**", "\\1"):
        with pytest.raises(RequestError, match="not a valid regular expression"):
            _guide(Guide("regex", bad))
