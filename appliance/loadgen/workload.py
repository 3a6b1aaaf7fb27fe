"""The requests a bench run sends: synthetic prompts of a drawn length, or prompts from a file.

The bench does not know the deployment's tokenizer, so a synthetic prompt of N tokens is N common
English words (each one token, or close to it, in the BPE vocabularies of Llama-family models, plus
the BOS and whatever a tokenizer adds). The token counts the bench reports are the gateway's own
(`usage` in the final message), not these targets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from appliance.grpc_limits import MAX_REQUEST_BYTES
from appliance.loadgen.options import MAX_LENGTH, BenchInputError, Lengths, Settings
from appliance.textfile import TextFileError, numbered_lines, read_text
from appliance.v1 import inference_pb2 as pb

COMMON_WORDS = (
    "the of and to in is was for on are with as at be this have from or by one had not but what "
    "all were when we there can an your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no "
    "make than first been its who now people my made over did down only way find use may water "
    "long little very after words called just where most know"
)
WORDS = tuple(COMMON_WORDS.split())

POLICIES = {
    "bypass": pb.CACHE_POLICY_BYPASS,
    "default": pb.CACHE_POLICY_DEFAULT,
    "refresh": pb.CACHE_POLICY_REFRESH,
}
MAX_PROMPT_FILE_BYTES = 256 * 2**20
# A prompt leaves room in the gateway's request limit for the request's other fields (the model's
# name among them).
MAX_PROMPT_BYTES = MAX_REQUEST_BYTES - 16 * 2**10
# The longest synthetic prompt that fits: each word and the space after it take at most this.
MAX_SYNTHETIC_WORDS = MAX_PROMPT_BYTES // (max(map(len, WORDS)) + 1)
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    """One entry of a prompt file: text or chat messages, and its own max_tokens if it sets one."""

    text: str | None = None
    messages: tuple[tuple[str, str], ...] = ()
    max_tokens: int | None = None


def _check_utf8(where: str, text: str) -> None:
    """A JSON string may escape a lone surrogate (\\ud800), which no UTF-8 request can carry."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise BenchInputError(
            f"{where}: {exc.object[exc.start]!r} at character {exc.start + 1} is a lone UTF-16 "
            "surrogate, not text: write the character itself, or both halves of its pair"
        ) from None


def _entry(where: str, line: str) -> Prompt:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BenchInputError(f"{where}: not JSON ({exc.msg})") from None
    except RecursionError:
        raise BenchInputError(f"{where}: not JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise BenchInputError(f"{where}: expected an object with 'prompt' or 'messages'")
    unknown = sorted(set(obj) - {"prompt", "messages", "max_tokens"})
    if unknown:
        raise BenchInputError(
            f"{where}: unknown key {unknown[0]!r}; known keys are prompt, messages, max_tokens"
        )
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (
        not isinstance(max_tokens, int)
        or isinstance(max_tokens, bool)
        or not 1 <= max_tokens <= MAX_LENGTH
    ):
        raise BenchInputError(
            f"{where}: 'max_tokens' must be a whole number from 1 to {MAX_LENGTH}"
        )
    if ("prompt" in obj) == ("messages" in obj):
        raise BenchInputError(f"{where}: give exactly one of 'prompt' and 'messages'")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise BenchInputError(f"{where}: 'prompt' must be a non-empty string")
        _check_utf8(where, obj["prompt"])
        return Prompt(text=obj["prompt"], max_tokens=max_tokens)
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise BenchInputError(f"{where}: 'messages' must be a non-empty list")
    pairs = []
    for m in messages:
        if (
            not isinstance(m, dict)
            or set(m) != {"role", "content"}
            or m["role"] not in ROLES
            or not isinstance(m["content"], str)
        ):
            raise BenchInputError(
                f'{where}: each message is {{"role": {"|".join(ROLES)}, "content": string}}'
            )
        _check_utf8(where, m["content"])
        pairs.append((m["role"], m["content"]))
    return Prompt(messages=tuple(pairs), max_tokens=max_tokens)


def _with_input(request: pb.GenerateRequest, prompt: Prompt) -> pb.GenerateRequest:
    """The request with the prompt's text or messages (one field, a oneof) set."""
    if prompt.text is not None:
        request.prompt = prompt.text
    else:
        request.messages.messages.extend(
            pb.ChatMessage(role=r, content=c) for r, c in prompt.messages
        )
    return request


def _check_size(where: str, prompt: Prompt) -> Prompt:
    """The prompt, unless the request that carries it would exceed gRPC's message limit."""
    size = _with_input(pb.GenerateRequest(), prompt).ByteSize()
    if size > MAX_PROMPT_BYTES:
        raise BenchInputError(
            f"{where}: the prompt is {size / 2**20:.1f} MiB; a request carries at most "
            f"{MAX_REQUEST_BYTES // 2**20} MiB (the gateway's gRPC message limit): shorten it"
        )
    return prompt


def load_prompts(path: Path) -> list[Prompt]:
    """One prompt per non-blank line, or JSONL (when the first non-blank line starts with `{`):
    objects with "prompt" or "messages" ([{"role", "content"}]) and optionally "max_tokens"."""
    try:
        content = read_text(path, MAX_PROMPT_FILE_BYTES)
    except TextFileError as exc:
        raise BenchInputError(f"--prompts {path}: {exc}") from None
    lines = [(n, line) for n, line in numbered_lines(content) if line.strip()]
    if not lines:
        raise BenchInputError(f"--prompts {path}: no prompts (the file is empty)")
    if lines[0][1].lstrip().startswith("{"):
        return [_check_size(f"{path}:{n}", _entry(f"{path}:{n}", line)) for n, line in lines]
    # A line of fewer characters than a quarter of the limit fits whatever they are (UTF-8 takes
    # at most 4 bytes a character).
    return [
        Prompt(text=line)
        if len(line) <= MAX_PROMPT_BYTES // 4
        else _check_size(f"{path}:{n}", Prompt(text=line))
        for n, line in lines
    ]


class Workload:
    """Makes the requests of one load level, the same ones for the same seed and level."""

    def __init__(self, settings: Settings, prompts: list[Prompt] | None, level_index: int) -> None:
        self.settings = settings
        self.prompts = prompts
        self.rng = np.random.default_rng([settings.seed, level_index])
        self.count = 0

    def _max_tokens(self, prompt: Prompt | None) -> int:
        if prompt is not None and prompt.max_tokens is not None:
            return prompt.max_tokens
        return self.settings.output_tokens.draw(self.rng)

    def next(self) -> pb.GenerateRequest:
        s = self.settings
        request = pb.GenerateRequest(
            model=s.model, temperature=s.temperature, cache_policy=POLICIES[s.cache_policy]
        )
        if self.prompts is None:
            request.prompt = synthetic_prompt(s.prompt_tokens, self.rng)
            request.max_tokens = self._max_tokens(None)
        else:
            prompt = self.prompts[self.count % len(self.prompts)]
            _with_input(request, prompt)
            request.max_tokens = self._max_tokens(prompt)
        self.count += 1
        return request


def synthetic_prompt(lengths: Lengths, rng: np.random.Generator) -> str:
    n = lengths.draw(rng)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=n))
