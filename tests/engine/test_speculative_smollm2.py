"""Greedy output with speculation on is token-for-token the output with it off, on the real
SmolLM2-135M-Instruct, over prompts of mixed kinds, with both drafters.

The prompts are made from a few templates per kind and seeded random inputs: input-grounded
(summarise, extract from, rewrite or repeat a given text), free chat, code, JSON echoing its input,
and repetitive text. Each mode serves every prompt through one in-process runner (one compute
thread, one working cache, a prefix pool, as the engine server runs them): speculation off once,
then prompt lookup with its default off switch, then a draft model (the target's first
DRAFT_LAYERS layers) whose switch never trips, so every step of it is a verify step. Each mode must
also have verified drafts and accepted some, or equality would hold vacuously.
"""

from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from appliance.engine.draft_model import DraftModelDrafter, check_draft_model
from appliance.engine.llama import LlamaModel
from appliance.engine.prefix_cache import PrefixCache
from appliance.engine.runner import Emission, Job, Runner, prefill_chunk_tokens
from appliance.engine.sampling import SamplingParams
from appliance.engine.speculative import Drafter, NgramSpeculation, OffSwitch
from bench.speculative import layer_skip_dir
from tests.engine.conftest import Instruct

GREEDY = SamplingParams(top_k=1)
# Sized so the file runs in about two minutes on a 2-core CPU; SPEC_GREEDY_PROMPTS asks for more.
PROMPTS = int(os.environ.get("SPEC_GREEDY_PROMPTS", "40"))
NEW_TOKENS = 12
SEQ = 512
DRAFT_TOKENS = 2
# Fewer layers agree with the target on a few percent of drafts: too few accepted runs to test.
DRAFT_LAYERS = 26
NEVER_OFF = OffSwitch(min_accepted=0.0)
POOL_BLOCKS = 64
BLOCK = 16
JOB_TIMEOUT_S = 600.0

NAMES = ["Ana", "Tomas", "Priya", "Kenji", "Lena", "Omar", "Grace", "Diego", "Sofia", "Ivan"]
CITIES = ["Lisbon", "Osaka", "Denver", "Nairobi", "Oslo", "Lima", "Perth", "Ghent", "Quito"]
PROJECTS = [
    "bicycle lanes",
    "a new library",
    "the harbour bridge",
    "free school meals",
    "a solar farm",
    "night buses",
    "a public pool",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Friday", "Sunday"]
TOPICS = [
    "sleep",
    "learning a language",
    "saving money",
    "cooking rice",
    "running",
    "houseplants",
    "chess",
    "public speaking",
    "photography",
    "gardening",
    "volcanoes",
    "the moon",
]
TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "counts the vowels in a word",
    "returns the largest item of a list",
    "computes the factorial of n",
    "removes duplicates from a list",
    "converts Celsius to Fahrenheit",
    "merges two sorted lists",
    "sums the digits of an integer",
]
WORDS = ["apple", "blue", "tick", "hello", "seven", "moon", "river", "stop"]

GROUNDED = [
    "Summarise this text in one sentence:\n\n{text}",
    "Extract every person's name from this text:\n\n{text}",
    "Rewrite this text in the past tense, changing as little as possible:\n\n{text}",
    "Repeat the following text exactly:\n\n{text}",
    "What did the council decide? Answer only from the text.\n\n{text}",
    "Correct the spelling in this text:\n\n{text}",
]
CHAT = [
    "What are some tips for {topic}?",
    "Explain {topic} to a child.",
    "Why do people enjoy {topic}?",
    "Give me one fun fact about {topic}.",
    "How do I get started with {topic}?",
]
CODE = [
    "Write a Python function that {task}.",
    "Write a JavaScript function that {task}.",
    "Write a Python function that {task}, with a docstring.",
    "Fix this Python code so that it {task}:\n\ndef f(x):\n    return x",
]
JSON_ASKS = [
    "Return this JSON object unchanged:\n",
    "Echo the following JSON exactly, with no other text:\n",
    'Add the field "ok": true to this JSON and return it:\n',
]


@dataclass(frozen=True)
class Prompt:
    kind: str
    message: str


def grounded(rng: random.Random) -> str:
    first, second = rng.sample(NAMES, 2)
    text = (
        f"On {rng.choice(DAYS)}, the council of {rng.choice(CITIES)} voted {rng.randint(5, 9)} "
        f"to {rng.randint(1, 4)} to fund {rng.choice(PROJECTS)}. Mayor {first} said the plan "
        f"would cost {rng.randint(2, 90)} million. {second}, who opposed it, asked for a report "
        f"in {rng.randint(2, 12)} months."
    )
    if rng.random() < 0.3:  # a misspelling or two for the editing asks
        text = text.replace("council", "councel").replace("report", "reprot")
    return rng.choice(GROUNDED).format(text=text)


def chat(rng: random.Random) -> str:
    return rng.choice(CHAT).format(topic=rng.choice(TOPICS))


def code(rng: random.Random) -> str:
    return rng.choice(CODE).format(task=rng.choice(TASKS))


def json_echo(rng: random.Random) -> str:
    record = {
        "name": rng.choice(NAMES),
        "city": rng.choice(CITIES),
        "age": rng.randint(18, 90),
        "tags": rng.sample(TOPICS, 2),
    }
    return rng.choice(JSON_ASKS) + json.dumps(record)


def repetitive(rng: random.Random) -> str:
    word, other = rng.sample(WORDS, 2)
    n = rng.randint(3, 6)
    return rng.choice(
        [
            f"Repeat the word '{word}' twenty times, separated by spaces.",
            "Continue this sequence: " + " ".join([word, other, *rng.sample(WORDS, 2)] * n),
            f"Count from {n} to {n + 30}, one number per line.",
            f"Write the line '{word} {other}' ten times.",
        ]
    )


KINDS = {
    "input-grounded": grounded,
    "chat": chat,
    "code": code,
    "json": json_echo,
    "repetitive": repetitive,
}


def mixed_prompts(count: int, seed: int = 7) -> list[Prompt]:
    """`count` prompts, the kinds in turn, each drawn from its templates by one seeded generator."""
    rng = random.Random(seed)
    kinds = list(KINDS.items())
    return [Prompt(kinds[i % len(kinds)][0], kinds[i % len(kinds)][1](rng)) for i in range(count)]


@dataclass
class Served:
    outputs: list[list[int]]
    drafted: int
    accepted: int
    verify_steps: int


def serve_all(
    model: LlamaModel, speculation: Drafter | None, prompts: list[list[int]], end: int
) -> Served:
    """Every prompt through one runner, queued at once (served one at a time, in order)."""
    pool = PrefixCache(model.config, POOL_BLOCKS, BLOCK, "smollm2", model.device, model.dtype)
    runner = Runner(model, SEQ, BLOCK, prefix=pool, speculation=speculation)
    finals: list[Emission | None] = [None] * len(prompts)
    done = threading.Semaphore(0)

    def emit_to(i: int) -> Callable[[Emission], None]:
        def emit(emission: Emission) -> None:
            if emission.final:
                finals[i] = emission
                done.release()

        return emit

    try:
        for i, prompt in enumerate(prompts):
            runner.submit(Job(f"p{i}", prompt, NEW_TOKENS, end, GREEDY, False, emit_to(i)))
        for _ in prompts:
            assert done.acquire(timeout=JOB_TIMEOUT_S), "the runner stopped answering"
    finally:
        assert runner.close()
    outputs = []
    for i, final in enumerate(finals):
        assert final is not None and final.error is None and final.tokens is not None, (i, final)
        outputs.append(final.tokens)
    stats = runner.stats
    return Served(
        outputs, stats.spec_draft_tokens, stats.spec_accepted_tokens, stats.spec_verify_steps
    )


@pytest.fixture(scope="module")
def target(instruct: Instruct) -> LlamaModel:
    return LlamaModel.load(instruct.model_dir)


@pytest.fixture(scope="module")
def cases(instruct: Instruct) -> list[tuple[Prompt, list[int]]]:
    text = instruct.text
    prompts = mixed_prompts(PROMPTS)
    return [(p, text.encode_chat([{"role": "user", "content": p.message}])) for p in prompts]


@pytest.fixture(scope="module")
def baseline(
    instruct: Instruct, target: LlamaModel, cases: list[tuple[Prompt, list[int]]]
) -> Served:
    assert instruct.text.end_id is not None
    served = serve_all(target, None, [ids for _, ids in cases], instruct.text.end_id)
    assert served.drafted == served.verify_steps == 0
    # Most answers run to the length limit: the comparison covers NEW_TOKENS steps, not a few.
    assert sum(map(len, served.outputs)) > PROMPTS * NEW_TOKENS // 2
    return served


def draft_drafter(instruct: Instruct, target: LlamaModel, dest: Path) -> DraftModelDrafter:
    draft_dir = layer_skip_dir(instruct.model_dir, DRAFT_LAYERS, dest)
    check_draft_model(draft_dir, instruct.model_dir, target.config)
    draft = LlamaModel.load(draft_dir)
    chunk = prefill_chunk_tokens(draft.device)
    return DraftModelDrafter(draft, SEQ, DRAFT_TOKENS, chunk, NEVER_OFF)


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_greedy_output_with_speculation_is_the_output_without(
    mode: str,
    instruct: Instruct,
    target: LlamaModel,
    cases: list[tuple[Prompt, list[int]]],
    baseline: Served,
    tmp_path: Path,
) -> None:
    end = instruct.text.end_id
    assert end is not None
    drafter: Drafter = (
        NgramSpeculation() if mode == "ngram" else draft_drafter(instruct, target, tmp_path / "d")
    )
    served = serve_all(target, drafter, [ids for _, ids in cases], end)
    decode = instruct.text.tokenizer.decode
    differ = [
        f"#{i} {prompt.kind} {prompt.message[:40]!r}: off {decode(off)!r}, {mode} {decode(on)!r}"
        for i, ((prompt, _), off, on) in enumerate(
            zip(cases, baseline.outputs, served.outputs, strict=True)
        )
        if on != off
    ]
    shown = "\n".join(differ[:10])
    assert not differ, f"{len(differ)} of {len(cases)} outputs differ, the first:\n{shown}"
    # Drafts were verified, and both accepted and rejected (the rollback of the caches ran).
    assert served.verify_steps > 0
    assert 0 < served.accepted < served.drafted
