"""Grammar-constrained decoding: TensorRT-LLM's guided decoding, computed with xgrammar.

A request names a guide with the `tensorrt_llm` model's inputs `guided_decoding_guide_type` (one of
GUIDE_TYPES) and `guided_decoding_guide` (the schema, regex or grammar text; ignored for `json`,
which is any JSON value); engine_build.pbtxt holds that contract, its guide types
engine_build.guides. A model serves guides only when its config sets both `guided_decoding_backend` (`xgrammar`, the one backend the tensorrtllm
backend's C++ runtime takes) and `xgrammar_tokenizer_info_path` (the JSON file TensorRT-LLM reads:
`encoded_vocab`, `tokenizer_str`, `stop_token_ids`; engine_build.tokenizer_info writes it).

Guides are compiled the way TensorRT-LLM compiles them (xgrammar's defaults: any whitespace between
JSON tokens, strict schemas), once per (type, text) into a bounded LRU cache shared by the model's
requests. A guide is first compiled in a child process (guide_compile) killed after
COMPILE_DEADLINE_S or past COMPILE_MEMORY_BYTES, at most COMPILE_SLOTS at once per model, and
compiled here only once it compiled there: xgrammar's compile time is not bounded by a guide's size
(seconds per bounded length, minutes for deep nesting), and a thread running it could not be
stopped. Each generation gets its own matcher: at every step the allowed-token bitmask is filled on
the CPU, applied to the logits before sampling (greedy or sampled), and the matcher advances with
the chosen token. The end token is allowed only where the grammar may end; a step where no token
is allowed ends the generation like the end token does.

Bad guides are refused before a request reaches the compute thread, with what is wrong: an unknown
guide type (the tensorrtllm backend ignores one silently; here it is an error, so a typo never
yields unconstrained text), a missing guide text, a guide over MAX_GUIDE_BYTES, and a schema, regex
or grammar that does not compile, or not within its deadline and memory. A compile that waits
COMPILE_DEADLINE_S for a free slot is refused as busy.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from appliance.engine import guide_compile
from engine_build.guides import GUIDE_TYPES

if TYPE_CHECKING:
    import xgrammar

__all__ = [
    "GUIDE_TYPES",
    "MAX_GUIDE_BYTES",
    "NOT_SETUP_MESSAGE",
    "Grammars",
    "Guide",
    "GuideError",
    "GuidedMatcher",
    "parse_guide",
]

# Longest guide text accepted: tool and response schemas of real clients are a few KiB.
MAX_GUIDE_BYTES = 64 * 1024
# Compiled guides kept per model (least recently used first out).
CACHE_ENTRIES = 256
# Longest a guide's compile may run (vLLM bounds its regex compiles at 5 s): a real tool or response
# schema compiles in well under a second.
COMPILE_DEADLINE_S = 10.0
# Memory a compile may take beyond its process's own (the largest real schemas take tens of MiB).
COMPILE_MEMORY_BYTES = 4 << 30
# Compiles of one model running at once (each holds a core); a compile waits at most
# COMPILE_DEADLINE_S for one to end.
COMPILE_SLOTS = 2
# Time one generation's masks may take on the compute thread: seconds, plus seconds per token. A
# JSON Schema's mask fills in well under a millisecond; an ambiguous grammar's costs more at every
# token (its total grows with the square of the answer's length), holding every queued request.
MASK_BUDGET = (5.0, 0.005)
# What the executor answers (through the backend, as an error response) when a request carries a
# guide and the model was loaded without a guided decoder.
NOT_SETUP_MESSAGE = (
    "Encountered an error when fetching new request: [TensorRT-LLM][ERROR] Assertion failed: "
    "Request is specified with GuidedDecodingParams, but GuidedDecoder is not setup. Please "
    "provide a valid GuidedDecodingConfig to setup GuidedDecoder."
)
# Longest compiler message passed back to a client.
_MAX_REASON = 300
# xgrammar's messages start with a log prefix ("[12:00:00] /path/file.cc:123: ") and may say
# "Check failed: (...) is false: " before the reason.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GuideError(ValueError):
    """A guide that cannot be served; the message says what to fix."""


class GuideBusy(GuideError):
    """Every compile slot stayed taken while the guide waited: not the guide's fault."""


class GuideOverrun(GuideError):
    """A generation's masks took longer than the budget of its guide (MASK_BUDGET)."""


@dataclass(frozen=True)
class Guide:
    """A request's guide: its type (one of GUIDE_TYPES) and text ("" for `json`)."""

    kind: str
    text: str


def parse_guide(kind: str | None, text: str | None) -> Guide | None:
    """The request's guide, checked for what can be checked without compiling it.

    No type means no guide (a guide text alone is ignored, as in the backend).
    """
    if kind is None:
        return None
    if kind not in GUIDE_TYPES:
        raise GuideError(
            f"guided_decoding_guide_type {kind[:40]!r} is not one of {', '.join(GUIDE_TYPES)}"
        )
    if kind == "json":
        return Guide(kind, "")
    if not text:
        raise GuideError(f"guided_decoding_guide is required for guide type '{kind}'")
    size = len(text.encode("utf-8"))
    if size > MAX_GUIDE_BYTES:
        raise GuideError(
            f"guided_decoding_guide is {size} bytes; the limit is {MAX_GUIDE_BYTES} bytes"
        )
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GuideError(f"the JSON Schema is not valid JSON: {exc}") from None
        except RecursionError:
            raise GuideError(
                "the JSON Schema is nested too deeply to read (about 1,000 levels of JSON)"
            ) from None
        if not isinstance(schema, (dict, bool)):
            raise GuideError(
                f"the JSON Schema must be a JSON object or boolean, not {type(schema).__name__}"
            )
    return Guide(kind, text)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix or an echo of the input, bounded."""
    message = _LOG_PREFIX.sub("", str(exc).strip())
    message = message.split(" The JSON string is:", 1)[0]
    return message[:_MAX_REASON]


@dataclass
class GrammarStats:
    """Compiles (cache misses), cache hits, and the time spent compiling."""

    compiles: int = 0
    hits: int = 0
    compile_ns: int = 0


@dataclass
class Grammars:
    """One model's guided decoder: the xgrammar compiler and its cache of compiled guides.

    `compile` may run on several threads at once (the server compiles off its event loop);
    the matchers it hands out belong to one generation each.
    """

    compiler: xgrammar.GrammarCompiler
    tokenizer: xgrammar.TokenizerInfo
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    cache_entries: int = CACHE_ENTRIES
    deadline_s: float = COMPILE_DEADLINE_S
    memory_bytes: int = COMPILE_MEMORY_BYTES
    mask_budget: tuple[float, float] = MASK_BUDGET
    stats: GrammarStats = field(default_factory=GrammarStats)
    active: int = 0  # matchers of generations still running
    _cache: OrderedDict[Guide, xgrammar.CompiledGrammar] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    slots: threading.Semaphore = field(
        default_factory=lambda: threading.BoundedSemaphore(COMPILE_SLOTS)
    )
    _tokenizer_json: str = ""

    @classmethod
    def load(cls, tokenizer_info_path: Path, vocab_size: int) -> Grammars:
        """The decoder of a model whose logits have `vocab_size` entries; ValueError says why a
        tokenizer info file cannot be used, or that xgrammar is not installed."""
        try:
            import xgrammar as xgr
        except ImportError:
            raise ValueError(
                "its repository turns guided decoding on, which needs xgrammar: install the "
                "`guided` extra (pip install 'llm-appliance[guided]'), or write the repository "
                "with runtime.guided_decoding = false"
            ) from None

        try:
            info = json.loads(tokenizer_info_path.read_text(encoding="utf-8"))
            vocab = info["encoded_vocab"]
            tokenizer_str = info["tokenizer_str"]
            stop = [int(t) for t in info["stop_token_ids"]]
        except OSError as exc:
            raise ValueError(f"{tokenizer_info_path}: cannot read: {exc.strerror}") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{tokenizer_info_path}: not a tokenizer info file (a JSON object with "
                f"encoded_vocab, tokenizer_str and stop_token_ids): {exc!r}"
            ) from exc
        if not isinstance(vocab, list) or not all(isinstance(t, str) for t in vocab):
            raise ValueError(f"{tokenizer_info_path}: encoded_vocab must be a list of strings")
        if len(vocab) > vocab_size or any(not 0 <= t < vocab_size for t in stop):
            raise ValueError(
                f"{tokenizer_info_path}: {len(vocab)} tokens and stop tokens {stop} do not fit "
                f"the model's vocabulary of {vocab_size}"
            )
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_str)
        tokenizer = xgr.TokenizerInfo(vocab, vocab_size=vocab_size, stop_token_ids=stop, **metadata)
        compiler = xgr.GrammarCompiler(tokenizer, max_threads=1, cache_enabled=False)
        guide_compile.start()
        grammars = cls(
            compiler, tokenizer, vocab_size, tuple(stop), _tokenizer_json=tokenizer.serialize_json()
        )
        # One compile now (not counted in the stats, which are the requests'): it starts the
        # forkserver (seconds: it imports xgrammar), caches the `json` guide, and finds a child
        # that cannot run (its main script must import cleanly).
        try:
            grammars.compile(Guide("json", ""))
        except GuideError as exc:
            raise ValueError(
                f"guided decoding cannot compile a guide in a child process ({exc}): start the "
                "engine as the `appliance engine` command or `python -m appliance`"
            ) from None
        grammars.stats = GrammarStats()
        return grammars

    def cached(self, guide: Guide) -> CompiledGuide | None:
        """The compiled guide if the cache holds it (a lookup: call it on the event loop)."""
        with self._lock:
            grammar = self._cache.get(guide)
            if grammar is None:
                return None
            self._cache.move_to_end(guide)
            self.stats.hits += 1
            return CompiledGuide(self, grammar)

    def compile(self, guide: Guide) -> CompiledGuide:
        """The compiled guide, from the cache or compiled now. Blocks while it waits for a slot
        (up to the deadline), compiles in a child (up to the deadline), then compiles here (about
        as long again); GuideError if it does not compile, GuideBusy if no slot came free (the
        gateway reads its words "other guides were being compiled")."""
        hit = self.cached(guide)
        if hit is not None:
            return hit
        if not self.slots.acquire(timeout=self.deadline_s):
            raise GuideBusy(
                f"the guide was not compiled: {COMPILE_SLOTS} other guides were being compiled "
                f"for {self.deadline_s:g} s; try again later"
            )
        try:
            started = time.monotonic_ns()
            grammar = self._compile(guide)
        finally:
            self.slots.release()
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_ns += time.monotonic_ns() - started
            self._cache[guide] = grammar
            self._cache.move_to_end(guide)
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return CompiledGuide(self, grammar)

    def _compile(self, guide: Guide) -> xgrammar.CompiledGrammar:
        what = {
            "json_schema": "the JSON Schema",
            "regex": "the regular expression",
            "ebnf_grammar": "the EBNF grammar",
        }.get(guide.kind, "the guide")
        try:
            guide_compile.compile_in_child(
                self._tokenizer_json, guide.kind, guide.text, self.deadline_s, self.memory_bytes
            )
        except guide_compile.CompileFailed as exc:
            raise GuideError(f"{what} cannot be compiled: {_reason(exc)}") from None
        except guide_compile.CompileTimeout:
            raise GuideError(
                f"{what} cannot be compiled within {self.deadline_s:g} s: make it smaller (each "
                "bounded length or repetition count, e.g. maxLength, maxItems or {m,n}, and each "
                "level of nesting adds compile time)"
            ) from None
        except guide_compile.CompileMemory:
            raise GuideError(
                f"{what} cannot be compiled within {self.memory_bytes >> 20} MiB of memory: make "
                "it smaller (less nesting, fewer bounded lengths or repetition counts)"
            ) from None
        except guide_compile.CompileCrashed as exc:
            raise GuideError(
                f"{what} cannot be compiled: its compiler ended (exit code {exc}); make it "
                "smaller or less deeply nested"
            ) from None
        try:
            grammar: xgrammar.CompiledGrammar = guide_compile.compile_guide(
                self.compiler, guide.kind, guide.text
            )
        except (RuntimeError, ValueError) as exc:
            raise GuideError(f"{what} cannot be compiled: {_reason(exc)}") from None
        return grammar

    def snapshot(self) -> tuple[GrammarStats, int]:
        """A consistent copy of the cache's counters, and the matchers still open."""
        with self._lock:
            return replace(self.stats), self.active

    def _opened(self, delta: int) -> None:
        with self._lock:
            self.active += delta


@dataclass(frozen=True)
class CompiledGuide:
    """A compiled guide of one model, ready to start a generation's matcher."""

    grammars: Grammars
    grammar: xgrammar.CompiledGrammar

    def matcher(self, end_id: int | None) -> GuidedMatcher:
        """A matcher for one generation. With an `end_id` the grammar ends on that token, as the
        generation does; without one, on the tokenizer's stop tokens, and sampling one of them
        ends the generation."""
        stop = (end_id,) if end_id is not None else self.grammars.stop_token_ids
        return GuidedMatcher(self.grammars, self.grammar, stop)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


class GuidedMatcher:
    """One generation's grammar state: the allowed-token mask of the next step and the tokens
    that end the grammar. `close` (or the generation ending) releases it."""

    def __init__(
        self, grammars: Grammars, grammar: xgrammar.CompiledGrammar, stop: tuple[int, ...]
    ) -> None:
        import xgrammar as xgr

        self._grammars = grammars
        self._matcher: Any = xgr.GrammarMatcher(grammar, override_stop_tokens=list(stop) or None)
        self._bitmask = xgr.allocate_token_bitmask(1, grammars.vocab_size)[0]
        self.stop = frozenset(stop)
        self._budget = grammars.mask_budget
        self._mask_ns = 0
        self._masks = 0
        self._filled = False
        self._any_allowed = False
        self._open = True
        grammars._opened(1)

    def fill(self) -> None:
        """Compute the next step's mask (on the CPU; run it while the device computes logits);
        GuideOverrun once the generation's masks have taken more than their budget."""
        started = time.monotonic_ns()
        if self._matcher.is_terminated():
            self._bitmask.zero_()
        else:
            self._matcher.fill_next_token_bitmask(self._bitmask)
        self._any_allowed = bool(self._bitmask.any())
        self._filled = True
        self._mask_ns += time.monotonic_ns() - started
        self._masks += 1
        base, rate = self._budget
        if self._mask_ns > (base + rate * self._masks) * 1e9:
            raise GuideOverrun(
                f"the guide's grammar took {self._mask_ns / 1e9:.1f} s to compute the token masks "
                f"of {self._masks} tokens, more than {base:g} s + {rate * 1000:g} ms a token: an "
                "ambiguous grammar (alternatives that match the same text under a repetition, "
                "e.g. (a | b)* with a ::= [a-z]* and b ::= [a-z]* [a-z]*) costs more at every "
                "token; make each choice decidable from the next characters"
            )

    def apply(self, logits: torch.Tensor) -> bool:
        """Mask the disallowed tokens of a (vocab,) logits vector in place; False when no token
        is allowed (the generation must end)."""
        if not self._filled:
            self.fill()
        if not self._any_allowed:
            return False
        with torch.inference_mode():  # the logits are inference tensors
            words = self._bitmask.to(logits.device)
            allowed = ((words.unsqueeze(-1) >> _shifts(logits.device)) & 1).flatten()
            logits.masked_fill_(allowed[: logits.shape[-1]] == 0, float("-inf"))
        return True

    def advance(self, token: int) -> None:
        """Accept the chosen token and compute the next mask."""
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"token {token} was sampled outside the grammar's mask")
        self.fill()

    def close(self) -> None:
        if self._open:
            self._open = False
            self._grammars._opened(-1)
