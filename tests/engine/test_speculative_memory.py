"""A drafter's acceptance memory across requests: when drafting rests, probes and resumes, and the
break-even measured from the wall time of verify and decode steps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from appliance.engine.llama import LlamaModel
from appliance.engine.sampling import Sampler, SamplingParams, generate
from appliance.engine.speculative import (
    AcceptanceMemory,
    Draft,
    NgramSpeculation,
    OffSwitch,
    SpecCounts,
    Speculator,
)
from tests.engine.conftest import write_micro_checkpoint

GREEDY = SamplingParams(top_k=1)
SWITCH = OffSwitch(window=8, min_accepted=0.5, cooldown=32, probe_every=16)


class Drafter:
    """Proposes three tokens whatever the text; the test says how many the target accepts."""

    def __init__(self, switch: OffSwitch = SWITCH) -> None:
        self.off_switch = switch
        self.memory = AcceptanceMemory()

    def propose(self, text: Sequence[int], limit: int, sampler: Sampler) -> Draft:
        return Draft([7, 8, 9][:limit])


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def speculator(drafter: Drafter, counts: SpecCounts | None = None) -> Speculator:
    """A request's speculator whose clock stands still: no step is timed, the prior holds."""
    return Speculator(drafter, counts or SpecCounts(), Clock())


def drive(
    spec: Speculator,
    steps: int,
    accepted: dict[int, int] | None = None,
    clock: Clock | None = None,
    costs: tuple[float, float] = (1.0, 1.0),
) -> list[int]:
    """Runs `steps` token steps; a step with a draft is a verify step that accepts
    `accepted.get(step, 0)` drafts (and takes costs[1] on `clock`; a decode step, costs[0]).
    Returns the steps that verified."""
    sampler = Sampler(GREEDY)
    asked = []
    for step in range(steps):
        draft = spec.propose([1, 2, 3], 8, sampler)
        if draft is not None:
            asked.append(step)
            spec.record(len(draft.tokens), (accepted or {}).get(step, 0))
        if clock is not None:
            clock.now += costs[draft is not None]
    return asked


def low(drafter: Drafter) -> Drafter:
    """The drafter after requests whose drafts were all rejected."""
    for _ in range(20):
        drafter.memory.observe(0)
    return drafter


def test_a_request_after_unpaid_ones_rests_and_probes_every_probe_every_tokens() -> None:
    counts = SpecCounts()
    spec = speculator(low(Drafter()), counts)
    assert spec.probing
    assert drive(spec, 64) == [0, 16, 32, 48]
    assert counts.verify_steps == 4 and counts.switched_off == 0


def test_a_first_request_drafts_then_switches_to_probing() -> None:
    drafter = Drafter()
    counts = SpecCounts()
    spec = speculator(drafter, counts)
    assert not spec.probing  # nothing remembered: drafting is presumed to pay
    # Two rejected verify steps switch it off; then a probe every 16 tokens.
    assert drive(spec, 60) == [0, 1, 17, 33, 49]
    assert counts.switched_off == 1
    # The next request of the same drafter starts probing at once.
    assert speculator(drafter).probing


def test_a_probe_that_accepts_every_draft_resumes_drafting_at_once() -> None:
    drafter = low(Drafter())
    spec = speculator(drafter)
    asked = drive(spec, 12, accepted=dict.fromkeys(range(12), 3))
    assert asked == list(range(12))
    assert not spec.probing
    assert speculator(drafter).probing is False


def test_probes_that_accept_little_resume_drafting_only_when_the_mean_reaches_break_even() -> None:
    spec = speculator(low(Drafter()))
    # One draft accepted per probe: the remembered mean climbs 0.25, 0.44, 0.58 (>= 0.5).
    asked = drive(spec, 40, accepted={0: 1, 16: 1, **dict.fromkeys(range(32, 40), 1)})
    assert asked == [0, 16, *range(32, 40)]


def test_a_request_after_a_paying_probe_drafts_only_until_the_mean_falls() -> None:
    # A low-acceptance workload whose probe happened to accept every draft: the next request
    # drafts, and goes back to probing after two rejected verify steps, not a window of eight.
    drafter = low(Drafter())
    assert not drafter.memory.pays(0.5)
    drive(speculator(drafter), 1, accepted={0: 3})
    assert drafter.memory.pays(0.5)
    counts = SpecCounts()
    spec = speculator(drafter, counts)
    assert not spec.probing
    assert drive(spec, 40) == [0, 1, 17, 33]
    assert counts.switched_off == 1


def test_one_rejected_step_does_not_stop_a_paying_drafter() -> None:
    drafter = Drafter()
    spec = speculator(drafter)
    asked = drive(spec, 12, accepted={**dict.fromkeys(range(12), 3), 4: 0, 8: 0})
    assert asked == list(range(12))


def test_without_probe_every_a_request_forgets_other_requests() -> None:
    drafter = low(Drafter(OffSwitch(window=8, min_accepted=0.5, cooldown=32)))
    spec = speculator(drafter)
    assert not spec.probing
    assert drive(spec, 50) == [*range(8), *range(40, 48)]  # window, rest 32, window


def test_break_even_is_the_measured_verify_cost_less_one() -> None:
    memory = AcceptanceMemory()
    assert memory.break_even(0.5) == 0.5  # nothing timed yet: the prior
    for _ in range(AcceptanceMemory.MIN_TIMED):
        memory.observe_step(False, 0.040)
        assert memory.break_even(0.5) == 0.5
        memory.observe_step(True, 0.072)
    assert memory.break_even(0.5) == pytest.approx(0.8)
    memory.observe_step(True, -1.0)  # a clock that went backwards is ignored
    assert memory.break_even(0.5) == pytest.approx(0.8)
    cheap = AcceptanceMemory()
    for _ in range(AcceptanceMemory.MIN_TIMED):
        cheap.observe_step(False, 0.040)
        cheap.observe_step(True, 0.030)
    assert cheap.break_even(0.5) == AcceptanceMemory.BREAK_EVEN_RANGE[0]


def test_the_remembered_mean_switches_off_at_the_measured_break_even() -> None:
    # Verify steps cost 1.8 decode steps: break-even 0.8. The first window accepts 6 of 8
    # (0.75 per step: above the prior 0.5, below 0.8) while the steps are timed.
    clock = Clock()
    drafter = Drafter(OffSwitch(window=8, min_accepted=0.5, cooldown=32, probe_every=16))
    warm = Speculator(drafter, SpecCounts(), clock)
    drive(warm, 40, accepted={0: 3, 1: 3}, clock=clock, costs=(1.0, 1.8))
    assert drafter.memory.timed_verify >= 8 and drafter.memory.timed_decode >= 8
    assert drafter.memory.break_even(0.5) == pytest.approx(0.8)
    drafter.memory.accepted = None  # forget acceptance, keep the timing
    counts = SpecCounts()
    spec = Speculator(drafter, counts, clock)
    drive(spec, 8, accepted=dict.fromkeys(range(6), 1), clock=clock, costs=(1.0, 1.8))
    assert counts.switched_off == 1


def test_a_costly_probe_is_spaced_out_to_its_share_of_the_decode_time() -> None:
    memory = AcceptanceMemory()
    assert memory.probe_gap(16) == 16  # nothing timed yet
    for _ in range(AcceptanceMemory.MIN_TIMED):
        memory.observe_step(False, 0.040)
        memory.observe_step(True, 0.048)  # 0.2 decode steps extra: 10 steps' share of 2 %
    assert memory.probe_gap(16) == 16
    for _ in range(40):
        memory.observe_step(True, 0.120)  # 2 decode steps extra: 100 steps' share
    assert memory.probe_gap(16) == pytest.approx(100, abs=2)
    for _ in range(80):
        memory.observe_step(True, 100.0)
    assert memory.probe_gap(16) == AcceptanceMemory.MAX_PROBE_GAP


def test_a_resting_request_probes_at_the_measured_gap() -> None:
    # Verify steps cost 3 decode steps: a probe every 100 tokens keeps probes at 2 % of the time.
    clock = Clock()
    drafter = low(Drafter())
    drive(Speculator(drafter, SpecCounts(), clock), 200, clock=clock, costs=(1.0, 3.0))
    assert drafter.memory.probe_gap(16) == 100
    drafter.memory.rest = 0
    spec = Speculator(drafter, SpecCounts(), clock)
    assert drive(spec, 250, clock=clock, costs=(1.0, 3.0)) == [0, 100, 200]


def test_probes_are_spaced_along_the_drafters_traffic_not_per_request() -> None:
    # Requests of 10 tokens, a probe every 16 tokens: the first request probes at its first
    # token, the next 6 tokens into it (16 after the last probe), the third not at all.
    drafter = low(Drafter())
    asked = [drive(speculator(drafter), 10) for _ in range(4)]
    assert asked == [[0], [6], [], [2]]


def test_each_drafter_instance_has_its_own_memory() -> None:
    a, b = NgramSpeculation(), NgramSpeculation()
    assert a == b and a.memory is not b.memory
    assert a.off_switch.probe_every > 0


def test_greedy_output_is_unchanged_while_drafting_rests_and_probes(tmp_path: Path) -> None:
    model = LlamaModel.load(write_micro_checkpoint(tmp_path, {"max_position_embeddings": 256}))
    spec = NgramSpeculation(4, 2, OffSwitch(window=2, min_accepted=2.0, cooldown=4, probe_every=3))
    for prompt in ([5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [20, 21, 20, 21, 20]):
        plain = list(generate(model, prompt, 40, None, GREEDY))
        counts = SpecCounts()
        out = list(generate(model, prompt, 40, None, GREEDY, speculation=spec, spec_counts=counts))
        assert out == plain
    assert spec.memory.accepted is not None
