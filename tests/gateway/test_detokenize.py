"""Streamed deltas concatenate to the full decode, for arbitrary token sequences."""

from __future__ import annotations

import codecs
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from appliance.text.detokenize import (
    IncrementalDecoder,
    TokenTable,
    UnsupportedTokenizerError,
    build_token_table,
    decode_text,
)

SAMPLES = [
    "Hello world, the gateway streams tokens.",
    "  leading spaces and\ttabs\nnew lines",
    "Café naïve résumé — “quotes” 東京 🚀 emoji",
    "def f(x):\n    return x  # code keeps its spaces",
]
CORPUS = SAMPLES * 20 + ["The quick brown fox jumps over the lazy dog."] * 20


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _with_byte_tokens(tok: Tokenizer) -> Tokenizer:
    """Puts <0x00>..<0xFF> into the model vocab as ordinary tokens, right after the specials,
    where Llama-2's tokenizer.json has them (a trainer would make them special added tokens)."""
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    specials = {t["content"] for t in spec["added_tokens"]}
    n = len(specials)
    shifted = {t: (i if t in specials else i + 256) for t, i in vocab.items()}
    shifted.update({f"<0x{b:02X}>": n + b for b in range(256)})
    spec["model"]["vocab"] = shifted
    return Tokenizer.from_str(json.dumps(spec))


def _llama2_style() -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
        limit_alphabet=60,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return _with_byte_tokens(tok)


def _metaspace() -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
        limit_alphabet=60,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return _with_byte_tokens(tok)


TOKENIZERS = {"byte_level": _byte_level(), "llama2": _llama2_style(), "metaspace": _metaspace()}
TABLES = {name: build_token_table(tok) for name, tok in TOKENIZERS.items()}


def _stream(table: TokenTable, ids: list[int]) -> list[str]:
    decoder = IncrementalDecoder(table)
    deltas = [decoder.push(t) for t in ids]
    deltas.append(decoder.flush())
    return deltas


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("text", SAMPLES)
def test_matches_tokenizer_decode_on_real_text(name: str, text: str) -> None:
    tok = TOKENIZERS[name]
    ids = tok.encode(text, add_special_tokens=False).ids
    assert "".join(_stream(TABLES[name], ids)) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_deltas_concatenate_to_full_decode(name: str, data: st.DataObject) -> None:
    tok, table = TOKENIZERS[name], TABLES[name]
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=40))
    deltas = _stream(table, ids)
    assert "".join(deltas) == decode_text(table, ids)
    for d in deltas:  # every delta is whole characters: it survives a UTF-8 round trip
        assert d.encode("utf-8").decode("utf-8") == d
    reference = tok.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in reference:
        assert "".join(deltas) == reference


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_arbitrary_text_round_trips_through_the_stream(name: str, text: str) -> None:
    tok = TOKENIZERS[name]
    ids = tok.encode(text, add_special_tokens=False).ids
    reference = tok.decode(ids, skip_special_tokens=True)
    assert "".join(_stream(TABLES[name], ids)) == reference


def test_multibyte_character_is_held_until_complete() -> None:
    table = TABLES["llama2"]
    vocab = TOKENIZERS["llama2"].get_vocab()
    ids = [vocab[f"<0x{b:02X}>"] for b in "東".encode()]
    decoder = IncrementalDecoder(table)
    assert [decoder.push(i) for i in ids] == ["", "", "東"]


def test_leading_space_token_keeps_its_space_after_the_first() -> None:
    tok = TOKENIZERS["llama2"]
    ids = tok.encode("Hello world", add_special_tokens=False).ids
    deltas = [d for d in _stream(TABLES["llama2"], ids) if d]
    assert "".join(deltas) == "Hello world"
    assert deltas[0].startswith("H")  # the first token's marker space is stripped, like decode()
    assert " " in "".join(deltas)  # later marker spaces are kept


def test_special_tokens_contribute_nothing() -> None:
    tok = TOKENIZERS["llama2"]
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert bos is not None and eos is not None
    ids = [bos, *tok.encode("hi", add_special_tokens=False).ids, eos]
    assert decode_text(TABLES["llama2"], ids) == "hi"


def test_out_of_range_ids_are_ignored() -> None:
    assert decode_text(TABLES["byte_level"], [10**6, -1]) == ""


def test_unsupported_decoder_is_refused_with_a_reason() -> None:
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(UnsupportedTokenizerError, match="not supported for streaming"):
        build_token_table(tok)


def test_flush_reports_a_truncated_character() -> None:
    vocab = TOKENIZERS["llama2"].get_vocab()
    decoder = IncrementalDecoder(TABLES["llama2"])
    assert decoder.push(vocab["<0xE6>"]) == ""
    assert decoder.flush() == codecs.decode(b"\xe6", "utf-8", errors="replace")
