"""Sampler semantics (TensorRT-LLM's) and the generate loop's stopping rules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.engine.llama import LlamaModel
from appliance.engine.sampling import Sampler, SamplingParams, generate, nucleus_mask

PROMPT = [1, 5, 17, 42, 3]


def test_greedy_is_argmax() -> None:
    logits = torch.randn(97, generator=torch.Generator().manual_seed(3))
    expected = int(torch.argmax(logits))
    assert Sampler(SamplingParams())(logits) == expected  # top_k 0, top_p 0 -> greedy
    assert Sampler(SamplingParams(temperature=5.0, top_k=1, top_p=0.9))(logits) == expected
    assert Sampler(SamplingParams(temperature=0.0, top_k=50))(logits) == expected


def test_top_k_restricts_to_the_k_best() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0, 4.9, -2.0, 4.8])
    sampler = Sampler(SamplingParams(temperature=100.0, top_k=3, seed=0))
    assert {sampler(logits) for _ in range(300)} == {1, 3, 5}


def test_nucleus_mask_keeps_the_crossing_token() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert nucleus_mask(probs, 0.7).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert nucleus_mask(probs, 0.8).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert nucleus_mask(probs, 0.81).tolist() == [1.0, 1.0, 1.0, 0.0]
    assert nucleus_mask(probs, 0.1).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_top_p_draws_only_from_the_nucleus() -> None:
    # softmax of these is ~[0.5, 0.3, 0.15, 0.05] in a shuffled vocabulary order.
    probs = torch.tensor([0.15, 0.05, 0.5, 0.3])
    sampler = Sampler(SamplingParams(top_p=0.75, seed=1))
    drawn = {sampler(probs.log()) for _ in range(300)}
    assert drawn == {2, 3}


def test_sampler_rejects_bad_params() -> None:
    with pytest.raises(ValueError, match="temperature"):
        Sampler(SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="top_p"):
        Sampler(SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="top_k"):
        Sampler(SamplingParams(top_k=-1))


def _run(model: LlamaModel, params: SamplingParams, n: int = 20) -> list[int]:
    return list(generate(model, PROMPT, n, None, params))


def test_same_seed_same_tokens_different_seed_differs(micro_model: LlamaModel) -> None:
    params = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, seed=1234)
    first = _run(micro_model, params)
    assert len(first) == 20
    assert _run(micro_model, params) == first
    assert (
        _run(micro_model, SamplingParams(temperature=1.5, top_k=50, top_p=0.95, seed=99)) != first
    )
    # Unseeded runs draw a fresh seed; twenty tokens colliding by chance is negligible.
    unseeded = SamplingParams(temperature=1.5, top_k=50, top_p=0.95)
    assert _run(micro_model, unseeded) != _run(micro_model, unseeded)


def test_generate_greedy_matches_manual_argmax_loop(micro_model: LlamaModel) -> None:
    got = _run(micro_model, SamplingParams(), n=8)
    ids = list(PROMPT)
    for _ in range(8):
        logits = micro_model.forward(ids, micro_model.new_cache(len(ids)), 0)
        ids.append(int(torch.argmax(logits)))
    assert got == ids[len(PROMPT) :]


def test_end_id_stops_without_being_yielded(micro_model: LlamaModel) -> None:
    greedy = _run(micro_model, SamplingParams(), n=8)
    end_id = greedy[3]
    first = greedy.index(end_id)
    got = list(generate(micro_model, PROMPT, 8, end_id, SamplingParams()))
    assert got == greedy[:first]


def test_should_stop_is_checked_before_each_step(micro_model: LlamaModel) -> None:
    produced: list[int] = []
    stream = generate(micro_model, PROMPT, 30, None, SamplingParams(), lambda: len(produced) >= 3)
    for token in stream:
        produced.append(token)
    assert len(produced) == 3
    assert list(generate(micro_model, PROMPT, 30, None, SamplingParams(), lambda: True)) == []


def test_too_long_request_is_rejected_eagerly(micro_model: LlamaModel) -> None:
    limit = micro_model.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        generate(micro_model, PROMPT, limit - len(PROMPT) + 1, None, SamplingParams())
    assert len(list(generate(micro_model, PROMPT, limit - len(PROMPT), None, SamplingParams()))) > 0
    with pytest.raises(ValueError, match="at least one token"):
        generate(micro_model, [], 4, None, SamplingParams())


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(
        st.floats(min_value=-20, max_value=20, allow_nan=False), min_size=2, max_size=40
    ),
    top_k=st.integers(min_value=0, max_value=45),
    top_p=st.floats(min_value=0.05, max_value=1.0),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
)
def test_draw_stays_inside_top_k_and_nucleus(
    values: list[float], top_k: int, top_p: float, seed: int
) -> None:
    logits = torch.tensor(values)
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, seed=seed)
    token = Sampler(params)(logits)
    assert token == Sampler(params)(logits)  # same seed, same draw
    probs = torch.softmax(logits / 0.8, dim=-1)
    if top_k not in (0, 1):
        # Ties at the k-th value may be broken either way; compare values, not ranks.
        assert logits[token] >= torch.topk(logits, min(top_k, len(values))).values[-1]
    if top_k == 0 and top_p < 1.0:
        ordered = torch.sort(probs, descending=True).values
        mass_before = float(probs[probs > probs[token]].sum())
        assert mass_before < top_p + 1e-6 or probs[token] == ordered[0]


def test_a_reused_cache_gives_the_same_tokens(micro_model: LlamaModel) -> None:
    params = SamplingParams(temperature=1.2, top_k=20, seed=7)
    fresh = _run(micro_model, params, n=10)
    shared = micro_model.new_cache(micro_model.config.max_position_embeddings)
    list(generate(micro_model, [9, 8, 7, 6, 5, 4, 3], 20, None, params, cache=shared))  # dirty it
    assert list(generate(micro_model, PROMPT, 10, None, params, cache=shared)) == fresh
    with pytest.raises(ValueError, match="cache holds 8 tokens"):
        generate(micro_model, PROMPT, 10, None, params, cache=micro_model.new_cache(8))
