"""The draft-model drafter: a smaller Llama of the target's tokenizer proposes the drafts.

The draft model runs in the engine's process, on the target's device, with one static KV cache of
its own (the runner serves one request at a time, so one cache serves every request). The cache is
kept in step with the text by comparison, not by bookkeeping of accepts: `_cached` names the
tokens whose K/V the cache holds, and each proposal keeps the longest prefix it shares with the
text (the rollback of rejected drafts; across requests, a shared prompt prefix is reused) and runs
the rest. A text that runs ahead of the cache by more than one prefill chunk (a new long prompt)
is caught up one chunk per decode step, drafting nothing meanwhile, so a cancellation never waits
for more than one chunk of the draft model.

A draft model must share the target's tokenizer, or its drafts are other tokens' ids:
`check_draft_model` refuses one whose vocabulary size, special token ids or tokenizer.json differ.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from appliance.engine.llama import CheckpointError, LlamaConfig, LlamaModel, load_config
from appliance.engine.speculative import MAX_DRAFT_TOKENS, AcceptanceMemory, Draft, OffSwitch

if TYPE_CHECKING:
    from appliance.engine.sampling import Sampler

__all__ = ["DraftModelDrafter", "check_draft_model", "draft_off_switch"]

TOKENIZER_FILE = "tokenizer.json"
# Besides the ids LlamaConfig reads (bos, eos), the special ids config.json may name.
_SPECIAL_KEYS = ("pad_token_id", "unk_token_id")
# What a verify step of k + 1 rows is taken to cost beyond a single step, in single steps: a
# batch-1 step reads every weight once whatever its rows, so the extra rows cost little.
VERIFY_OVERHEAD = 0.25


def draft_off_switch(draft_tokens: int, draft: LlamaModel, target: LlamaModel) -> OffSwitch:
    """The switch at this pair's break-even: k draft steps, each costing the draft's share of the
    target's weight bytes, plus the verify overhead, must be repaid by accepted drafts (until the
    drafter's memory has measured the break-even). A costly drafter probes rarely (one verify
    step every 64 tokens); its window (4 verify steps) applies only with `probe_every` 0."""
    ratio = draft.weight_bytes / target.weight_bytes
    return OffSwitch(
        window=4,
        min_accepted=VERIFY_OVERHEAD + draft_tokens * ratio,
        cooldown=64,
        probe_every=64,
    )


class DraftModelDrafter:
    """Drafts of a draft model run greedily, or sampled with the request's sampler (returning its
    distributions, for the rejection rule)."""

    def __init__(
        self,
        model: LlamaModel,
        max_seq_len: int,
        draft_tokens: int,
        prefill_chunk: int,
        off_switch: OffSwitch | None = None,
    ) -> None:
        if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {draft_tokens}")
        if prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        self.model = model
        self.cache = model.new_cache(min(max_seq_len, model.config.max_position_embeddings))
        self.draft_tokens = draft_tokens
        self.prefill_chunk = prefill_chunk
        self.off_switch = off_switch or OffSwitch(min_accepted=VERIFY_OVERHEAD)
        self.memory = AcceptanceMemory()
        # The tokens whose K/V the cache holds at positions 0..len-1.
        self._cached: list[int] = []

    @property
    def cached(self) -> list[int]:
        """A copy of the tokens the draft cache holds, in position order."""
        return self._cached[:]

    def propose(self, text: Sequence[int], limit: int, sampler: Sampler) -> Draft:
        k = min(self.draft_tokens, limit)
        n = len(text)
        if k <= 0 or n + k - 1 > self.cache.max_seq_len:
            return Draft([])
        # Keep what the cache shares with the text; the last token is always run (its logits).
        common = min(_common_prefix(self._cached, text), n - 1)
        del self._cached[common:]
        behind = list(text[common:])
        if len(behind) > self.prefill_chunk:
            self._run(behind[: self.prefill_chunk], common)
            return Draft([])
        logits = self._run(behind, common)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        while True:
            token, q = sampler.draw(logits)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if len(tokens) == k:
                break
            logits = self._run([token], n + len(tokens) - 1)
        return Draft(tokens, torch.stack(probs) if probs else None)

    def _run(self, tokens: list[int], start: int) -> torch.Tensor:
        """Logits of the last of `tokens` run at `start` (= len(_cached)); then they are cached."""
        logits = self.model.forward(tokens, self.cache, start)
        self._cached.extend(tokens)
        return logits


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def _special_ids(config: LlamaConfig, raw: dict[str, Any]) -> dict[str, object]:
    ids: dict[str, object] = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids,
    }
    ids.update({key: raw.get(key) for key in _SPECIAL_KEYS})
    return ids


def _tokenizer(model_dir: Path) -> object | None:
    path = model_dir / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        parsed: object = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable tokenizer: {exc}") from exc
    return parsed


def check_draft_model(draft_dir: Path, target_dir: Path | None, target: LlamaConfig) -> LlamaConfig:
    """The draft model's config, or CheckpointError (one line) when it is not a Llama checkpoint
    the engine runs or its tokenizer is not the target's: vocabulary size, special token ids
    (config.json) and tokenizer.json (parsed, when either directory has one) must be equal."""
    draft_dir = Path(draft_dir)
    config = load_config(draft_dir)
    what = f"draft model {draft_dir}"
    if config.vocab_size != target.vocab_size:
        raise CheckpointError(
            f"{what}: vocabulary of {config.vocab_size} tokens, the target's has "
            f"{target.vocab_size}; a draft model must share the target's tokenizer"
        )
    raw_draft = _raw_config(draft_dir)
    raw_target = _raw_config(target_dir) if target_dir is not None else {}
    mine, theirs = _special_ids(config, raw_draft), _special_ids(target, raw_target)
    for key in mine:
        if target_dir is not None and mine[key] != theirs[key]:
            raise CheckpointError(
                f"{what}: {key} {mine[key]} differs from the target's {theirs[key]}; a draft "
                "model must share the target's tokenizer"
            )
    if target_dir is not None:
        draft_tok, target_tok = _tokenizer(draft_dir), _tokenizer(Path(target_dir))
        if draft_tok != target_tok:
            differs = (
                f"only one of it and the target ({target_dir}) has a {TOKENIZER_FILE}"
                if draft_tok is None or target_tok is None
                else f"its {TOKENIZER_FILE} differs from the target's ({target_dir})"
            )
            raise CheckpointError(
                f"{what}: {differs}; a draft model must share the target's tokenizer"
            )
    return config


def _raw_config(model_dir: Path) -> dict[str, Any]:
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}
