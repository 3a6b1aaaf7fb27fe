from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from appliance.text.stops import StopMatcher


def _run(stops: tuple[str, ...], deltas: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = "".join(m.feed(d) for d in deltas)
    return out + m.flush(), m.stopped


def test_stop_string_split_across_deltas_is_cut() -> None:
    assert _run(("END",), ["abc E", "N", "D more"]) == ("abc ", True)


def test_partial_match_that_fails_is_released() -> None:
    m = StopMatcher(("END",))
    assert m.feed("abc EN") == "abc "
    assert m.feed("X") == "ENX"


def test_earliest_of_several_stops_wins() -> None:
    assert _run(("world", "lo"), ["hello world"]) == ("hel", True)


def test_no_stops_passes_through() -> None:
    assert _run((), ["a", "b"]) == ("ab", False)


def test_nothing_after_stop() -> None:
    m = StopMatcher(("x",))
    assert m.feed("ax") == "a"
    assert m.feed("more") == ""
    assert m.flush() == ""


@given(
    text=st.text(alphabet="abcE ND", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stop=st.text(alphabet="abcEND", min_size=1, max_size=4),
)
def test_same_result_however_the_text_is_split(text: str, cuts: list[int], stop: str) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    expected = text[: text.find(stop)] if stop in text else text
    assert _run((stop,), deltas) == (expected, stop in text)
