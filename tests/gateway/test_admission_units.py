"""The admission gate's arithmetic, on a clock the test moves."""

from __future__ import annotations

import grpc
import pytest

from appliance.gateway.admission import ModelGate, ServiceEstimate
from appliance.gateway.errors import RequestError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _gate(clock: Clock, token_fraction: float = 0.1) -> ModelGate:
    # 1 ms per prompt token, 10 ms per generated token; answers use a tenth of their limit.
    estimate = ServiceEstimate(
        prefill_s_per_token=0.001, decode_s_per_token=0.01, token_fraction=token_fraction
    )
    return ModelGate("m", slots=1, max_queue=4, estimate=estimate, clock=clock)


async def test_a_generation_that_outlived_the_average_still_holds_its_slot() -> None:
    clock = Clock()
    gate = _gate(clock)
    ticket = await gate.admit(100, 1000, None)  # average: 0.1 s prefill + 1 s decode
    assert gate.estimated_wait(clock.now) == pytest.approx(1.1)
    clock.now += 0.1
    ticket.first_token()
    ticket.generated(1)
    assert gate.estimated_wait(clock.now) == pytest.approx(1.0)  # prefill done, decode ahead
    clock.now += 4.49  # four times the average answer, at the learned pace, and still running
    ticket.generated(449)
    assert gate.estimated_wait(clock.now) == pytest.approx(1.0)
    clock.now += 5.0  # 50 tokens before its token limit ends it whatever it says
    ticket.generated(500)
    assert gate.estimated_wait(clock.now) == pytest.approx(0.5)
    clock.now += 0.5
    ticket.generated(50)
    assert gate.estimated_wait(clock.now) == 0.0


async def test_answers_that_run_to_their_limit_are_estimated_to_the_end() -> None:
    clock = Clock()
    gate = _gate(clock, token_fraction=1.0)
    ticket = await gate.admit(100, 100, None)  # 0.1 s + 1 s
    clock.now += 0.1
    ticket.first_token()
    clock.now += 0.2
    ticket.generated(21)  # the first token and 20 more
    assert gate.estimated_wait(clock.now) == pytest.approx(0.79)


async def test_a_request_whose_budget_the_wait_would_pass_is_refused_with_a_hint() -> None:
    clock = Clock()
    gate = _gate(clock)
    await gate.admit(100, 1000, None)
    clock.now += 5.0  # long past the average answer: the slot is still taken
    with pytest.raises(RequestError) as err:
        await gate.admit(10, 10, first_token_by=clock.now + 0.5)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "estimated time to first token 1020 ms" in err.value.message
    assert err.value.retry_after_ms == 520
    assert (gate.refused, len(gate.waiting)) == (1, 0)


async def test_a_full_line_is_refused_by_count() -> None:
    clock = Clock()
    gate = ModelGate("m", slots=1, max_queue=0, clock=clock)
    await gate.admit(10, 10, None)
    with pytest.raises(RequestError, match="1 generating and 0 waiting, the most this gateway"):
        await gate.admit(10, 10, None)
