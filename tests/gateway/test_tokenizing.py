"""A text's token ids are the tokenizer's own, on both sides of INLINE_CHARS (on the event loop
below it, on a worker thread above), prompts and chats alike, with the tokenizers' pool on or
off."""

from __future__ import annotations

import dataclasses
import os

import pytest

from appliance.text.tokenizer import (
    INLINE_CHARS,
    ChatTemplateError,
    ModelText,
    chat_environment,
    tokenize_on_calling_thread,
)
from tests.conftest import Tiny


@pytest.fixture(scope="module")
def text(tiny: Tiny) -> ModelText:
    return ModelText.load(tiny.tokenizer_dir)


def _sized(chars: int) -> str:
    words = "the quick brown fox jumps over a lazy dog, naïvely; 42 façades! "
    return (words * (chars // len(words) + 1))[:chars]


@pytest.mark.parametrize(
    "chars", [1, INLINE_CHARS - 1, INLINE_CHARS, INLINE_CHARS + 1, 3 * INLINE_CHARS]
)
@pytest.mark.parametrize("parallelism", ["true", "false"])
def test_a_prompt_encodes_alike_on_both_sides_of_the_inline_size(
    text: ModelText, chars: int, parallelism: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", parallelism)
    prompt = _sized(chars)
    assert text.encode_prompt(prompt) == text.tokenizer.encode(prompt).ids
    pooled = text.tokenizer.encode_batch([prompt], add_special_tokens=True)[0].ids
    assert text.encode_prompt(prompt) == pooled


def test_the_gateway_turns_the_tokenizers_pool_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    tokenize_on_calling_thread()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"


def test_a_long_chat_encodes_alike_through_the_pool(text: ModelText) -> None:
    messages = [{"role": "user", "content": _sized(2 * INLINE_CHARS)}]
    rendered = text.chat_template.render(  # type: ignore[union-attr]
        messages=messages,
        tools=None,
        add_generation_prompt=True,
        bos_token=text.bos_token,
        eos_token=text.eos_token,
    )
    assert (
        text.encode_chat(messages) == text.tokenizer.encode(rendered, add_special_tokens=False).ids
    )


@pytest.mark.parametrize(
    "expression",
    [
        "message['content'] | length",  # an int's length: TypeError
        "message['content'] | dictsort",  # AttributeError
        "'<' + message['content']",  # TypeError
        "message['content'] // 0",  # ZeroDivisionError
    ],
)
def test_a_template_that_fails_on_what_the_client_sent_refuses_the_chat(
    text: ModelText, expression: str
) -> None:
    """A template applies filters and operators to values the client chose (a past tool call's
    arguments, say); an error there is the chat's refusal, not the server's fault."""
    template = chat_environment().from_string(
        "{% for message in messages %}{{ " + expression + " }}{% endfor %}"
    )
    model = dataclasses.replace(text, chat_template=template, segments=None)
    with pytest.raises(ChatTemplateError, match="chat template failed on these messages"):
        model.encode_chat([{"role": "user", "content": 5}])
