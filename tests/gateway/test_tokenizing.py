"""The two ways a text is encoded (on the calling thread up to INLINE_CHARS, through the
tokenizer's pool above) give the same token ids, prompts and chats alike."""

from __future__ import annotations

import pytest

from appliance.text.tokenizer import INLINE_CHARS, ModelText
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
def test_a_prompt_encodes_alike_on_both_sides_of_the_inline_size(
    text: ModelText, chars: int
) -> None:
    prompt = _sized(chars)
    pooled = text.tokenizer.encode_batch([prompt], add_special_tokens=True)[0].ids
    assert text.encode_prompt(prompt) == pooled


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
