"""Prompt-lookup speculative decoding: greedy output unchanged, sampled distribution unchanged."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import appliance.engine.sampling as sampling
import appliance.engine.speculative as speculative
from appliance.engine.llama import KVCache, LlamaModel
from appliance.engine.options import EngineOptions
from appliance.engine.prefix_cache import PrefixCache
from appliance.engine.runner import Emission, Job, Runner
from appliance.engine.sampling import Sampler, SamplingParams, TopLogprobs, generate
from appliance.engine.speculative import (
    NgramSpeculation,
    OffSwitch,
    SpecCounts,
    accept_sampled,
    propose,
)
from tests.engine.conftest import write_micro_checkpoint

GREEDY = SamplingParams(top_k=1)
# The off switch never trips here: these tests are about what verify steps do.
NEVER_OFF = OffSwitch(min_accepted=0.0)
SPEC = NgramSpeculation(draft_tokens=4, ngram=3, off_switch=NEVER_OFF)
END = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    """The micro model with room for long generations (greedy random models fall into loops)."""
    dest = tmp_path_factory.mktemp("spec")
    return LlamaModel.load(write_micro_checkpoint(dest, {"max_position_embeddings": 256}))


def prompts() -> Iterator[tuple[list[int], bool]]:
    """(prompt, repetitive) of mixed kinds: random, a repeated phrase, single tokens."""
    rng = random.Random(7)
    for i in range(30):
        phrase = [rng.randrange(3, 97) for _ in range(rng.randrange(1, 16))]
        repetitive = i % 2 == 1
        yield (phrase * 3 if repetitive else phrase), repetitive


def run(
    model: LlamaModel,
    prompt: list[int],
    n: int,
    spec: NgramSpeculation | None,
    counts: SpecCounts | None = None,
    params: SamplingParams = GREEDY,
    end_id: int | None = END,
    **kwargs: object,
) -> list[int]:
    return list(
        generate(model, prompt, n, end_id, params, speculation=spec, spec_counts=counts, **kwargs)  # type: ignore[arg-type]
    )


def test_propose_copies_what_followed_the_last_ngram() -> None:
    assert propose([1, 2, 3, 9, 8, 7, 1, 2, 3], 2, 3) == [9, 8]
    assert propose([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 4, 3) == [5, 6, 1, 2]  # most recent match
    assert propose([5, 1, 2, 3, 4, 6, 4], 3, 3) == [6, 4]  # falls back to a 1-gram
    assert propose([1, 2, 3], 4, 3) == []
    assert propose([1, 1], 0, 3) == []


def test_greedy_output_is_unchanged_and_drafts_are_accepted(model: LlamaModel) -> None:
    accepted_on_repetitive = 0
    for prompt, repetitive in prompts():
        counts = SpecCounts()
        assert run(model, prompt, 150, SPEC, counts) == run(model, prompt, 150, None), prompt
        assert counts.accepted <= counts.proposed
        if repetitive:
            accepted_on_repetitive += counts.accepted
    assert accepted_on_repetitive > 0


def test_other_draft_lengths_and_ngrams_give_the_same_output(model: LlamaModel) -> None:
    prompt = [11, 12, 13, 14] * 4
    plain = run(model, prompt, 120, None)
    for k, n in ((1, 1), (2, 2), (8, 3), (16, 8)):
        assert run(model, prompt, 120, NgramSpeculation(k, n, NEVER_OFF)) == plain


def accepted_positions(
    model: LlamaModel, prompt: list[int], n: int, monkeypatch: pytest.MonkeyPatch
) -> list[int]:
    """Indices in the output of tokens that were accepted drafts."""
    found: list[int] = []
    real = speculative.verify  # what sampling calls, and the name patched there

    def recording(m: LlamaModel, cache: KVCache, pos: int, *args: Any, **kwargs: Any) -> list[int]:
        chosen = real(m, cache, pos, *args, **kwargs)
        found.extend(pos + 1 + i - len(prompt) for i in range(len(chosen) - 1))
        return chosen

    monkeypatch.setattr(sampling, "verify", recording)
    run(model, prompt, n, SPEC, end_id=None)
    monkeypatch.undo()
    return found


def repetitive_with_acceptance(model: LlamaModel) -> list[int]:
    for prompt, repetitive in prompts():
        counts = SpecCounts()
        run(model, prompt, 150, SPEC, counts)
        if repetitive and counts.accepted >= 2:
            return prompt
    raise AssertionError("no prompt had accepted drafts")


def test_max_tokens_inside_an_accepted_run_ends_where_it_would(
    model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = repetitive_with_acceptance(model)
    inside = accepted_positions(model, prompt, 150, monkeypatch)
    assert inside
    for n in sorted({*inside, *(i + 1 for i in inside), 1, 2, 3}):
        assert run(model, prompt, n, SPEC) == run(model, prompt, n, None), n


def test_end_token_inside_an_accepted_run_ends_where_it_would(
    model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An accepted draft whose token does not occur earlier in the output: as the end id it ends
    # the output there.
    cases = 0
    for prompt, _ in prompts():
        plain = run(model, prompt, 150, None, end_id=None)
        inside = accepted_positions(model, prompt, 150, monkeypatch)
        for index in (i for i in inside if plain[i] not in plain[:i]):
            end = plain[index]
            spec = run(model, prompt, 150, SPEC, end_id=end)
            assert spec == run(model, prompt, 150, None, end_id=end) == plain[:index]
            cases += 1
    assert cases > 0


def test_min_tokens_masks_the_end_id_in_verify_rows(model: LlamaModel) -> None:
    for prompt, _ in prompts():
        for end in (END, prompt[0]):
            with_spec = run(model, prompt, 40, SPEC, end_id=end, min_tokens=20)
            assert with_spec == run(model, prompt, 40, None, end_id=end, min_tokens=20)


def tv_distance(draws: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(draws), minlength=probs.shape[0]).double()
    return 0.5 * float((counts / len(draws) - probs.double()).abs().sum())


@pytest.mark.parametrize("draft", [0, 2, 4])
def test_acceptance_rule_keeps_the_target_distribution(draft: int) -> None:
    """20,000 seeded draws: total-variation distance to the target below 0.02 (its sampling
    spread at this size is about 0.01), whatever the draft's own probability (0 for token 4)."""
    probs = torch.tensor([0.05, 0.1, 0.4, 0.25, 0.0, 0.2])
    gen = torch.Generator().manual_seed(1)
    draws, accepted = [], 0
    for _ in range(20_000):
        token, ok = accept_sampled(probs, draft, gen)
        draws.append(token)
        accepted += ok
        assert ok == (token == draft)
    assert tv_distance(draws, probs) < 0.02
    assert abs(accepted / 20_000 - float(probs[draft])) < 0.02


def test_a_draft_with_all_the_mass_is_always_accepted() -> None:
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 1.0, 0.0])
    assert all(accept_sampled(probs, 1, gen) == (1, True) for _ in range(100))


def test_distribution_is_what_the_sampler_draws_from() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, 3.0])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=3)
    probs = Sampler(params).distribution(logits)
    assert abs(float(probs.sum()) - 1.0) < 1e-6
    sampler = Sampler(params)
    draws = [sampler(logits) for _ in range(20_000)]
    assert tv_distance(draws, probs) < 0.02


def test_sampled_generation_with_speculation_is_in_the_vocabulary(model: LlamaModel) -> None:
    params = SamplingParams(temperature=0.7, top_k=20, seed=5)
    counts = SpecCounts()
    out = run(model, [7, 8, 9] * 6, 100, SPEC, counts, params=params)
    assert out and all(0 <= t < model.config.vocab_size for t in out)
    assert counts.proposed > 0


def test_logprobs_requests_run_without_speculation(model: LlamaModel) -> None:
    counts = SpecCounts()
    prompt = [11, 12, 13, 14] * 4
    logprobs: list[float] = []
    out = run(model, prompt, 60, SPEC, counts, logprobs=logprobs)
    assert out == run(model, prompt, 60, None)
    assert counts.proposed == 0 and len(logprobs) == len(out)
    # Alternatives alone switch it off too: each step's come from that step's own logits.
    top = TopLogprobs(3)
    counts = SpecCounts()
    assert run(model, prompt, 60, SPEC, counts, top_logprobs=top) == out
    assert counts.proposed == 0 and len(top.ids) == len(out)


def run_job(runner: Runner, prompt: list[int], n: int) -> list[int]:
    done = threading.Event()
    out: list[Emission] = []

    def emit(e: Emission) -> None:
        out.append(e)
        if e.final:
            done.set()

    runner.submit(Job("s", prompt, n, None, GREEDY, streaming=True, emit=emit))
    assert done.wait(60)
    with runner.stats.changed:
        runner.stats.changed.wait_for(lambda: runner.stats.running is None, timeout=60)
    return [t for e in out for t in (e.tokens or [])]


def test_runner_counts_drafts_and_keeps_the_prefix_pool_consistent(model: LlamaModel) -> None:
    pool = PrefixCache(model.config, 64, 4, "fp", model.device, model.dtype)
    spec = Runner(model, 256, 4, prefix=pool, speculation=SPEC)
    plain = Runner(model, 256, 4)
    try:
        prompt = repetitive_with_acceptance(model)
        first = run_job(spec, prompt, 100)
        assert first == run_job(plain, prompt, 100)
        assert spec.stats.spec_draft_tokens > 0
        assert 0 < spec.stats.spec_accepted_tokens <= spec.stats.spec_draft_tokens
        assert plain.stats.spec_draft_tokens == 0
        # The pooled blocks hold the speculative run's history: a request continuing it from
        # the pool computes what a fresh one computes.
        longer = prompt + first[:40]
        assert run_job(spec, longer, 30) == run_job(plain, longer, 30)
        assert spec.stats.kv.reused_blocks > 0
    finally:
        spec.close()
        plain.close()


@pytest.mark.parametrize(
    ("options", "option"),
    [
        (EngineOptions(speculative="ngram", draft_tokens=0), "--draft-tokens 0"),
        (EngineOptions(speculative="ngram", draft_tokens=17), "--draft-tokens 17"),
        (EngineOptions(speculative="ngram", ngram=0), "--ngram 0"),
    ],
)
def test_out_of_range_options_are_refused(options: EngineOptions, option: str) -> None:
    problem = options.problem()
    assert problem is not None and problem[0] == option


def test_speculation_is_off_by_default(tmp_path: Path) -> None:
    assert EngineOptions().speculation is None
    assert EngineOptions(speculative="ngram").speculation == NgramSpeculation(4, 3)
