"""A chat's ids through the segment cache are the tokenizer's ids of the whole rendered text: on a
first encode, on a repeat (every piece cached), as a conversation grows turn by turn, with the
cache full; pieces are kept per namespace and within the cache's bound; a tokenizer whose special
tokens strip whitespace gets no cache, because cutting before such a token changes the ids."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from appliance.text.segments import SegmentCache
from appliance.text.tokenizer import ModelText, chat_environment, render_chat
from tests.conftest import Tiny


@pytest.fixture(scope="module")
def loaded(tiny: Tiny) -> ModelText:
    return ModelText.load(tiny.tokenizer_dir)


@pytest.fixture
def text(loaded: ModelText) -> ModelText:
    """The tiny model's text with a fresh cache that takes every chat in pieces, short ones too."""
    return dataclasses.replace(loaded, segments=pieces_always(loaded))


def pieces_always(text: ModelText, **bounds: int) -> SegmentCache:
    return SegmentCache(text.tokenizer, ["<s>", "</s>"], whole_below_chars=0, **bounds)


def whole_ids(text: ModelText, messages: list[dict[str, Any]]) -> list[int]:
    """The ids without the cache: the rendered text encoded in one piece."""
    return dataclasses.replace(text, segments=None).encode_chat(messages)


def chat(*contents: str) -> list[dict[str, Any]]:
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]


CONTENT = st.lists(
    st.one_of(
        st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8),
        st.sampled_from(["</s>", "<s>", " ", "\n", "<|user|>", "▁"]),
    ),
    max_size=8,
).map("".join)


def test_cuts_fall_before_each_token_leftmost_and_longest_never_inside_one(
    text: ModelText,
) -> None:
    cache = SegmentCache(text.tokenizer, ["<s>", "</s>", "<s>x", "s>"])
    assert cache.pieces_of("a<s>xb</s>c<s>") == ["a", "<s>xb", "</s>c", "<s>"]
    assert cache.pieces_of("") == []
    assert cache.pieces_of("<s>") == ["<s>"]
    assert cache.pieces_of("plain") == ["plain"]


def test_the_tiny_models_tokenizer_gets_a_cache(loaded: ModelText) -> None:
    assert loaded.segments is not None


def test_a_short_chat_is_encoded_whole_and_nothing_kept(tiny: Tiny) -> None:
    text = ModelText.load(tiny.tokenizer_dir)
    assert text.segments is not None
    short = chat("a short question", "an answer", "another one")
    assert text.encode_chat(short) == whole_ids(text, short)
    assert text.segments.held_ids == 0
    long = chat("a long question " * 200, "an answer", "another one")
    assert text.encode_chat(long) == whole_ids(text, long)
    assert text.segments.held_ids > 0


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(system=CONTENT, turns=st.lists(CONTENT, min_size=1, max_size=6))
def test_a_chat_encodes_as_its_whole_text_first_and_again(
    text: ModelText, system: str, turns: list[str]
) -> None:
    messages = [{"role": "system", "content": system}, *chat(*turns)]
    expected = whole_ids(text, messages)
    assert text.encode_chat(messages, namespace="ns") == expected
    assert text.encode_chat(messages, namespace="ns") == expected  # every piece from the cache


def test_a_growing_conversation_encodes_as_its_whole_text_at_every_turn(text: ModelText) -> None:
    contents: list[str] = []
    for turn in range(8):
        contents += [f" Question {turn}: what is {turn} squared?\n", f"{turn * turn}, I think. "]
        messages = chat(*contents[:-1])  # the answer arrives with the next turn
        assert text.encode_chat(messages, namespace="grow") == whole_ids(text, messages)


def test_pieces_are_kept_per_namespace(text: ModelText) -> None:
    assert text.segments is not None
    messages = chat("a question asked in two namespaces")
    text.encode_chat(messages, namespace="a")
    held = text.segments.held_ids
    text.encode_chat(messages, namespace="a")
    assert text.segments.held_ids == held  # a repeat adds nothing
    text.encode_chat(messages, namespace="b")
    assert text.segments.held_ids == 2 * held  # another namespace's are its own


def test_a_full_cache_stays_within_its_bound_and_still_encodes_right(text: ModelText) -> None:
    small = pieces_always(text, capacity_ids=320)
    limited = dataclasses.replace(text, segments=small)
    for i in range(60):
        messages = chat(f"message {i}", "an answer", f"and {i} again")
        assert limited.encode_chat(messages) == whole_ids(text, messages)
        assert small.held_ids <= 320
    assert small.held_ids > 200


def test_the_number_of_pieces_is_bounded_too(text: ModelText) -> None:
    small = pieces_always(text, capacity_pieces=5)
    limited = dataclasses.replace(text, segments=small)
    messages = chat(*(f"{i}" for i in range(30)))
    assert limited.encode_chat(messages) == whole_ids(text, messages)
    assert small.pieces == 5


def test_a_piece_longer_than_a_sixteenth_of_the_cache_is_not_kept(text: ModelText) -> None:
    small = pieces_always(text, capacity_ids=160)
    limited = dataclasses.replace(text, segments=small)
    messages = chat("word " * 100)
    assert limited.encode_chat(messages) == whole_ids(text, messages)
    assert small.held_ids < 20  # the short pieces only


def stripping_tokenizer(tiny: Tiny) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(tiny.tokenizer_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<sep>", special=True, lstrip=True, rstrip=True)])
    return tokenizer


def render_with_sep(messages: list[dict[str, Any]]) -> str:
    return "".join(f"{m['role']}: {m['content']} <sep> " for m in messages) + "assistant:"


def test_special_tokens_that_strip_whitespace_get_no_cache(tiny: Tiny) -> None:
    tokenizer = stripping_tokenizer(tiny)
    assert SegmentCache.of(tokenizer, render_with_sep) is None
    # And that refusal matters: cut before such a token, the ids differ.
    forced = SegmentCache(tokenizer, ["<sep>"])
    rendered = render_with_sep(chat("hello", "hi"))
    whole = tokenizer.encode_batch_fast([rendered], add_special_tokens=False)[0].ids
    assert forced.by_pieces(rendered, "") != whole


def test_a_template_that_refuses_the_probes_gets_no_cache(text: ModelText) -> None:
    def refuses(messages: list[dict[str, Any]]) -> str:
        raise ValueError("roles must alternate user/assistant")

    assert SegmentCache.of(text.tokenizer, refuses) is None


# Gemma's chat template as published: it refuses a system message, and alternates user/model turns.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)


def test_a_template_that_refuses_system_messages_still_gets_the_cache(
    loaded: ModelText, tiny: Tiny
) -> None:
    tokenizer = Tokenizer.from_file(str(tiny.tokenizer_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(["<start_of_turn>", "<end_of_turn>"])
    gemma = dataclasses.replace(
        loaded,
        tokenizer=tokenizer,
        chat_template=chat_environment().from_string(GEMMA_TEMPLATE),
    )

    def render(messages: list[dict[str, Any]]) -> str:
        assert gemma.chat_template is not None
        return render_chat(gemma.chat_template, messages, None, "<s>", "</s>")

    with pytest.raises(ValueError, match="System role"):
        render([{"role": "system", "content": "terse"}, *chat("hi")])
    cache = SegmentCache.of(tokenizer, render, whole_below_chars=0)
    assert cache is not None
    gemma = dataclasses.replace(gemma, segments=cache)
    history = chat("What is 6 × 7?", " 42. ", "And <end_of_turn> then?", "x" * 300, "ok")
    assert gemma.encode_chat(history) == whole_ids(gemma, history)
    assert gemma.encode_chat(history) == whole_ids(gemma, history)  # every piece cached
    assert cache.pieces > 0
