"""Sampled generation under guides on the real instruct model (SmolLM2-135M): eighty answers
(GUIDED_SAMPLES per guide for more) across nested objects, enums, arrays, numbers with ranges and
regular expressions, and every one validates against its schema or matches its expression.

A trained model under a guide writes what its weights like within the grammar (long strings,
numbers near a bound, deep nesting), unlike the tiny model's random weights: this is where the
grammar's edges are met. The generations run one after another on the one in-process model and its
guided decoder (as the engine's batch-1 runner does), with short answers and small schemas.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jsonschema
import pytest

from appliance.engine.guided import Grammars, Guide
from appliance.engine.sampling import SamplingParams, generate
from appliance.engine.server import EngineModel, load_repository
from engine_build.tokenizer_info import write_tokenizer_info
from tests.engine.conftest import Instruct

# Samples per guide (sized for the suite on a 2-core CPU; GUIDED_SAMPLES asks for more), and a
# token bound that fits every guide's longest valid answer: an answer cut at the bound is not a
# complete one, which the test refuses.
SAMPLES = int(os.environ.get("GUIDED_SAMPLES", "8"))
MAX_TOKENS = 48

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{0,7}$"},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "role": {"enum": ["admin", "editor", "viewer"]},
                },
                "required": ["id", "role"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 10},
                "minItems": 1,
                "maxItems": 4,
            },
        },
        "required": ["scores"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "maxItems": 3,
            },
        },
        "required": ["colour", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -50, "maximum": 50},
                    "y": {"type": "integer", "minimum": -50, "maximum": 50},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    {"enum": ["yes", "no", "maybe"]},
    {
        "type": "array",
        "items": {"type": "boolean"},
        "minItems": 2,
        "maxItems": 3,
    },
]
REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(cat|dog|bird)s?",
    r"[A-Z][a-z]{2,6} [0-9]{1,2}",
]
QUESTION = "Give a short example answer in the required format."
MAX_PROMPT = 256


@pytest.fixture(scope="module")
def model(instruct: Instruct, tmp_path_factory: pytest.TempPathFactory) -> EngineModel:
    models = load_repository(instruct.repo)
    for name, m in models.items():
        if name != "tensorrt_llm":
            m.runner.close()
    served = models["tensorrt_llm"]
    served.runner.close()  # generations run here, on the test's thread
    return served


@pytest.fixture(scope="module")
def grammars(
    instruct: Instruct,
    model: EngineModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> Grammars:
    if model.grammars is not None:
        return model.grammars
    info = tmp_path_factory.mktemp("info") / "tokenizer_info.json"
    end_id = instruct.text.end_id
    assert end_id is not None
    write_tokenizer_info(
        instruct.repo / "tensorrt_llm" / "tokenizer" / "tokenizer.json", [end_id], info
    )
    return Grammars.load(info, model.model.config.vocab_size)


def test_every_sampled_answer_validates(
    instruct: Instruct,
    model: EngineModel,
    grammars: Grammars,
) -> None:
    text = instruct.text
    end_id = text.end_id
    guides: list[tuple[Guide, dict[str, Any] | str]] = [
        (Guide("json_schema", json.dumps(s)), s) for s in SCHEMAS
    ]
    guides += [(Guide("regex", r), r) for r in REGEXES]
    checked = 0
    # The prompt names the format (the model then writes short answers, not runs of the
    # whitespace the grammar allows); its K/V is prefilled once per guide and reused.
    cache = model.model.new_cache(MAX_PROMPT + MAX_TOKENS)
    for g, (guide, want) in enumerate(guides):
        compiled = grammars.compile(guide)
        prompt = text.encode_chat([{"role": "user", "content": f"{QUESTION} Format: {guide.text}"}])
        assert len(prompt) <= MAX_PROMPT
        start = 0
        for n in range(SAMPLES):
            params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=1000 * g + n)
            tokens = list(
                generate(
                    model.model,
                    prompt,
                    MAX_TOKENS,
                    end_id,
                    params,
                    cache=cache,
                    start_pos=start,
                    guide=compiled,
                )
            )
            start = len(prompt) - 1
            answer = text.tokenizer.decode(tokens)
            assert len(tokens) < MAX_TOKENS, f"cut at {MAX_TOKENS} tokens: {answer!r}"
            if isinstance(want, str):
                assert re.fullmatch(want, answer), (want, answer)
            else:
                jsonschema.validate(json.loads(answer), want)
            checked += 1
    assert checked == len(guides) * SAMPLES
