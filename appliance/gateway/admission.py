"""Admission: whether a request may use the engine now, after a short wait, or not at all.

A batch-1 engine serves one stream at a time; more requests than it can serve at full speed only
queue behind each other and all miss their budgets. So each model has a number of slots (the engine's
max_batch_size unless configured) and a bounded FIFO of waiting requests. At arrival the wait is
estimated (what the running and queued generations still need, from moving estimates of prefill
time per prompt token and decode time per token, and from each running generation's own pace); a
request that would have to wait and whose time to first token would then pass its budget is
refused at once with RESOURCE_EXHAUSTED and a retry hint, rather than failing slowly (one that finds
a slot free starts whatever its budget: no retry would give it a sooner first token). A waiting
request leaves the queue, with a retry hint and without reaching the engine, as soon as its
expected prefill no longer fits in what is left of its budget, and a slot is never handed to one
whose prefill would no longer fit. A closed gate (the gateway is stopping) refuses everyone
waiting and everyone who asks.

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

from appliance.gateway.errors import RequestError

# The retry hint of a full line while the gate has learned nothing (no generation has finished):
# its wait estimate is then zero, which says nothing of when a slot frees, and a hint of a
# millisecond has a client that follows it spend its retries before any generation could end.
UNKNOWN_WAIT_RETRY_MS = 1000


class OverBudget(RequestError):
    """A refusal that judged the request's own time-to-first-token budget (another request for
    the same answer, with a budget of its own, may still be admitted); the refusals that apply to
    every request alike (a full line, a closed gate) are plain RequestErrors."""


@dataclass(frozen=True, slots=True)
class Limit:
    """What bounds a request's time to its first token, as a refusal names it (`name`) with what
    the client can change (`change`). A deadline (`deadline`) that passes while the request waits
    in line is DEADLINE_EXCEEDED, as it is at every other stage; a refusal before the limit passes
    (its expected wait or prefill would pass it) is RESOURCE_EXHAUSTED with a retry hint."""

    name: str
    change: str
    deadline: bool = False


TTFT_BUDGET = Limit(
    "the request's time-to-first-token budget", "raise ttft_budget_ms, or retry later"
)


class Ticket(Protocol):
    def first_token(self) -> None:
        """The generation's first token arrived (feeds the prefill estimate)."""
        ...

    def generated(self, tokens: int) -> None:
        """The generation produced this many more tokens (its pace, for the wait estimate)."""
        ...

    def release(self, completion_tokens: int) -> None:
        """The generation ended, however it ended; called exactly once."""
        ...


class Admission(Protocol):
    async def admit(
        self,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        first_token_by: float | None,
        limit: Limit = TTFT_BUDGET,
    ) -> Ticket:
        """A ticket once the request may start; RequestError when it may not. `first_token_by`:
        time.monotonic() by which the first token must arrive, or None; `limit`: what sets it."""
        ...

    def close(self, message: str, retry_after_ms: int) -> None:
        """From now on every request waiting and every request asking is refused with UNAVAILABLE,
        `message` and the retry hint (the gateway is stopping)."""
        ...


class _NoTicket:
    def first_token(self) -> None:
        return None

    def generated(self, tokens: int) -> None:
        return None

    def release(self, completion_tokens: int) -> None:
        return None


class AdmitAll:
    """Every request starts at once (the engine queues them itself)."""

    _ticket = _NoTicket()

    def __init__(self) -> None:
        self._closed: RequestError | None = None

    async def admit(
        self,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        first_token_by: float | None,
        limit: Limit = TTFT_BUDGET,
    ) -> Ticket:
        if self._closed is not None:
            raise _closed_error(self._closed)
        return self._ticket

    def close(self, message: str, retry_after_ms: int) -> None:
        self._closed = RequestError(grpc.StatusCode.UNAVAILABLE, message, retry_after_ms)


def _closed_error(closed: RequestError) -> RequestError:
    """A fresh copy of a closed gate's refusal (one exception object per request)."""
    return RequestError(closed.code, closed.message, closed.retry_after_ms)


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

    def remaining_s(
        self,
        prompt_tokens: int,
        max_tokens: int,
        elapsed_s: float,
        first_token_s: float | None = None,
        tokens: int = 0,
    ) -> float:
        """What a generation running for `elapsed_s` still needs; `first_token_s`: when its first
        token came (seconds after it started; None: not yet), `tokens`: how many it produced.

        Whether it stops at the next token is taken as independent of how long it has run (a
        generation that outlived the average is not about to end): the decode still ahead is the
        average one, but never more than its token limit leaves. Past its first token, the decode
        goes at the pace this generation has kept so far, not the learned one: on an engine
        slowed down (a busy host) the learned pace would call it finished while it still runs.
        Before any generation finished, nothing is known of how many tokens answers take: the
        estimate stays zero (everyone queues) until the first one is learned."""
        average_tokens = self.token_fraction * max_tokens
        if first_token_s is None:
            prefill_left = max(0.0, self.prefill_s_per_token * prompt_tokens - elapsed_s)
            return prefill_left + self.decode_s_per_token * average_tokens
        pace = self.decode_s_per_token
        if tokens > 1 and self.samples:
            pace = max(0.0, elapsed_s - first_token_s) / (tokens - 1)
        return pace * max(0.0, min(average_tokens, max_tokens - tokens))

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
    first_token_by: float | None = None
    limit: Limit = TTFT_BUDGET
    # When it joined the line and when it got its slot (gate clock).
    joined: float = 0.0
    started: float = 0.0
    # When its first token came (gate clock) and how many tokens it has produced.
    first: float | None = None
    tokens: int = 0
    ticket: asyncio.Future[_GateTicket] | None = None

    def remaining_s(self, estimate: ServiceEstimate, now: float) -> float:
        first = None if self.first is None else self.first - self.started
        return estimate.remaining_s(
            self.prompt_tokens, self.max_tokens, now - self.started, first, self.tokens
        )


class _GateTicket:
    def __init__(self, gate: ModelGate, work: _Work) -> None:
        self._gate = gate
        self._work = work
        self._released = False

    def first_token(self) -> None:
        if self._work.first is None:
            self._work.first = self._gate.clock()

    def generated(self, tokens: int) -> None:
        self._work.tokens += tokens

    def release(self, completion_tokens: int) -> None:
        if self._released:
            return
        self._released = True
        gate, work = self._gate, self._work
        now = gate.clock()
        if work.first is not None:
            gate.estimate.observe(
                work.prompt_tokens,
                work.max_tokens,
                work.first - work.started,
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
    # The refusal every request gets once the gate is closed (None: open).
    closed: RequestError | None = None

    def estimated_wait(self, now: float) -> float:
        """Seconds until a request joining the back of the line would start. A scrape asks it
        from the metrics thread while the event loop changes the line: the line is copied first
        (one step, which no thread switch splits) and the copy is what is read."""
        est = self.estimate
        running, waiting = tuple(self.running), tuple(self.waiting)
        left = sum(w.remaining_s(est, now) for w in running)
        left += sum(est.service_s(w.prompt_tokens, w.max_tokens) for w in waiting)
        return left / self.slots

    async def admit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        first_token_by: float | None,
        limit: Limit = TTFT_BUDGET,
    ) -> _GateTicket:
        if self.closed is not None:
            raise _closed_error(self.closed)
        now = self.clock()
        work = _Work(prompt_tokens, max_tokens, first_token_by, limit, joined=now)
        if len(self.running) < self.slots and not self.waiting:
            return self._start(work, now)
        wait = self.estimated_wait(now)
        if len(self.waiting) >= self.max_queue:
            self.refused += 1
            raise self._busy(
                f"model '{self.name}' is overloaded: {len(self.running)} generating and "
                f"{len(self.waiting)} waiting, the most this gateway queues",
                wait if self.estimate.samples else UNKNOWN_WAIT_RETRY_MS / 1000,
            )
        prefill = self.estimate.first_token_s(prompt_tokens)
        ttft = wait + prefill
        if first_token_by is not None and now + ttft > first_token_by:
            self.refused += 1
            budget_ms = max(0.0, first_token_by - now) * 1000
            raise self._busy(
                f"model '{self.name}' is busy: estimated time to first token {ttft * 1000:.0f} ms "
                f"({len(self.running) + len(self.waiting)} requests ahead) exceeds the "
                f"{budget_ms:.0f} ms left of {limit.name}; {limit.change}",
                now + ttft - first_token_by,
                OverBudget,
            )
        work.ticket = asyncio.get_running_loop().create_future()
        self.waiting.append(work)
        # It leaves the line once its expected prefill no longer fits in its budget.
        waits_s = None if first_token_by is None else max(0.0, first_token_by - prefill - now)
        try:
            async with asyncio.timeout(waits_s):
                return await work.ticket
        except BaseException as exc:
            self._abandon(work)
            if not isinstance(exc, TimeoutError):
                raise
            raise self._expired(work) from None

    def _expired(self, work: _Work) -> RequestError:
        """The refusal of a waiter whose first token can no longer come within its limit. The
        line held it this long without reaching it: the retry hint is no shorter than that. A
        deadline that passed (no prefill expected to shorten the wait) is DEADLINE_EXCEEDED."""
        self.expired += 1
        now = self.clock()
        waited = now - work.joined
        prefill = self.estimate.first_token_s(work.prompt_tokens)
        limit = work.limit
        if prefill < 0.001:
            why = f"{limit.name} passed"
        else:
            why = (
                f"{limit.name} passed or would pass during the expected prefill of "
                f"{prefill * 1000:.0f} ms"
            )
        message = (
            f"model '{self.name}' is busy: waited {waited * 1000:.0f} ms for the engine and "
            f"{why}; {limit.change}"
        )
        if limit.deadline and prefill < 0.001:
            return OverBudget(grpc.StatusCode.DEADLINE_EXCEEDED, message)
        return self._busy(message, max(self.estimated_wait(now), waited), OverBudget)

    def _abandon(self, work: _Work) -> None:
        """A waiter left (deadline, budget, client gone): out of the line, or its slot back if
        it was granted one it never took."""
        ticket = work.ticket
        assert ticket is not None
        if work in self.waiting:
            self.waiting.remove(work)
        elif ticket.done() and not ticket.cancelled() and ticket.exception() is None:
            ticket.result().release(0)

    def _start(self, work: _Work, now: float) -> _GateTicket:
        work.started = now
        self.running.append(work)
        return _GateTicket(self, work)

    def finished(self, work: _Work) -> None:
        """A slot came free: the next waiters whose prefill still fits in their budget start;
        those whose no longer does are refused (their wait began when they joined)."""
        self.running.remove(work)
        while self.waiting and len(self.running) < self.slots:
            nxt = self.waiting.popleft()
            assert nxt.ticket is not None
            if nxt.ticket.done():
                continue
            now = self.clock()
            by = nxt.first_token_by
            if by is not None and now + self.estimate.first_token_s(nxt.prompt_tokens) > by:
                nxt.ticket.set_exception(self._expired(nxt))
                continue
            nxt.ticket.set_result(self._start(nxt, now))

    def close(self, message: str, retry_after_ms: int) -> None:
        """Refuses every waiter now, and every request from now on (UNAVAILABLE)."""
        self.closed = RequestError(grpc.StatusCode.UNAVAILABLE, message, retry_after_ms)
        while self.waiting:
            work = self.waiting.popleft()
            if work.ticket is not None and not work.ticket.done():
                work.ticket.set_exception(_closed_error(self.closed))

    @staticmethod
    def _busy(
        message: str, retry_after_s: float, kind: type[RequestError] = RequestError
    ) -> RequestError:
        return kind(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            message,
            retry_after_ms=max(1, round(retry_after_s * 1000)),
        )


class GatedAdmission:
    """A ModelGate per model."""

    def __init__(self, gates: dict[str, ModelGate]) -> None:
        self.gates = gates

    async def admit(
        self,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        first_token_by: float | None,
        limit: Limit = TTFT_BUDGET,
    ) -> Ticket:
        return await self.gates[model].admit(prompt_tokens, max_tokens, first_token_by, limit)

    def close(self, message: str, retry_after_ms: int) -> None:
        for gate in self.gates.values():
            gate.close(message, retry_after_ms)
