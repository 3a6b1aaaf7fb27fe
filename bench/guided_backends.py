"""xgrammar vs llguidance for the engine's grammar-constrained decoding, on real tokenizers.

For each tokenizer (tokenizer.json files) and each library, measures:
  setup    - building the library's tokenizer view from tokenizer.json (once per model);
  compile  - compiling each guide (JSON Schemas, any-JSON, a regex) the first time it is seen;
  mask     - per-token mask computation along a valid answer: the answer's tokens are fed one
             by one, and each step computes the allowed-token bitmask, then advances the matcher.
The mask is what the engine computes per decode step, so its median and p99 are the numbers that
decide; compile is paid once per guide (the engine caches compiled guides).

    python -m bench.guided_backends TOKENIZER_JSON [TOKENIZER_JSON ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from tokenizers import Tokenizer

from bench import record
from bench.common import pct

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                },
                "required": ["id", "tags"],
            },
            "status": {"enum": ["active", "disabled", "pending"]},
        },
        "required": ["user", "status"],
    },
    "wide": {
        "type": "object",
        "properties": {f"field_{i}": {"type": ["string", "number", "boolean"]} for i in range(24)},
        "required": [f"field_{i}" for i in range(0, 24, 2)],
    },
}
ANSWERS: dict[str, str] = {
    "flat": '{"name": "Ada Lovelace", "age": 36}',
    "nested": '{"user": {"id": 42, "tags": ["math", "poetry"]}, "status": "active"}',
    "wide": json.dumps({f"field_{i}": "value" for i in range(0, 24, 2)}),
    "json": '{"a": [1, 2, {"b": null}], "c": "text"}',
    "regex": "2024-05-17T10:42",
}
REGEX = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}"


class Library(Protocol):
    name: str

    def compile(self, kind: str, guide: str) -> Any: ...
    def walk(self, compiled: Any, tokens: list[int]) -> list[float]: ...


class XGrammar:
    name = "xgrammar"

    def __init__(self, path: Path, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        text = path.read_text(encoding="utf-8")
        tok = Tokenizer.from_str(text)
        vocab = [""] * vocab_size
        for token, i in tok.get_vocab(with_added_tokens=True).items():
            vocab[i] = token
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(text)
        info = xgr.TokenizerInfo(vocab, vocab_size=vocab_size, **metadata)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, guide: str) -> Any:
        if kind == "json":
            return self.compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return self.compiler.compile_regex(guide)
        return self.compiler.compile_json_schema(guide)

    def walk(self, compiled: Any, tokens: list[int]) -> list[float]:
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for t in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(t), "xgrammar refused a token of a valid answer"
        return times


class LLGuidance:
    name = "llguidance"

    def __init__(self, path: Path, vocab_size: int) -> None:
        import llguidance
        import llguidance.torch as lt

        self.ll = llguidance
        self.lt = lt
        self.tokenizer = llguidance.LLTokenizer(
            path.read_text(encoding="utf-8"), n_vocab=vocab_size
        )
        self.vocab_size = vocab_size

    def compile(self, kind: str, guide: str) -> Any:
        m = self.ll.LLMatcher
        grammar = (
            m.grammar_from_json_schema('{"type": "object"}')
            if kind == "json"
            else m.grammar_from_regex(guide)
            if kind == "regex"
            else m.grammar_from_json_schema(guide)
        )
        error = m.validate_grammar(grammar, self.tokenizer)
        assert not error, error
        # llguidance builds its parser lazily: the first mask of a fresh matcher does the work.
        matcher = m(self.tokenizer, grammar)
        matcher.compute_bitmask()
        return grammar

    def walk(self, compiled: Any, tokens: list[int]) -> list[float]:
        matcher = self.ll.LLMatcher(self.tokenizer, compiled)
        bitmask = self.lt.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for t in tokens:
            start = time.perf_counter()
            self.lt.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - start)
            assert matcher.consume_token(t), matcher.get_error()
        return times


def answer_tokens(tok: Tokenizer, text: str) -> list[int]:
    """The answer's token ids as a model would generate them: a SentencePiece-style tokenizer
    prepends a word marker when encoding a whole text, which a generated answer does not have."""
    ids: list[int] = tok.encode(text, add_special_tokens=False).ids
    if not (tok.id_to_token(ids[0]) or "").startswith("\u2581"):
        return ids
    return [t.id for t in tok.model.tokenize(text.replace(" ", "\u2581"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tokenizers", type=Path, nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    record.add_flag(parser)
    args = parser.parse_args()
    with record.recording("guided_backends", record.record_dir(args)):
        torch.set_num_threads(1)
        guides = {name: ("json_schema", json.dumps(s)) for name, s in SCHEMAS.items()}
        guides["json"] = ("json", "")
        guides["regex"] = ("regex", REGEX)
        for path in args.tokenizers:
            tok = Tokenizer.from_file(str(path))
            vocab_size = tok.get_vocab_size(with_added_tokens=True)
            print(f"\n## {path} (vocab {vocab_size})")
            for cls in (XGrammar, LLGuidance):
                started = time.perf_counter()
                lib: Library = cls(path, vocab_size)
                setup = time.perf_counter() - started
                print(f"{cls.name}: setup {setup * 1e3:.0f} ms")
                masks: list[float] = []
                for name, (kind, guide) in guides.items():
                    compiles = []
                    for _ in range(args.rounds):
                        started = time.perf_counter()
                        compiled = lib.compile(kind, guide)
                        compiles.append(time.perf_counter() - started)
                    tokens = answer_tokens(tok, ANSWERS[name])
                    walk: list[float] = []
                    for _ in range(args.rounds):
                        walk += lib.walk(compiled, tokens)
                    masks += walk
                    print(
                        f"  {name:7s} compile median {statistics.median(compiles) * 1e3:7.2f} ms; "
                        f"mask median {statistics.median(walk) * 1e6:7.1f} us "
                        f"p99 {pct(walk, 0.99) * 1e6:7.1f} us over {len(walk)} steps"
                    )
                print(
                    f"  all     mask median {statistics.median(masks) * 1e6:7.1f} us "
                    f"p99 {pct(masks, 0.99) * 1e6:7.1f} us"
                )


if __name__ == "__main__":
    main()
