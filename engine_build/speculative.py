"""Speculative decoding in a TensorRT-LLM 1.2 engine: the `[speculative]` table's modes and facts.

One place for what each mode needs from the build, the checkpoint stage, the Triton repository
and the fit plan (the facts were read in the TensorRT-LLM 1.2-line sources; docs/ENGINE_BUILD.md
"Speculative decoding" names them):

- ``draft_target``: a second (draft) model with the target's tokenizer proposes ``max_draft_len``
  tokens; the target engine is built with ``--speculative_decoding_mode draft_tokens_external
  --max_draft_len K`` and paged context FMHA (the draft-target flow reuses KV blocks), the draft
  engine without speculative flags (``--gather_generation_logits`` when its logits are used for
  acceptance). Triton serves the draft as a second ``tensorrtllm`` model, ``tensorrt_llm_draft``.
- ``medusa``: heads on the target (examples/medusa/convert_checkpoint.py), ``--speculative_decoding_mode
  medusa --max_draft_len len(choices)``; the backend reads ``decoding_mode medusa`` and
  ``medusa_choices``. The examples support FP16/BF16 only.
- ``eagle``: an EAGLE-1 drafter (examples/eagle/convert_checkpoint.py with ``--max_draft_len``,
  ``--num_eagle_layers``, ``--max_non_leaves_per_layer``), ``--speculative_decoding_mode eagle``;
  the backend reads ``decoding_mode eagle`` and ``eagle_choices`` (its EagleConfig takes only the
  choices, so EAGLE-2's dynamic tree cannot be set on a Triton model). FP16/BF16 only.
- ``lookahead``: no extra weights; ``--speculative_decoding_mode lookahead_decoding --max_draft_len
  f(W, N, G)`` where f is `lookahead_draft_len`; the backend needs ``decoding_mode lookahead`` and
  all three of ``lookahead_window_size``, ``lookahead_ngram_size``,
  ``lookahead_verification_set_size`` (it fails the model load when one is missing).

trtllm-build adds ``max_draft_len`` (and for EAGLE ``num_eagle_layers``) to the engine's
``max_seq_len`` and raises ``max_num_tokens`` to ``max_batch_size * (max_draft_len + 1)``, and
refuses ``--gather_context_logits`` with a draft length; EAGLE asserts ``max_draft_len <= 256``.
The backend turns ``speculative_decoding_fast_logits`` off unless it runs in orchestrator mode
without spawned processes, which the appliance never does, so it is written ``false``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODES = ("none", "draft_target", "medusa", "eagle", "lookahead")
# --speculative_decoding_mode of each mode (trtllm-build's choices).
BUILD_MODE = {
    "draft_target": "draft_tokens_external",
    "medusa": "medusa",
    "eagle": "eagle",
    "lookahead": "lookahead_decoding",
}
# The backend's `decoding_mode` parameter; draft-target takes its drafts per request instead.
DECODING_MODE = {"medusa": "medusa", "eagle": "eagle", "lookahead": "lookahead"}
DECODING_MODES = (
    "top_k",
    "top_p",
    "top_k_top_p",
    "beam_search",
    "medusa",
    "redrafter",
    "lookahead",
    "eagle",
)
# trtllm-build asserts this for EAGLE; the same bound keeps every mode's step bounded.
DRAFT_LEN_MAX = 256
DRAFT_MODEL_NAME = "tensorrt_llm_draft"
LOOKAHEAD_PARAMETERS = (
    "lookahead_window_size",
    "lookahead_ngram_size",
    "lookahead_verification_set_size",
)
# The target's per-request inputs of draft-target speculation (as the 1.2 template declares them).
DRAFT_INPUTS = ("draft_input_ids", "draft_logits", "draft_acceptance_threshold")

Choices = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Speculative:
    """The validated `[speculative]` table; fields unused by ``mode`` keep their defaults."""

    mode: str = "none"
    max_draft_len: int = 0  # draft_target and eagle take it; medusa/lookahead derive it
    draft_hf_model_dir: Path | None = None
    use_draft_logits: bool = False
    medusa_model_dir: Path | None = None
    num_medusa_heads: int = 4
    num_medusa_layers: int = 1
    medusa_choices: Choices = ()
    eagle_model_dir: Path | None = None
    num_eagle_layers: int = 4
    max_non_leaves_per_layer: int = 10
    eagle_choices: Choices = ()
    eagle_dynamic_tree: bool = False
    lookahead_window_size: int = 0
    lookahead_ngram_size: int = 0
    lookahead_verification_set_size: int = 0

    @property
    def on(self) -> bool:
        return self.mode != "none"

    @property
    def draft_len(self) -> int:
        """The ``--max_draft_len`` the target engine is built with (0: no speculation)."""
        if self.mode == "medusa":
            return len(self.medusa_choices)
        if self.mode == "lookahead":
            return lookahead_draft_len(
                self.lookahead_window_size,
                self.lookahead_ngram_size,
                self.lookahead_verification_set_size,
            )
        if self.mode in ("draft_target", "eagle"):
            return self.max_draft_len
        return 0

    @property
    def extra_seq_len(self) -> int:
        """What trtllm-build adds to ``max_seq_len``: the draft length, and EAGLE's layers."""
        if not self.on:
            return 0
        return self.draft_len + (self.num_eagle_layers if self.mode == "eagle" else 0)


def lookahead_draft_len(window: int, ngram: int, verification: int) -> int:
    """``max_draft_len`` of a lookahead (W, N, G): (N == 1 ? 0 : N - 2) + (W - 1 + G) * (N - 1)."""
    return (0 if ngram == 1 else ngram - 2) + (window - 1 + verification) * (ngram - 1)


def choices_text(choices: Choices) -> str:
    """Choices in the backend's parameter form: ``{0}, {0, 0}, {1}`` (csvStrToVecVecInt)."""
    return ", ".join("{" + ", ".join(str(i) for i in path) + "}" for path in choices)


def parse_choices(text: str) -> Choices:
    """The inverse of `choices_text`; ValueError when the backend could not parse it either."""
    text = text.strip()
    if not text:
        raise ValueError("empty")
    paths: list[tuple[int, ...]] = []
    for part in text.split("}"):
        part = part.strip().lstrip(",").strip()
        if not part:
            continue
        if not part.startswith("{"):
            raise ValueError(f"expected '{{' before {part!r}")
        paths.append(tuple(int(x) for x in part[1:].split(",")))
    if not paths or not text.endswith("}"):
        raise ValueError("expected {i, j, ...} groups separated by commas")
    return tuple(paths)


def tree_problem(choices: Choices, what: str) -> str | None:
    """Why a Medusa/EAGLE choices tree is malformed (None: it is a tree)."""
    if not choices:
        return f"{what} must list at least one path, e.g. [[0], [0, 0], [1]]"
    seen: set[tuple[int, ...]] = set()
    nodes = set(choices)
    for path in choices:
        if not path:
            return f"{what} has an empty path; every path names at least one top-k index"
        if any(i < 0 for i in path):
            return f"{what} path {list(path)} has a negative index"
        if path in seen:
            return f"{what} lists {list(path)} twice"
        if len(path) > 1 and path[:-1] not in nodes:
            return f"{what} path {list(path)} has no parent {list(path[:-1])} in the tree"
        seen.add(path)
    return None


def non_leaves_per_level(choices: Choices) -> dict[int, int]:
    """Non-leaf nodes at each depth (0: the root's children)."""
    parents = {path[:-1] for path in choices if len(path) > 1}
    counts: dict[int, int] = {}
    for parent in parents:
        counts[len(parent) - 1] = counts.get(len(parent) - 1, 0) + 1
    return counts
