"""The gateway's request path, as named stages, for every front end (gRPC today).

    route → check → cache lookup → tokenize → single flight → [admission → engine] → deliver → store

- route: the model the request names.
- check: every field valid and bounded, text NFC-normalized (request.check); no tokenizing yet.
- cache lookup: deterministic requests only, through the tier cascade; a hit is replayed in the shape
  of a generated answer and never needs the engine, so nothing after this stage runs for it.
- tokenize: prompt or chat → token ids, checked against the model's limits; long inputs are
  tokenized on a worker thread so the event loop keeps streaming everyone else's tokens.
- single flight: identical cacheable misses share one generation and all see it live.
- admission: the generation asks for a slot at the engine before it starts and frees it when it ends
  (a follower of a flight rides on its leader's slot); the engine stage streams token ids from the
  model's Backend and decodes them (generation.py).
- deliver: events become this client's messages with this client's timings.
- store: after the final message is out, a complete answer is written to the cache once per flight,
  under the identity of the model that produced it.

Errors leave as RequestError with the status the client gets; the facts of every request, however it
ended, go to the report sink once.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from appliance.admission import Admission
from appliance.backends.base import BackendError, GenerationRequest
from appliance.cache.entry import CachedAnswer
from appliance.cache.keys import SamplingKey, cache_key, is_deterministic
from appliance.cache.policy import CachePlan, OnlyNotPossible, plan
from appliance.cache.singleflight import Flight, SingleFlight
from appliance.cache.tiers import CacheQuery, TierCascade
from appliance.errors import RequestError
from appliance.gateway import messages
from appliance.gateway.generation import Delta, Event, Outcome, generate
from appliance.gateway.models import ServedModel
from appliance.gateway.report import ReportSink, RequestReport
from appliance.request import CheckedRequest, PreparedRequest, check, echo, tokenize
from appliance.v1 import inference_pb2 as pb

# Inputs longer than this are tokenized on a worker thread (the tokenizer releases the GIL).
TOKENIZE_INLINE_CHARS = 8192


class Pipeline:
    def __init__(
        self,
        models: dict[str, ServedModel],
        cache: TierCascade | None,
        admission: Admission,
        sink: ReportSink,
    ) -> None:
        self.models = models
        self.cache = cache
        self.admission = admission
        self.sink = sink
        self.flights: SingleFlight[Event] = SingleFlight()
        # Engine-side request ids are the gateway's own: a client's request_id is not unique across
        # clients, and `stop=true` with a shared id would cancel another client's generation.
        self._engine_ids = (f"gw{os.getpid()}-{n}" for n in itertools.count())
        self._tokenizers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.draining = False

    async def run(
        self, request: pb.GenerateRequest, deadline_s: float | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The request's messages; raises RequestError. `deadline_s`: seconds the client gives."""
        received = time.monotonic_ns()
        report = RequestReport(request_id=request.request_id)
        try:
            model = self.route(request)
            report.model = model.name
            checked = check(request, model.limits)
            report.request_id, report.namespace = checked.request_id, checked.namespace
            query = self.cache_query(model, checked)
            cache_plan = self.cache_plan(checked, query)
            if query is not None and cache_plan.read:
                hit = await self.lookup(query, cache_plan)
                if hit is not None:
                    for message in self.replay(hit, report, received):
                        yield message
                    return
            prepared = await self.tokenize(model, checked)
            shared = query if cache_plan.write else None
            events, flight = self.single_flight(model, prepared, shared, deadline_s)
            async for message in self.deliver(events, report, received):
                yield message
            if shared is not None and flight is not None:
                self.store(shared, flight)
        except RequestError as exc:
            report.status = exc.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            report.status = grpc.StatusCode.CANCELLED.name
            raise
        finally:
            if not report.total_us:
                report.total_us = (time.monotonic_ns() - received) // 1000
            self.sink.report(report)

    # -- stages -------------------------------------------------------------------------------

    def route(self, request: pb.GenerateRequest) -> ServedModel:
        model = self.models.get(request.model)
        if model is None:
            known = ", ".join(sorted(self.models))
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"unknown model {echo(request.model)}; known models: {known}",
            )
        return model

    def cache_query(self, model: ServedModel, checked: CheckedRequest) -> CacheQuery | None:
        """The request as the cache sees it; None when its answer may not be cached."""
        if self.cache is None or checked.cache_policy == checked.cache_policy.BYPASS:
            return None
        s = checked.sampling
        sampling = SamplingKey(
            max_tokens=checked.max_tokens,
            greedy=s.top_k == 1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stops=checked.stops,
        )
        if not is_deterministic(sampling):
            self.cache.metrics.not_cacheable += 1
            return None
        key = cache_key(
            checked.namespace, model.identity, checked.prompt, checked.messages, sampling
        )
        return CacheQuery(
            key, checked.namespace, model.identity, checked.prompt, checked.messages, sampling
        )

    @staticmethod
    def cache_plan(checked: CheckedRequest, query: CacheQuery | None) -> CachePlan:
        try:
            return plan(checked.cache_policy, cacheable=query is not None)
        except OnlyNotPossible as exc:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None

    async def lookup(
        self, query: CacheQuery, cache_plan: CachePlan
    ) -> tuple[CachedAnswer, str] | None:
        assert self.cache is not None
        hit = await self.cache.lookup(query)
        if hit is None and cache_plan.only:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND, "no cached answer for this request (cache_policy ONLY)"
            )
        return hit

    def replay(
        self, hit: tuple[CachedAnswer, str], report: RequestReport, received: int
    ) -> list[pb.GenerateResponse]:
        """A cached answer in the shape of a generated one: one delta, then the final message."""
        answer, report.tier = hit
        started = time.monotonic_ns()
        report.answered_by = report.model
        report.finish_reason = answer.finish_reason
        report.prompt_tokens, report.completion_tokens = (
            answer.prompt_tokens,
            answer.completion_tokens,
        )
        delta = pb.GenerateResponse(
            request_id=report.request_id, text=answer.text, token_ids=answer.token_ids
        )
        return [delta, messages.final(report, received, started, time.monotonic_ns())]

    async def tokenize(self, model: ServedModel, checked: CheckedRequest) -> PreparedRequest:
        chars = len(checked.prompt or "") + sum(len(c) for _, c in checked.messages)
        if chars <= TOKENIZE_INLINE_CHARS:
            return tokenize(checked, model.text, model.limits)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenizers, tokenize, checked, model.text, model.limits
        )

    def single_flight(
        self,
        model: ServedModel,
        prepared: PreparedRequest,
        shared: CacheQuery | None,
        deadline_s: float | None,
    ) -> tuple[AsyncIterator[Event], Flight[Event] | None]:
        """The events this client follows: its own generation, or the flight for its cache key.

        Deadlines differ on purpose. Alone, the client is the only one waiting, so the engine call
        carries the client's deadline and the engine stops at it. In a flight the generation is
        shared by followers whose deadlines differ, so it carries none: each follower's own
        deadline ends its own call, and the generation is cancelled when its last follower leaves.
        """
        if shared is None:
            return self.engine(model, prepared, deadline_s), None
        flight, led = self.flights.join(shared.key, lambda: self.engine(model, prepared, None))
        if not led and self.cache is not None:
            self.cache.metrics.single_flight_followers += 1
        return flight.follow(), flight

    async def engine(
        self,
        model: ServedModel,
        prepared: PreparedRequest,
        timeout_s: float | None,
    ) -> AsyncIterator[Event]:
        """Admission, then the generation; the slot is held exactly as long as it runs."""
        ticket = await self.admission.admit(
            model.name, len(prepared.prompt_ids), prepared.max_tokens
        )
        try:
            request = GenerationRequest(
                request_id=next(self._engine_ids),
                prompt_ids=prepared.prompt_ids,
                max_tokens=prepared.max_tokens,
                end_id=model.text.end_id,
                pad_id=model.text.pad_id,
                sampling=prepared.sampling,
                timeout_s=timeout_s,
            )
            async for event in generate(model, request, prepared.stops):
                yield event
        finally:
            ticket.release()

    async def deliver(
        self, events: AsyncIterator[Event], report: RequestReport, received: int
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Events as this client's messages; the report gets this client's timings."""
        started = time.monotonic_ns()
        first = last = 0
        gaps = report.inter_token_us
        try:
            async for event in events:
                if isinstance(event, Delta):
                    yield messages.delta(report.request_id, event)
                    now = time.monotonic_ns()
                    if event.token_ids:
                        if last:
                            gaps.append((now - last) // 1000)
                        last = now
                    first = first or now
                    continue
                self._outcome(report, event)
                yield messages.final(report, received, started, first)
        except BackendError as exc:
            if not (self.draining and exc.code == grpc.StatusCode.CANCELLED):
                raise RequestError(exc.code, exc.message) from None
            report.finish_reason = "cancelled"
            yield messages.final(report, received, started, first)

    def store(self, query: CacheQuery, flight: Flight[Event]) -> None:
        """Once per flight, after the final message: a complete answer, keyed by its producer."""
        if self.cache is None or not flight.done or flight.written or not flight.events:
            return
        outcome = flight.events[-1]
        if not isinstance(outcome, Outcome) or outcome.finish_reason not in ("stop", "length"):
            return
        flight.written = True
        if outcome.produced_by != query.model:
            # Another model answered (a fallback): its answer is keyed by its own identity, so
            # the primary's key never returns it.
            key = cache_key(
                query.namespace, outcome.produced_by, query.prompt, query.messages, query.sampling
            )
            query = CacheQuery(
                key,
                query.namespace,
                outcome.produced_by,
                query.prompt,
                query.messages,
                query.sampling,
            )
        self.cache.store(query, messages.answer_of(flight.events))

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _outcome(report: RequestReport, outcome: Outcome) -> None:
        report.finish_reason = outcome.finish_reason
        report.prompt_tokens = outcome.prompt_tokens
        report.completion_tokens = outcome.completion_tokens
        report.answered_by = outcome.produced_by.name

    def close(self) -> None:
        self._tokenizers.shutdown(wait=False, cancel_futures=True)
