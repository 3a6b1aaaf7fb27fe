"""Admission: whether a request may use the engine now, after a short wait, or not at all.

A batch-1 engine serves one stream at a time; more requests than it can serve at full speed only
queue behind each other and all miss their budgets. So each model has a number of slots (the engine's
max_batch_size unless configured) and a bounded FIFO of waiting requests. At arrival the wait is
estimated (what the running and queued generations still need, from moving estimates of prefill
time per prompt token and decode time per token); a request whose time to first token would pass
its budget is refused at once with RESOURCE_EXHAUSTED and a retry hint, rather than failing slowly.
A request still waiting when its budget passes leaves the queue without reaching the engine.

The pipeline asks for a Ticket after the cache lookup (a hit never needs the engine) and only for a
request that starts a generation (a single-flight follower rides on its leader's ticket). Comparable
policies: Triton's queue policy (max queue size, timeout action REJECT), TGI's
max_concurrent_requests (429 "Model is overloaded"), Envoy's pending-request circuit breaker; those
refuse by count, this also refuses by estimated time.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from appliance.errors import RequestError


class Ticket(Protocol):
    def first_token(self) -> None:
        """The generation's first token arrived (feeds the prefill estimate)."""
        ...

    def release(self, completion_tokens: int) -> None:
        """The generation ended, however it ended; called exactly once."""
        ...


class Admission(Protocol):
    async def admit(
        self, model: str, prompt_tokens: int, max_tokens: int, first_token_by: float | None
    ) -> Ticket:
        """A ticket once the request may start; RequestError when it may not. `first_token_by`:
        time.monotonic() by which the first token must arrive, or None."""
        ...


class _NoTicket:
    def first_token(self) -> None:
        return None

    def release(self, completion_tokens: int) -> None:
        return None


class AdmitAll:
    """Every request starts at once (the engine queues them itself)."""

    _ticket = _NoTicket()

    async def admit(
        self, model: str, prompt_tokens: int, max_tokens: int, first_token_by: float | None
    ) -> Ticket:
        return self._ticket


@dataclass
class ServiceEstimate:
    """Moving estimates of the engine's speed, learned from the generations it finishes."""

    alpha: float = 0.2
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0
    # Completion tokens / max_tokens: most generations stop before their limit.
    token_fraction: float = 1.0
    samples: int = 0

    def first_token_s(self, prompt_tokens: int) -> float:
        return self.prefill_s_per_token * prompt_tokens + self.decode_s_per_token

    def service_s(self, prompt_tokens: int, max_tokens: int) -> float:
        decode = self.decode_s_per_token * self.token_fraction * max_tokens
        return self.prefill_s_per_token * prompt_tokens + decode

    def remaining_s(self, prompt_tokens: int, max_tokens: int, elapsed_s: float) -> float:
        """What a generation running for `elapsed_s` still needs. Whether it stops at the next
        token is taken as independent of how long it has run (a generation that outlived the
        average is not about to end): the decode still ahead is the average one, but never more
        than its token limit leaves."""
        prefill = self.prefill_s_per_token * prompt_tokens
        average = prefill + self.decode_s_per_token * self.token_fraction * max_tokens
        most = prefill + self.decode_s_per_token * max_tokens
        if elapsed_s < prefill:
            return average - elapsed_s
        return max(0.0, min(average - prefill, most - elapsed_s))

    def observe(
        self, prompt_tokens: int, max_tokens: int, ttft_s: float, tokens: int, total_s: float
    ) -> None:
        if tokens < 1:
            return
        a = self.alpha if self.samples else 1.0
        self.samples += 1
        per_token = (total_s - ttft_s) / (tokens - 1) if tokens > 1 else self.decode_s_per_token
        prefill = max(0.0, ttft_s - per_token) / max(prompt_tokens, 1)
        self.prefill_s_per_token += a * (prefill - self.prefill_s_per_token)
        if tokens > 1 or not self.decode_s_per_token:
            self.decode_s_per_token += a * (max(per_token, 0.0) - self.decode_s_per_token)
        self.token_fraction += a * (min(tokens / max(max_tokens, 1), 1.0) - self.token_fraction)


@dataclass
class _Work:
    prompt_tokens: int
    max_tokens: int
    started: float = 0.0
    ticket: asyncio.Future[_GateTicket] | None = None


class _GateTicket:
    def __init__(self, gate: ModelGate, work: _Work) -> None:
        self._gate = gate
        self._work = work
        self._first: float | None = None
        self._released = False

    def first_token(self) -> None:
        if self._first is None:
            self._first = self._gate.clock()

    def release(self, completion_tokens: int) -> None:
        if self._released:
            return
        self._released = True
        gate, work = self._gate, self._work
        now = gate.clock()
        if self._first is not None:
            gate.estimate.observe(
                work.prompt_tokens,
                work.max_tokens,
                self._first - work.started,
                completion_tokens,
                now - work.started,
            )
        gate.finished(work)


@dataclass
class ModelGate:
    """Slots and the waiting line of one model."""

    name: str
    slots: int
    max_queue: int
    estimate: ServiceEstimate = field(default_factory=ServiceEstimate)
    clock: Callable[[], float] = time.monotonic
    running: list[_Work] = field(default_factory=list)
    waiting: collections.deque[_Work] = field(default_factory=collections.deque)
    refused: int = 0
    expired: int = 0

    def estimated_wait(self, now: float) -> float:
        """Seconds until a request joining the back of the line would start."""
        est = self.estimate
        left = sum(
            est.remaining_s(w.prompt_tokens, w.max_tokens, now - w.started) for w in self.running
        )
        left += sum(est.service_s(w.prompt_tokens, w.max_tokens) for w in self.waiting)
        return left / self.slots

    async def admit(
        self, prompt_tokens: int, max_tokens: int, first_token_by: float | None
    ) -> _GateTicket:
        now = self.clock()
        work = _Work(prompt_tokens, max_tokens)
        if len(self.running) < self.slots and not self.waiting:
            return self._start(work, now)
        wait = self.estimated_wait(now)
        if len(self.waiting) >= self.max_queue:
            self.refused += 1
            raise self._busy(
                f"model '{self.name}' is overloaded: {len(self.running)} generating and "
                f"{len(self.waiting)} waiting, the most this gateway queues",
                wait,
            )
        ttft = wait + self.estimate.first_token_s(prompt_tokens)
        if first_token_by is not None and now + ttft > first_token_by:
            self.refused += 1
            budget_ms = max(0.0, first_token_by - now) * 1000
            raise self._busy(
                f"model '{self.name}' is busy: estimated time to first token {ttft * 1000:.0f} ms "
                f"({len(self.running) + len(self.waiting)} requests ahead) exceeds this "
                f"request's budget of {budget_ms:.0f} ms",
                now + ttft - first_token_by,
            )
        work.ticket = asyncio.get_running_loop().create_future()
        self.waiting.append(work)
        limit = None if first_token_by is None else max(0.0, first_token_by - now)
        try:
            async with asyncio.timeout(limit):
                return await work.ticket
        except BaseException as exc:
            self._abandon(work)
            if not isinstance(exc, TimeoutError):
                raise
            self.expired += 1
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"model '{self.name}' is busy: waited {(self.clock() - now) * 1000:.0f} ms for "
                "the engine and the time-to-first-token budget passed",
            ) from None

    def _abandon(self, work: _Work) -> None:
        """A waiter left (deadline, budget, client gone): out of the line, or its slot back if
        it was granted one it never took."""
        assert work.ticket is not None
        if work in self.waiting:
            self.waiting.remove(work)
        elif work.ticket.done() and not work.ticket.cancelled():
            work.ticket.result().release(0)

    def _start(self, work: _Work, now: float) -> _GateTicket:
        work.started = now
        self.running.append(work)
        return _GateTicket(self, work)

    def finished(self, work: _Work) -> None:
        self.running.remove(work)
        while self.waiting and len(self.running) < self.slots:
            nxt = self.waiting.popleft()
            assert nxt.ticket is not None
            if not nxt.ticket.done():
                nxt.ticket.set_result(self._start(nxt, self.clock()))

    @staticmethod
    def _busy(message: str, retry_after_s: float) -> RequestError:
        return RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            message,
            retry_after_ms=max(1, round(retry_after_s * 1000)),
        )


class GatedAdmission:
    """A ModelGate per model."""

    def __init__(self, gates: dict[str, ModelGate]) -> None:
        self.gates = gates

    async def admit(
        self, model: str, prompt_tokens: int, max_tokens: int, first_token_by: float | None
    ) -> Ticket:
        return await self.gates[model].admit(prompt_tokens, max_tokens, first_token_by)
