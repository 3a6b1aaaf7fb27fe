"""Tokenizing a growing conversation in the gateway: every piece encoded each turn, against the
segment cache (appliance/text/segments.py), in the same run.

A chat client sends the whole history with each turn. At turn t the conversation holds t user
questions and t - 1 answers; the gateway renders it with the model's chat template and encodes it.
With the cache, only the pieces it has not seen (the last answer and the new question) are
encoded. Each repetition is a new namespace, so its pieces are new to the cache as a new
conversation's would be; a turn's time is its first encode in that conversation. The two ways
alternate turn by turn, so each meets the caches the other left as often.

    python -m bench.chat_tokens                          # the tiny model's tokenizer
    python -m bench.chat_tokens --tokenizer var/smollm2/repo/tensorrt_llm/tokenizer
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

from appliance.text.tokenizer import ModelText, tokenize_on_calling_thread
from bench import record

CORPUS = Path(__file__).resolve().parent.parent / "appliance" / "data" / "corpus.txt"


def conversation(turns: int, words_per_message: int) -> list[dict[str, Any]]:
    """`turns` questions and answers of `words_per_message` words each, from the corpus."""
    words = CORPUS.read_text(encoding="utf-8").split()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You answer briefly."}]
    at = 0
    for _ in range(turns):
        for role in ("user", "assistant"):
            piece = words[at : at + words_per_message]
            at = (at + words_per_message) % max(1, len(words) - words_per_message)
            messages.append({"role": role, "content": " ".join(piece)})
    return messages


def timed(text: ModelText, sent: list[dict[str, Any]], namespace: str) -> tuple[int, float]:
    started = time.perf_counter_ns()
    ids = text.encode_chat(sent, namespace=namespace)
    return len(ids), (time.perf_counter_ns() - started) / 1000


def run(tokenizer_dir: Path, turns: int, words: int, reps: int) -> list[dict[str, float]]:
    tokenize_on_calling_thread()
    cached = ModelText.load(tokenizer_dir)
    if cached.segments is None:
        raise SystemExit(f"{tokenizer_dir}: this tokenizer gets no segment cache (segments.py)")
    whole = dataclasses.replace(cached, segments=None)
    messages = conversation(turns, words)
    for t in range(1, turns + 1):  # same ids both ways, or the comparison means nothing
        assert cached.encode_chat(messages[: 2 * t]) == whole.encode_chat(messages[: 2 * t])
    per_turn: list[list[tuple[float, float]]] = [[] for _ in range(turns)]
    tokens = [0] * turns
    for rep in range(reps):  # each conversation new to the cache
        for t in range(turns):  # turn t + 1 sends t + 1 questions and t answers
            sent = messages[: 2 * t + 2]
            if rep % 2:  # which goes first alternates: each follows the other as often
                c, w = timed(cached, sent, f"rep{rep}"), timed(whole, sent, "")
            else:
                w, c = timed(whole, sent, ""), timed(cached, sent, f"rep{rep}")
            tokens[t] = w[0]
            per_turn[t].append((w[1], c[1]))
    rows: list[dict[str, float]] = []
    print(f"\n{reps} conversations of {turns} turns, {words} words a message, {tokenizer_dir}")
    print("| turn | prompt tokens | whole P50 µs | cached P50 µs | whole ÷ cached |")
    print("|---:|---:|---:|---:|---:|")
    for t in range(turns):
        whole_us = statistics.median(x for x, _ in per_turn[t])
        cached_us = statistics.median(y for _, y in per_turn[t])
        rows.append(
            {"turn": t + 1, "tokens": tokens[t], "whole_us": whole_us, "cached_us": cached_us}
        )
        print(
            f"| {t + 1} | {tokens[t]:,} | {whole_us:,.0f} | {cached_us:,.0f} "
            f"| {whole_us / cached_us:.1f} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: tiny's)")
    parser.add_argument("--model-root", default="var/tiny", help="where the tiny model is made")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--words", type=int, default=120, help="words per message")
    parser.add_argument("--reps", type=int, default=20)
    record.add_flag(parser)
    args = parser.parse_args(argv)
    if min(args.turns, args.words, args.reps) < 1:
        parser.error("--turns, --words and --reps must be at least 1")
    with record.recording(
        "chat_tokens", record.record_dir(args), None if argv is None else list(argv)
    ) as run_record:
        directory = args.tokenizer
        if directory is None:
            from appliance.tools.tiny_model import ensure_tiny_model

            _, repo = ensure_tiny_model(Path(args.model_root))
            directory = repo / "tensorrt_llm" / "tokenizer"
        run_record.results["turns"] = run(directory, args.turns, args.words, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
