"""Client JSON parsed and written in steps (json_steps) is what the json module makes of it: the
same texts accepted, the same values, the same text written; and a long tool chat's past calls
are parsed, written and keyed in steps, their values not kept."""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.gateway import json_steps, tool_calls
from appliance.gateway.json_steps import STEP_CHARS

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["é", "東京 🚀", "\u2028", "\ud800", '"\\/', "\x00\x1f"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=40,
)
# Texts json.loads reads in its own ways: numbers past 64 bits and past a double, -0, constants,
# a key named twice, escapes, a BOM, whitespace, and texts it refuses.
EDGE_TEXTS = [
    "123456789012345678901234567890",
    "-18446744073709551617",
    "1e400",
    "-1e400",
    "-0.0",
    "-0",
    "1E5",
    "123.456e-789",
    "NaN",
    "[Infinity, -Infinity]",
    '{"a": 1, "a": 2}',
    '{"b": {"x": 1, "x": [2]}, "a": 0}',
    '"\\ud800"',
    '"\\u00e9\\n"',
    "\ufeff{}",
    " \t\n{} \r\n",
    "[1,]",
    '{"a" 1}',
    "[1] x",
    '"\x01"',
    "",
    "   ",
    "[" * 600 + "]" * 600,  # deep, but parsed in one call (shorter than a step)
]


def stdlib(text: str) -> tuple[str, Any]:
    try:
        return "value", json.loads(text)
    except (ValueError, RecursionError) as exc:
        return "refused", type(exc)


def stepped(text: str, step: int) -> tuple[str, Any]:
    try:
        return "value", json_steps.loads(text, step)
    except (ValueError, RecursionError) as exc:
        return "refused", type(exc)


def rewritten(text: str, step: int) -> tuple[str, Any]:
    try:
        return "texts", json_steps.rewrite(text, step)
    except (ValueError, RecursionError) as exc:
        return "refused", type(exc)


def stdlib_texts(text: str) -> tuple[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return "refused", type(exc)
    return "texts", (
        json.dumps(value, ensure_ascii=False),
        json.dumps(value, ensure_ascii=False, sort_keys=True),
    )


def mutations(text: str, seed: int) -> Iterator[str]:
    """The text, and copies with one character dropped, doubled or replaced by JSON's punctuation."""
    yield text
    if text:
        at = seed % len(text)
        yield text[:at] + text[at + 1 :]
        yield text[:at] + text[at] + text[at:]
        for mark in ',:[]{}"\\ ':
            yield text[:at] + mark + text[at + 1 :]


@settings(max_examples=300, deadline=None)
@given(VALUES, st.booleans(), st.sampled_from([None, 1]), st.integers(0, 10_000))
def test_the_same_texts_parse_to_the_same_values(
    value: Any, ascii_only: bool, indent: int | None, seed: int
) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    for variant in mutations(text, seed):
        expected = stdlib(variant)
        texts = stdlib_texts(variant)
        for step in (1, 5, 64):
            # repr tells NaN, -0.0 and 1 from 1.0 apart, where == would not.
            assert repr(stepped(variant, step)) == repr(expected), (variant, step)
            assert rewritten(variant, step) == texts, (variant, step)


# Every edge text at every step, but a text walked 600 deep: the one documented difference,
# test_deep_long_containers_are_text_that_does_not_parse.
EDGE_CASES = [
    (text, step)
    for step in (1, 4, STEP_CHARS)
    for text in EDGE_TEXTS
    if not (text.startswith("[" * 600) and step < len(text))
]


@pytest.mark.parametrize(("text", "step"), EDGE_CASES)
def test_json_s_own_readings_are_kept(text: str, step: int) -> None:
    assert repr(stepped(text, step)) == repr(stdlib(text))
    assert rewritten(text, step) == stdlib_texts(text)


def test_deep_long_containers_are_text_that_does_not_parse() -> None:
    """The one difference (the module's docstring): containers longer than a step, nested about
    490 deep, raise RecursionError where json.loads reads up to about 990."""
    text = "[" * 600 + "]" * 600
    assert stdlib(text)[0] == "value"
    assert stepped(text, 4) == ("refused", RecursionError)
    assert rewritten(text, 4) == ("refused", RecursionError)
    assert stepped("[" * 400 + "]" * 400, 4) == stdlib("[" * 400 + "]" * 400)


@settings(max_examples=300, deadline=None)
@given(VALUES)
def test_a_text_is_rewritten_as_json_dumps_writes_its_value(value: Any) -> None:
    text = json.dumps(value)
    for step in (1, 3, 64):
        assert rewritten(text, step) == stdlib_texts(text)


@given(st.text(max_size=40), st.integers(1, 8))
def test_a_string_is_written_in_slices_as_in_one(text: str, step: int) -> None:
    assert json_steps.string(text, step) == json.dumps(text, ensure_ascii=False)


# -- a tool chat's past calls ----------------------------------------------------------------------


def chat_of(*arguments: str) -> tool_calls.ToolChat:
    calls = tuple(tool_calls.PastCall(f"f{i}", a, f"c{i}") for i, a in enumerate(arguments))
    tools = (tool_calls.Tool("f0", "Gets ü", {"type": "object", "b": 1, "a": [2]}),)
    return tool_calls.ToolChat(
        tool_calls.ToolPlan(tools, "auto"),
        (
            tool_calls.Turn("system", "Be brief"),
            tool_calls.Turn("user", "Look it up: 東京"),
            tool_calls.Turn("assistant", "On it", calls),
            tool_calls.Turn("tool", "found", call_id="c0"),
        ),
    )


def stdlib_key(chat: tool_calls.ToolChat) -> str:
    """The key's text as one json.dumps of the chat wrote it."""
    return json.dumps(
        {
            "tools": chat.tool_specs(),
            "choice": chat.plan.choice if chat.plan else "none",
            "messages": chat.template_messages(),
        },
        ensure_ascii=False,
        sort_keys=True,
    )


def stdlib_written(arguments: str, name: str) -> str:
    try:
        value = json.loads(arguments) if arguments else {}
    except (ValueError, RecursionError):
        value = arguments
    return json.dumps({"name": name, "arguments": value}, ensure_ascii=False)


def long_arguments(marker: str = "m") -> str:
    rows = [{marker: i, "z": [1.5, -0.0, None], "a": "é"} for i in range(STEP_CHARS // 20)]
    text = json.dumps({"rows": rows, "big": 1e400, "int": 2**80, "s": "x" * (STEP_CHARS + 5)})
    assert len(text) > 2 * STEP_CHARS
    return text.replace("Infinity", "1e400")


ARGUMENT_SETS = [
    ('{"b": 1, "a": 2}', "", "not JSON", '{"a": 1, "a": 2}'),
    (long_arguments(), '{"n": 123456789012345678901234567890, "f": 1e400}'),
    (long_arguments(), long_arguments()[:-1], "[" * 700 + "]" * 700),
    ('"\\ud800 \\u00e9"', json.dumps(["x" * (STEP_CHARS + 1)])),
]


@pytest.mark.parametrize("arguments", ARGUMENT_SETS)
def test_the_fallback_and_the_key_are_the_texts_json_dumps_writes(
    arguments: tuple[str, ...],
) -> None:
    chat = chat_of(*arguments)
    written = chat.fallback()
    expected = [stdlib_written(a, f"f{i}") for i, a in enumerate(arguments)]
    assert written[2] == ("assistant", "\n".join(["On it", *expected]))
    assert chat.with_text(lambda text: text).key == stdlib_key(chat)


def test_the_key_is_the_same_whatever_the_order_of_the_arguments_keys() -> None:
    rows = [{"i": i, "v": "é"} for i in range(STEP_CHARS // 10)]
    one = json.dumps({"rows": rows, "a": 1, "b": {"y": 2, "x": 3}})
    other = json.dumps({"b": {"x": 3, "y": 2}, "a": 1, "rows": rows})
    keys = {chat_of(a).with_text(lambda text: text).key for a in (one, other)}
    assert len(keys) == 1


@contextmanager
def python_calls_into(files: tuple[str, ...]) -> Iterator[list[str]]:
    """The names of the Python functions of `files` called meanwhile on this thread."""
    called: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_filename.endswith(files):
            called.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        yield called
    finally:
        sys.setprofile(None)


def test_long_past_calls_are_parsed_and_written_in_steps() -> None:
    """Between steps the interpreter may hand the GIL to the event loop: long arguments are
    parsed and written by many calls, not by one C call over all of them."""
    chat = chat_of(long_arguments())
    decoder = ("json/decoder.py", "json_steps.py")
    with python_calls_into(decoder) as parsing:
        chat.fallback()
        chat.with_text(lambda text: text)
    assert parsing.count("JSONArray") >= 1
    assert parsing.count("scan") > STEP_CHARS // 20
    assert parsing.count("_whole") > STEP_CHARS // 20


def test_long_past_calls_values_are_not_kept_once_written() -> None:
    """A live value is walked by every full collection of the garbage collector, on whichever
    thread it runs (the event loop's too): once the chat is written and keyed, none of its
    past calls' parsed objects is alive."""
    chat = chat_of(long_arguments("marker-7f3a"))
    chat.fallback()
    keyed = chat.with_text(lambda text: text)
    gc.collect()
    alive = [o for o in gc.get_objects() if type(o) is dict and "marker-7f3a" in o]
    assert alive == []
    assert keyed.key
