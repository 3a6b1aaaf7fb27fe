"""The tokenizer info file of guided decoding: what the tensorrtllm backend hands to xgrammar.

A JSON object with `encoded_vocab` (every token string in id order, added tokens included),
`tokenizer_str` (the tokenizer.json itself; xgrammar reads the vocabulary type from it) and
`stop_token_ids` (the tokens that may end a grammar). TensorRT-LLM's own writer is
examples/generate_xgrammar_tokenizer_info.py; this one reads tokenizer.json with `tokenizers`
instead of transformers, so engine_build needs neither transformers nor torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_build.errors import BuildError

__all__ = ["TOKENIZER_INFO_FILE", "check_tokenizer_info", "stop_token_ids", "write_tokenizer_info"]

# Its name in the model's tokenizer directory (the name TensorRT-LLM's writer gives it).
TOKENIZER_INFO_FILE = "xgrammar_tokenizer_info.json"


def write_tokenizer_info(tokenizer_json: Path, stop_ids: Sequence[int], dest: Path) -> None:
    """Write the tokenizer info file for a tokenizer.json; BuildError if it cannot be read."""
    from tokenizers import Tokenizer

    try:
        text = tokenizer_json.read_text(encoding="utf-8")
        vocab = Tokenizer.from_str(text).get_vocab(with_added_tokens=True)
    except OSError as exc:
        raise BuildError(f"{tokenizer_json}: cannot read: {exc.strerror}") from exc
    except Exception as exc:  # tokenizers raises its own Exception subclass
        raise BuildError(f"{tokenizer_json}: not a tokenizer: {exc}") from exc
    encoded = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    info = {"encoded_vocab": encoded, "tokenizer_str": text, "stop_token_ids": list(stop_ids)}
    dest.write_text(json.dumps(info, ensure_ascii=False), encoding="utf-8")


def _json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def stop_token_ids(tokenizer_dir: Path) -> list[int]:
    """The token that ends a grammar: the id the gateway sends as `end_id`.

    That is the tokenizer's end-of-sequence token (`eos_token` of tokenizer_config.json), as
    TensorRT-LLM's writer takes `tokenizer.eos_token_id`; a tokenizer without one in its
    vocabulary falls back to config.json's `eos_token_id` (the first of a list), as the gateway
    does (appliance.text.tokenizer.ModelText). One id only: a grammar that ended on a token the generation does not end on would
    leave the request running with a finished grammar. BuildError when there is none.
    """
    from tokenizers import Tokenizer

    eos = _token_text(_json_object(tokenizer_dir / "tokenizer_config.json").get("eos_token"))
    if eos is not None:
        try:
            token = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(eos)
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise BuildError(f"{tokenizer_dir / 'tokenizer.json'}: not a tokenizer: {exc}") from exc
        if token is not None:
            return [token]
    ids = _json_object(tokenizer_dir / "config.json").get("eos_token_id")
    first = ids[0] if isinstance(ids, list) and ids else ids
    if isinstance(first, int) and not isinstance(first, bool) and first >= 0:
        return [first]
    raise BuildError(
        f"{tokenizer_dir}: no end-of-sequence token for guided decoding (neither an eos_token "
        "of tokenizer_config.json in tokenizer.json nor an eos_token_id in config.json); add "
        "one, or set runtime.guided_decoding = false"
    )


def check_tokenizer_info(path: Path) -> list[str]:
    """What keeps the backend from loading a tokenizer info file; empty when it can."""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        return [f"tokenizer info file {path} cannot be read: {exc.strerror}"]
    except ValueError as exc:
        return [f"tokenizer info file {path} is not JSON: {exc}"]
    if not isinstance(info, dict):
        return [f"tokenizer info file {path} is not a JSON object"]
    problems = []
    vocab = info.get("encoded_vocab")
    if not isinstance(vocab, list) or not all(isinstance(t, str) for t in vocab):
        problems.append(f"tokenizer info file {path}: encoded_vocab is not a list of strings")
    if not isinstance(info.get("tokenizer_str"), str):
        problems.append(f"tokenizer info file {path}: tokenizer_str is not a string")
    stop = info.get("stop_token_ids")
    if (
        not isinstance(stop, list)
        or not stop
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop)
    ):
        problems.append(
            f"tokenizer info file {path}: stop_token_ids must be a non-empty list of token ids "
            "(without one, a finished grammar leaves no token to end the generation)"
        )
    return problems
