"""The draft-model drafter: greedy output unchanged, sampled distribution unchanged, its cache in
step with the target's, a draft of another tokenizer refused, and the off switch."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import appliance.engine.sampling as sampling
import appliance.engine.speculative as speculative
from appliance.engine.draft_model import DraftModelDrafter, check_draft_model
from appliance.engine.llama import CheckpointError, KVCache, LlamaModel
from appliance.engine.options import EngineOptions
from appliance.engine.prefix_cache import PrefixCache
from appliance.engine.repository import RepositoryError
from appliance.engine.runner import Emission, Job, Runner
from appliance.engine.sampling import Sampler, SamplingParams, generate
from appliance.engine.server import load_repository
from appliance.engine.speculative import (
    AcceptanceMemory,
    Draft,
    Drafter,
    OffSwitch,
    SpecCounts,
    Speculator,
    accept_sampled,
)
from engine_build.repo import write_hf_repository
from tests.engine.conftest import write_micro_checkpoint
from tests.support import byte_level_tokenizer

GREEDY = SamplingParams(top_k=1)
END = 2
SEQ = 256
NEVER_OFF = OffSwitch(min_accepted=0.0)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_micro_checkpoint(
        tmp_path_factory.mktemp("target"), {"max_position_embeddings": SEQ}
    )


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same random-weights maker with one layer: the target's first layer, embedding, norm
    and head (the tensors are drawn in the same order), so a layer-skip draft of it."""
    return write_micro_checkpoint(
        tmp_path_factory.mktemp("draft"), {"max_position_embeddings": SEQ, "num_hidden_layers": 1}
    )


@pytest.fixture(scope="module")
def model(target_dir: Path) -> LlamaModel:
    return LlamaModel.load(target_dir)


@pytest.fixture(scope="module")
def small(draft_dir: Path) -> LlamaModel:
    return LlamaModel.load(draft_dir)


def drafter(draft: LlamaModel, k: int = 4, chunk: int = 64) -> DraftModelDrafter:
    return DraftModelDrafter(draft, SEQ, k, chunk, NEVER_OFF)


def prompts() -> Iterator[list[int]]:
    rng = random.Random(11)
    for i in range(12):
        phrase = [rng.randrange(3, 97) for _ in range(rng.randrange(1, 12))]
        yield phrase * (1 + i % 3)


def run(
    model: LlamaModel,
    prompt: list[int],
    n: int,
    spec: Drafter | None,
    counts: SpecCounts | None = None,
    params: SamplingParams = GREEDY,
    end_id: int | None = END,
    min_tokens: int = 0,
) -> list[int]:
    return list(
        generate(
            model,
            prompt,
            n,
            end_id,
            params,
            min_tokens=min_tokens,
            speculation=spec,
            spec_counts=counts,
        )
    )


def test_greedy_output_with_a_smaller_draft_model_is_unchanged(
    model: LlamaModel, small: LlamaModel
) -> None:
    spec = drafter(small)
    counts = SpecCounts()
    for prompt in prompts():
        assert run(model, prompt, 120, spec, counts) == run(model, prompt, 120, None), prompt
    assert 0 < counts.accepted <= counts.proposed
    assert counts.verify_steps > 0


@pytest.mark.parametrize("k", [1, 3, 16])
def test_the_target_as_its_own_draft_accepts_every_draft(model: LlamaModel, k: int) -> None:
    spec = drafter(model, k)
    for prompt in prompts():
        counts = SpecCounts()
        plain = run(model, prompt, 100, None, end_id=None)
        assert run(model, prompt, 100, spec, counts, end_id=None) == plain, prompt
        assert counts.proposed > 0
        assert counts.accepted == counts.proposed


def test_a_long_prompt_is_caught_up_one_chunk_per_step(model: LlamaModel) -> None:
    spec = drafter(model, 4, chunk=16)
    prompt = list(range(3, 90))  # 87 tokens: six chunks of the draft model before drafting
    counts = SpecCounts()
    assert run(model, prompt, 60, spec, counts) == run(model, prompt, 60, None)
    assert counts.accepted == counts.proposed > 0
    assert spec.cached[: len(prompt)] == prompt


def test_sampled_self_draft_accepts_every_draft(model: LlamaModel) -> None:
    """p = q: the rule accepts every draft, with probability min(1, p/q) = 1."""
    params = SamplingParams(temperature=0.9, top_k=30, seed=4)
    counts = SpecCounts()
    out = run(model, [5, 6, 7] * 5, 80, drafter(model), counts, params=params, end_id=None)
    assert len(out) == 80
    assert counts.proposed > 0 and counts.accepted == counts.proposed


def tv_distance(draws: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(draws), minlength=probs.shape[0]).double()
    return 0.5 * float((counts / len(draws) - probs.double()).abs().sum())


@pytest.mark.parametrize(
    "q",
    [
        [0.3, 0.1, 0.1, 0.1, 0.2, 0.2],  # mass where p has none (token 4)
        [0.05, 0.1, 0.4, 0.25, 0.0, 0.2],  # q = p
        [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],  # a certain draft
    ],
)
def test_acceptance_rule_with_a_draft_distribution_keeps_the_target_distribution(
    q: list[float],
) -> None:
    """20,000 seeded drafts drawn from q: the chosen tokens are within total-variation 0.02 of p
    (its sampling spread at this size is about 0.01), and drafts are accepted at the rate
    sum(min(p, q)) the rule implies."""
    p = torch.tensor([0.05, 0.1, 0.4, 0.25, 0.0, 0.2])
    q_t = torch.tensor(q)
    gen = torch.Generator().manual_seed(2)
    draws, accepted = [], 0
    for _ in range(20_000):
        draft = int(torch.multinomial(q_t, 1, generator=gen).item())
        token, ok = accept_sampled(p, draft, gen, q_t)
        draws.append(token)
        accepted += ok
        assert ok == (token == draft) or not ok
    assert tv_distance(draws, p) < 0.02
    assert abs(accepted / 20_000 - float(torch.minimum(p, q_t).sum())) < 0.02


def test_sampler_draw_returns_the_distribution_it_drew_from() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, 3.0])
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=4, seed=3))
    draws = []
    q = None
    for _ in range(20_000):
        token, q = sampler.draw(logits)
        draws.append(token)
    assert q is not None and tv_distance(draws, q) < 0.02
    assert Sampler(GREEDY).draw(logits) == (5, None)


def test_max_tokens_inside_an_accepted_run_ends_where_it_would(model: LlamaModel) -> None:
    # The self-draft accepts every draft: from the second token on, each ends a run of k + 1.
    prompt = [9, 8, 7, 6, 5]
    for n in range(1, 24):
        assert run(model, prompt, n, drafter(model)) == run(model, prompt, n, None), n


def test_end_token_inside_an_accepted_run_ends_where_it_would(model: LlamaModel) -> None:
    cases = 0
    for prompt in prompts():
        plain = run(model, prompt, 60, None, end_id=None)
        for index in (i for i in range(2, len(plain)) if plain[i] not in plain[:i]):
            end = plain[index]
            spec = run(model, prompt, 60, drafter(model), end_id=end)
            assert spec == plain[:index] == run(model, prompt, 60, None, end_id=end)
            cases += 1
    assert cases > 5


def test_min_tokens_with_a_draft_model(model: LlamaModel, small: LlamaModel) -> None:
    for prompt in prompts():
        for end in (END, prompt[0]):
            for draft in (small, model):
                got = run(model, prompt, 40, drafter(draft), end_id=end, min_tokens=20)
                assert got == run(model, prompt, 40, None, end_id=end, min_tokens=20)


def run_job(
    runner: Runner, prompt: list[int], n: int, cancel: threading.Event | None = None
) -> list[int]:
    done = threading.Event()
    out: list[Emission] = []

    def emit(e: Emission) -> None:
        out.append(e)
        if e.final:
            done.set()

    job = Job("s", prompt, n, None, GREEDY, streaming=True, emit=emit)
    if cancel is not None:
        job.cancel = cancel
    runner.submit(job)
    assert done.wait(60)
    with runner.stats.changed:
        runner.stats.changed.wait_for(lambda: runner.stats.running is None, timeout=60)
    return [t for e in out for t in (e.tokens or [])]


@pytest.mark.parametrize("self_draft", [True, False])
def test_cancellation_mid_verify_leaves_the_caches_consistent(
    model: LlamaModel, small: LlamaModel, monkeypatch: pytest.MonkeyPatch, self_draft: bool
) -> None:
    pool = PrefixCache(model.config, 64, 4, "fp", model.device, model.dtype)
    spec_drafter = drafter(model if self_draft else small)
    spec = Runner(model, SEQ, 4, prefix=pool, speculation=spec_drafter)
    fresh = Runner(model, SEQ, 4)
    cancel = threading.Event()
    real = speculative.verify  # what sampling calls, and the name patched there
    calls = 0

    def cancelling(*args: Any, **kwargs: Any) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 3:  # the request is cancelled while its third verify step runs
            cancel.set()
        return real(*args, **kwargs)

    try:
        prompt = [21, 22, 23, 24, 25, 26, 27]
        monkeypatch.setattr(sampling, "verify", cancelling)
        partial = run_job(spec, prompt, 80, cancel)
        monkeypatch.undo()
        assert calls == 3 and len(partial) < 80
        assert spec.stats.cancelled == 1
        before = spec.stats.spec_accepted_tokens, spec.stats.spec_draft_tokens
        # The same prompt, and one continuing the cancelled output, as a fresh engine computes.
        for follow in (prompt, prompt + partial[:5], [40, 41] * 6):
            assert run_job(spec, follow, 50) == run_job(fresh, follow, 50), follow
        if self_draft:  # a stale draft cache would show as rejected self-drafts
            after = spec.stats.spec_accepted_tokens, spec.stats.spec_draft_tokens
            assert after[0] - before[0] == after[1] - before[1] > 0
    finally:
        spec.close()
        fresh.close()


class WrongDrafter:
    """Proposes a token the target never chooses here (checked by the test), counting its calls."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.calls = 0
        self.off_switch = OffSwitch(window=4, min_accepted=0.5, cooldown=8)
        self.memory = AcceptanceMemory()

    def propose(self, text: Sequence[int], limit: int, sampler: Sampler) -> Draft:
        self.calls += 1
        return Draft([self.token] * min(3, limit))


def test_speculation_switches_itself_off_where_acceptance_is_low(model: LlamaModel) -> None:
    prompt = [31, 32, 33, 34]
    plain = run(model, prompt, 100, None, end_id=None)
    never = next(t for t in range(3, model.config.vocab_size) if t not in plain)
    wrong = WrongDrafter(never)
    counts = SpecCounts()
    assert run(model, prompt, 100, wrong, counts, end_id=None) == plain
    # Off after every 4 verify steps, resting 8, 16, 32 and 64 decode steps: 76 steps in, the
    # fourth rest outlasts the request.
    assert counts.switched_off == 4
    assert counts.accepted == 0 and counts.verify_steps == wrong.calls == 16
    assert counts.proposed == 3 * wrong.calls


def test_off_switch_rests_and_doubles() -> None:
    counts = SpecCounts()
    spec = Speculator(WrongDrafter(5), counts)
    sampler = Sampler(GREEDY)
    asked = []
    for step in range(60):
        draft = spec.propose([1, 2, 3], 8, sampler)
        asked.append(draft is not None)
        if draft is not None:
            # The threshold is half a draft a step: 1, 0, 0, 0 is below it, 2, 0, 0, 0 is not.
            spec.record(3, {0: 1, 12: 2}.get(step, 0))
    expected = [*range(0, 4), *range(12, 17), *range(33, 37)]
    assert [i for i, a in enumerate(asked) if a] == expected
    assert counts.switched_off == 3 and counts.verify_steps == len(expected)


def test_no_switch_off_with_the_threshold_at_zero(model: LlamaModel) -> None:
    counts = SpecCounts()
    spec = Speculator(drafter(model), counts)
    assert spec.switch.min_accepted == 0.0
    for _ in range(50):
        spec.record(4, 0)
    assert counts.switched_off == 0


def write_tokenizer(model_dir: Path, vocab: dict[str, int]) -> None:
    tokenizer = byte_level_tokenizer(vocab)
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    target = write_micro_checkpoint(tmp_path / "target")
    draft = write_micro_checkpoint(tmp_path / "draft", {"num_hidden_layers": 1})
    write_tokenizer(target, {"a": 0, "b": 1})
    write_tokenizer(draft, {"a": 0, "b": 1})
    return target, draft


def test_a_draft_of_the_same_tokenizer_is_accepted(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    target_model = LlamaModel.load(target)
    assert check_draft_model(draft, target, target_model.config).num_hidden_layers == 1


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"vocab": {"a": 0, "c": 1}}, "tokenizer.json differs"),
        ({"config": {"vocab_size": 98}}, "vocabulary of 98 tokens"),
        ({"config": {"eos_token_id": 3}}, "eos_token_id (3,) differs"),
        ({"config": {"pad_token_id": 5}}, "pad_token_id 5 differs"),
        ({"no_tokenizer": True}, "only one of it and the target"),
    ],
)
def test_a_draft_of_another_tokenizer_is_refused_in_one_line(
    pair: tuple[Path, Path], change: dict[str, object], words: str
) -> None:
    target, draft = pair
    if "vocab" in change:
        write_tokenizer(draft, change["vocab"])  # type: ignore[arg-type]
    if "config" in change:
        write_micro_checkpoint(draft, {"num_hidden_layers": 1, **change["config"]})  # type: ignore[dict-item]
    if "no_tokenizer" in change:
        (draft / "tokenizer.json").unlink()
    config = LlamaModel.load(target).config
    with pytest.raises(CheckpointError) as err:
        check_draft_model(draft, target, config)
    message = str(err.value)
    assert words in message and "\n" not in message
    assert "must share the target's tokenizer" in message


def test_loading_refuses_a_mismatched_draft_before_serving(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    target, draft = pair
    write_tokenizer(draft, {"x": 0})
    repo = write_hf_repository(target, tmp_path / "repo", guided_decoding=False)
    options = EngineOptions(speculative="draft", draft_model=str(draft))
    assert options.problem() is None
    with pytest.raises(RepositoryError, match=r"tokenizer\.json differs") as err:
        load_repository(repo, options)
    assert "\n" not in str(err.value)


def test_loading_serves_a_matching_draft(pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = pair
    repo = write_hf_repository(target, tmp_path / "repo", guided_decoding=False)
    models = load_repository(
        repo, EngineOptions(speculative="draft", draft_model=str(draft), draft_tokens=3)
    )
    try:
        (served,) = models.values()
        spec = served.runner.speculation
        assert isinstance(spec, DraftModelDrafter)
        assert spec.draft_tokens == 3 and spec.model.config.num_hidden_layers == 1
        # Break-even: the verify overhead plus three draft steps at the draft's share of bytes.
        assert spec.off_switch.min_accepted > 0.25
        out = run_job(served.runner, [5, 6, 7, 8], 20)
        assert out == run(served.model, [5, 6, 7, 8], 20, None, end_id=None)
    finally:
        for m in models.values():
            m.runner.close()


@pytest.mark.parametrize(
    ("options", "option"),
    [
        (EngineOptions(speculative="draft", draft_model="x", draft_tokens=0), "--draft-tokens 0"),
        (EngineOptions(speculative="draft", draft_model="x", draft_tokens=17), "--draft-tokens 17"),
        (EngineOptions(speculative="draft"), "--draft-model"),
        (
            EngineOptions(speculative="draft", draft_model="/nonexistent"),
            "--draft-model /nonexistent",
        ),
        (EngineOptions(speculative="ngram", draft_model="/x"), "--draft-model /x"),
    ],
)
def test_draft_options_out_of_range_are_refused(
    options: EngineOptions, option: str, tmp_path: Path
) -> None:
    if options.draft_model == "x":
        options = EngineOptions(
            speculative="draft",
            draft_model=str(write_micro_checkpoint(tmp_path / "d")),
            draft_tokens=options.draft_tokens,
        )
    problem = options.problem()
    assert problem is not None and problem[0] == option, problem


def test_draft_cache_is_rolled_back_to_what_the_text_shares(model: LlamaModel) -> None:
    spec = drafter(model, 4)
    sampler = Sampler(GREEDY)
    text = [10, 11, 12, 13]
    first = spec.propose(text, 8, sampler).tokens
    assert len(first) == 4
    assert spec.cached == text + first[:3]
    # Two drafts accepted, then the target's own other token: the cache keeps text + 2 drafts.
    other = (first[2] + 1) % model.config.vocab_size
    longer = [*text, *first[:2], other]
    again = spec.propose(longer, 8, sampler).tokens
    assert spec.cached == longer + again[:3]
    # What a fresh drafter computes from nothing.
    assert again == drafter(model, 4).propose(longer, 8, sampler).tokens
    cache: KVCache = spec.cache
    assert cache.max_seq_len == SEQ
