"""The gateway's request path, as named stages, for every front end (gRPC and the OpenAI HTTP API).

    authorize → route → check → cache lookup → failover → tokenize → single flight
          → [admission → engine] → deliver → read call → store

Front ends translate their wire format into an IncomingRequest (messages.py, openai_wire.py) and
the pipeline's replies (generation.Delta, reply.Final) back; nothing here knows a wire format.

- authorize: who is asking and whether they may (security.auth): the API key or client
  certificate, the key's rate limits, its scope and the namespace it may use; before anything else
  is looked at. A front end checks what it can before it reads the request (the gRPC API all of
  it, the HTTP API all but the scope and namespace its body names) and hands the Grant over; they
  are checked here (again).
- route: the model the request names.
- check: every field valid and bounded, text NFC-normalized (request.check); no tokenizing yet.
  A chat with tools is written here (its past calls' arguments parsed and written into its
  messages, and the whole keyed for the cache), after its size as sent is bounded; one longer
  than a long input is checked on a worker thread (as tokenize's long inputs are).
- cache lookup: deterministic requests only, through the tier cascade; a hit is replayed in the shape
  of a generated answer and never needs the engine, so of the stages after this one only read
  call runs for it (and, for a semantic hit, tokenize: its usage counts the request's own prompt). A tier that overlaps the engine (the semantic tier with `overlap_engine` on)
  is asked after the exact tiers missed, while failover, tokenize and single flight start the
  generation: its miss finds the generation under way, its hit leaves it (cancelled when nobody
  else follows it). The client sees nothing of the generation before the tier's decision; a
  generation that failed meanwhile fails the request only on a miss.
- failover: the model's engine if it is usable (reachable, breaker not open), else its fallback
  model (the answer says it is degraded), else UNAVAILABLE at once.
- tokenize: prompt or chat → token ids with the generating model's tokenizer, checked against its
  limits; long inputs are tokenized on a worker thread so the event loop keeps streaming.
- single flight: identical cacheable misses share one generation and all see it live. Every
  generation runs in its own task and records its events, so a client that reads slowly never holds
  the engine: the engine is drained at its own speed (memory is bounded by max_tokens).
- admission: the generation asks for a slot at the engine before it starts and frees it when it ends
  (a follower rides on its leader's slot; a flight refused before it started by its leader's
  budgets has its followers ask again with their own, any other refusal is theirs as it is: a
  full line refuses them all with one admission); the engine stage streams token ids
  from the model's Backend, decodes them (generation.py) and tells the model's breaker how the
  engine did (judged by the model's TTFT budget, never a client's).
- deliver: events become this client's replies with this client's timings, within its deadline
  (the client's, or the model's default when the client sets none).
- read call: a request with tools has the tool call its answer makes read out of the replies
  (generated or replayed) once, for every front end (call_reader.py): the Final carries it, and
  text that may still be a call is held back where the front end asks.
- store: after the Final is out, a complete answer is written to the cache once per flight,
  under the identity of the model that produced it; each tier refuses it when an invalidation
  that covers it came after the flight's leader marked the cache (its lookup, or the cascade's
  mark before the engine was asked).

Errors leave as RequestError with the status the client gets; the facts of every request, however it
ended, go to the report sink once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import secrets
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from appliance.backends.base import BackendError, GenerationRequest
from appliance.cache.keys import ModelIdentity, SamplingKey, cache_key, is_deterministic
from appliance.cache.policy import CachePlan, CachePolicy, OnlyNotPossible, plan
from appliance.cache.singleflight import Flight, SingleFlight
from appliance.cache.tiers import CacheQuery, Hit, MissUnsure, TierCascade
from appliance.gateway.admission import TTFT_BUDGET, Admission, Limit, OverBudget
from appliance.gateway.call_reader import CallReader
from appliance.gateway.errors import MODEL_NOT_FOUND, RequestError
from appliance.gateway.generation import Delta, Event, Outcome, Started, answer_of, generate
from appliance.gateway.models import ServedModel
from appliance.gateway.reply import Final, Reply, final_of
from appliance.gateway.report import ReportSink, RequestReport
from appliance.gateway.request import (
    CheckedRequest,
    IncomingRequest,
    PreparedRequest,
    check,
    check_guide,
    check_inputs,
    check_speculation,
    check_top_logprobs,
    context_limit,
    echo,
    tokenize,
    valid_request_id,
)
from appliance.namespace import MAX_LENGTH as MAX_NAMESPACE
from appliance.security.auth import (
    CACHE_ONLY,
    GENERATE,
    NO_CREDENTIALS,
    AccessControl,
    Credentials,
    Grant,
)
from appliance.text.tokenizer import INLINE_CHARS

log = logging.getLogger(__name__)

T = TypeVar("T")

# An engine's statuses that are never the client's to get (errors.py): its own failure.
UPSTREAM_FAILURES = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
)
# Engine failures that say the engine is unwell (the others are the request's or the client's):
# its own failures among them, which the client is told of as the engine's.
ENGINE_FAULTS = UPSTREAM_FAILURES | {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,
}

# Finish reasons of a complete answer: the only ones cached.
CACHED_FINISHES = frozenset({"stop", "length"})
# The shortest retry hint of an UNAVAILABLE refusal (engine unreachable, breaker about to close,
# gateway stopping): the health monitor sees an engine come back at its next readiness poll, once a
# second, so a retry sooner finds it unavailable again, and a hint of a few milliseconds would have
# every client retry in a tight loop.
UNAVAILABLE_RETRY_MS = 1000
STOPPING = "the gateway is shutting down; retry on another gateway"
# gRPC cancels a call at its deadline, which runs from when the service read the time remaining,
# microseconds before the pipeline's clock starts: a call cancelled within this much of its
# deadline, or after it, was ended by the deadline.
DEADLINE_SLACK_NS = 1_000_000

# The limits a request's first token may be held to, as admission's refusals name them.
MODEL_TTFT_BUDGET = Limit(
    "the model's default time-to-first-token budget (the request set no ttft_budget_ms)",
    "send a larger ttft_budget_ms, or retry later",
)
CLIENT_DEADLINE = Limit(
    "the request's deadline", "give the request a longer deadline, or retry later", deadline=True
)
MODEL_DEADLINE = Limit(
    "the model's default deadline (default_deadline_s; the request set none)",
    "give the request a longer deadline of its own, or retry later",
    deadline=True,
)


def scope_of(cache_policy: int) -> str:
    """The scope a request of this cache policy (the number the client sent) needs."""
    return CACHE_ONLY if cache_policy == CachePolicy.ONLY.value else GENERATE


def engine_failure(exc: BackendError, input_field: str) -> RequestError:
    """What the client is told of a generation the engine ended with an error. The engine's own
    failure (INTERNAL, UNKNOWN, DATA_LOSS: it broke, or sent a status it should not) is a service
    that could not answer now, UNAVAILABLE with the retry hint of one, as a proxy tells of a
    failed upstream: a retry may reach a recovered engine or another gateway. Its words are kept.
    An engine that was or became unreachable (UNAVAILABLE: it restarted under the stream) is the
    same to the client, retry hint included.
    `input_field`: the prompt's field, named where the engine refused the input itself (and the
    guide where it refused the guide)."""
    if exc.code in UPSTREAM_FAILURES or exc.code == grpc.StatusCode.UNAVAILABLE:
        return RequestError(grpc.StatusCode.UNAVAILABLE, exc.message, UNAVAILABLE_RETRY_MS)
    field = input_field if exc.reason is not None else exc.field
    return RequestError(exc.code, exc.message, reason=exc.reason, field=field)


def backend_bug(model: ServedModel, exc: Exception) -> BackendError:
    """The engine failure a backend's own exception (no BackendError) stands for; the log says
    where it was raised (its words are not logged: they may hold a request's bytes)."""
    where = traceback.extract_tb(exc.__traceback__)[-1:]
    at = f"{where[0].filename}:{where[0].lineno}" if where else "an unknown place"
    log.error(
        "model '%s': its backend raised %s at %s, not a BackendError",
        model.name,
        type(exc).__name__,
        at,
    )
    return BackendError(
        grpc.StatusCode.INTERNAL,
        f"the backend of model '{model.name}' failed ({type(exc).__name__})",
    )


def stopping() -> RequestError:
    """The refusal of a request the stopping gateway will not answer (sent nothing yet)."""
    return RequestError(grpc.StatusCode.UNAVAILABLE, STOPPING, UNAVAILABLE_RETRY_MS)


def keyed_by(query: CacheQuery, produced_by: ModelIdentity) -> CacheQuery:
    """The query an answer is cached under: another model's answer (a fallback's) is keyed by that
    model's identity, so the requested model's key never returns it."""
    if produced_by == query.model:
        return query
    key = cache_key(query.namespace, produced_by, query.prompt, query.messages, query.sampling)
    return dataclasses.replace(query, key=key, model=produced_by)


def sampling_key(checked: CheckedRequest, within: int = 0) -> SamplingKey:
    """What of a checked request's sampling changes its answer (the cache key's part).
    `within`: the limit a default max_tokens is lowered within (context_limit)."""
    s = checked.sampling
    key = _sampling_key(checked.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, checked.stops)
    if checked.default_max_tokens:
        # Not the client's max_tokens: the default, lowered to what `within` leaves after the
        # prompt; neither an explicit max_tokens of the same number nor another limit's answer.
        key = dataclasses.replace(key, default_within=within)
    if checked.guide is not None:  # not in the memo: a guide's text may be 64 KiB
        key = dataclasses.replace(key, guide=(checked.guide.kind, checked.guide.text))
    if checked.min_tokens or checked.ignore_eos:
        key = dataclasses.replace(key, min_tokens=checked.min_tokens, ignore_eos=checked.ignore_eos)
    if checked.speculation is False and not key.greedy:
        key = dataclasses.replace(key, speculation_off=True)
    if checked.tool_chat is not None:
        key = dataclasses.replace(key, tools=checked.tool_chat.key)
    return key


@functools.lru_cache(maxsize=1024)
def _sampling_key(
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stops: tuple[str, ...],
) -> SamplingKey:
    """Built once per set of parameters (most requests share a few; a frozen dataclass costs
    microseconds to build). Equal arguments give an equal key: checked sampling has no -0.0 and
    no NaN, the only floats that compare otherwise than they format."""
    return SamplingKey(
        max_tokens=max_tokens,
        greedy=top_k == 1,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stops=stops,
    )


@dataclass(slots=True)
class Budget:
    """When this request's answer must be complete, and its first token at the latest."""

    expires: float  # time.monotonic()
    first_token_by: float
    # Seconds the engine itself may take to the first token before the breaker counts it a fault:
    # the model's TTFT budget, never a client's (a budget below the engine's TTFT is the client's).
    engine_ttft_s: float | None
    # What sets first_token_by, as admission's refusal names it.
    limit: Limit = TTFT_BUDGET


@dataclass(slots=True)
class Generation:
    """A generation this request follows: the model generating it, the cache query its answer is
    written under (None: never written) and its flight."""

    model: ServedModel
    shared: CacheQuery | None
    flight: Flight[Event]
    # Tokens of the prompt as the generating model counts them.
    prompt_tokens: int
    # Another request leads the flight: counted as a single-flight follower once this one follows
    # it (a generation started beside a lookup that then hits never is).
    follows: bool = False
    # The request holds the flight (it was started beside a lookup); deliver ends the hold.
    held: bool = False
    # When this request began to wait on it (time.monotonic_ns()): its queue time ends no earlier.
    since_ns: int = dataclasses.field(default_factory=time.monotonic_ns)
    # The request field the engine's refusal of its input names: "prompt" or "messages".
    input_field: str = "prompt"


@dataclass(slots=True)
class Undecided:
    """The tiers before `first` missed; the ones from `first` on are slower than starting a
    generation, so they are asked while it starts."""

    query: CacheQuery
    first: int


class Pipeline:
    def __init__(
        self,
        models: dict[str, ServedModel],
        cache: TierCascade | None,
        admission: Admission,
        sink: ReportSink,
        access: AccessControl | None = None,
    ) -> None:
        self.models = models
        self.access = access or AccessControl()
        self.cache = cache
        self.admission = admission
        self.sink = sink
        self.flights: SingleFlight[Event] = SingleFlight()
        # Engine-side request ids are the gateway's own: a client's request_id is not unique across
        # clients, and `stop=true` with a shared id would cancel another client's generation.
        # The random part keeps two pipelines of one process (tests, a restart in place) apart.
        prefix = f"gw{os.getpid()}-{secrets.token_hex(4)}"
        self._engine_ids = (f"{prefix}-{n}" for n in itertools.count())
        self._tokenizers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.draining = False
        # Done once the drain's grace is over: the waits for a tokenizer thread end then.
        self._grace_over: asyncio.Future[None] | None = None
        # Requests being answered, by requested model (read by the metrics collector).
        self.in_flight: dict[str, int] = dict.fromkeys(models, 0)

    async def run(
        self,
        request: IncomingRequest,
        deadline_s: float | None,
        credentials: Credentials = NO_CREDENTIALS,
        front_end: str = "grpc",
        hold_call_text: bool = False,
        admitted: Grant | None = None,
    ) -> AsyncIterator[Reply]:
        """The request's replies: text deltas, then the Final; raises RequestError.
        `deadline_s`: seconds the client gives; `credentials`: what the client presented (none:
        refused when the gateway has keys); `front_end`: which one received it, for metrics and
        the access log; `hold_call_text`: a request with tools gets no text of an answer that is
        a tool call, only the call in its Final (else the text streams as generated and the
        Final carries the call too; call_reader.py); `admitted`: the grant the front end got for
        the credentials before it read the request (AccessControl.admit or authorize), whose
        scope and namespace are checked here and which is released here."""
        received = time.monotonic_ns()
        # A request id the check would refuse (control characters, non-ASCII) is not logged.
        request_id = request.request_id if valid_request_id(request.request_id) else ""
        report = RequestReport(
            request_id=request_id,
            front_end=front_end,
        )
        grant = admitted
        routed: str | None = None
        try:
            grant = self.authorize(request, credentials, report, admitted)
            model = self.route(request.model)
            report.model = routed = model.name
            self.in_flight[routed] += 1
            since = time.monotonic()
            checked = await self.check(request, model, grant.namespace, report, deadline_s)
            calls = self.call_reader(checked, hold_call_text)
            budget = self.budget(model, checked, deadline_s, since)
            query = self.cache_query(model, checked)
            cache_plan = self.cache_plan(checked, query)
            start = functools.partial(self.start, model, checked, cache_plan, budget, query)
            found: Hit | Undecided | Generation | None = None
            if query is not None and cache_plan.read:
                found = await self.lookup(query, cache_plan)
            if isinstance(found, Undecided):
                found = await self.overlap(found, start, report)
            if isinstance(found, Hit):
                prompt_tokens = found.answer.prompt_tokens
                if found.similarity is not None:  # another question's answer: count this one's
                    prompted = await self.tokenize(model, checked, budget.expires)
                    prompt_tokens = len(prompted.prompt_ids)
                for reply in self.replay(found, report, received, prompt_tokens):
                    for shown in self.shown(calls, reply):
                        yield shown
                return
            generation = found if isinstance(found, Generation) else await start()
            while True:
                try:
                    async for reply in self.deliver(generation, report, received, budget, model):
                        for shown in self.shown(calls, reply):
                            yield shown
                    break
                except RequestError as exc:
                    if self.refused_for_its_leader(generation, exc, budget):
                        generation = await start()  # admitted, or refused, by its own budget now
                        continue
                    if not self.may_fall_back(model, generation.model, exc, report):
                        raise
                    # The engine failed before answering (nothing was read): the fallback answers.
                    generation = await start(skip_primary=True)
                    async for reply in self.deliver(generation, report, received, budget, model):
                        for shown in self.shown(calls, reply):
                            yield shown
                    break
            self.store(generation)
        except RequestError as exc:
            report.status = exc.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            report.status = self._cancelled_status(deadline_s, received).name
            raise
        finally:
            if grant is not None:
                grant.release()
            if routed is not None:
                self.in_flight[routed] -= 1
            if not report.total_us:
                report.total_us = (time.monotonic_ns() - received) // 1000
            if report.status == "DEADLINE_EXCEEDED":
                report.deadline = "model" if deadline_s is None else "client"
            self.sink.report(report)

    # -- stages -------------------------------------------------------------------------------

    def authorize(
        self,
        request: IncomingRequest,
        credentials: Credentials,
        report: RequestReport,
        admitted: Grant | None = None,
    ) -> Grant:
        """Access control: who is asking, whether they may, and the namespace they may use (a
        key holding one namespace may leave it out). `admitted`: the front end's grant for the
        credentials; the scope and namespace the request names are checked on it."""
        scope = scope_of(request.cache_policy)
        report.key_id = credentials.claimed_key_id()
        report.namespace = request.namespace[:MAX_NAMESPACE]  # refused later when longer
        if admitted is None:
            grant = self.access.authorize(credentials, request.namespace, scope)
        else:
            report.key_id = admitted.key_id
            self.access.permit(admitted, request.namespace, scope)
            grant = admitted
        report.key_id = grant.key_id
        report.namespace = grant.namespace[:MAX_NAMESPACE]
        return grant

    def route(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            known = ", ".join(sorted(self.models))
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"unknown model {echo(name)}; known models: {known}",
                reason=MODEL_NOT_FOUND,
                field="model",
            )
        return model

    async def check(
        self,
        request: IncomingRequest,
        model: ServedModel,
        namespace: str,
        report: RequestReport,
        deadline_s: float | None,
    ) -> CheckedRequest:
        """Every field valid and bounded (request.check), and nothing asked of the model's engine
        that it cannot do (drafts, alternatives per token, guides, inputs it lacks). A chat with
        tools longer than INLINE_CHARS (as sent) is checked on a worker thread: writing it parses
        and writes back every past call's arguments and keys the chat, work in proportion to
        them; its wait for a thread ends at the request's deadline (`deadline_s`, the model's
        default when None) as the tokenize stage's does. Long arguments are parsed and written
        in steps (json_steps), and the key a message and a call at a time: one C call holds the
        GIL from its start to its end, and the loop runs only between them."""
        chat = request.tool_chat
        if chat is not None and chat.chars() > INLINE_CHARS:
            expires = time.monotonic() + self.deadline_of(model, deadline_s)
            checked = await self.on_worker(
                functools.partial(check, request, model.limits, namespace),
                model,
                expires,
                "the messages were still waiting to be checked",
            )
        else:
            checked = check(request, model.limits, namespace)
        report.request_id = checked.request_id
        check_speculation(checked, model.name, model.backend.speculation)
        check_top_logprobs(checked, model.name, model.backend.max_top_logprobs)
        check_guide(checked, model.name, model.backend.guided)
        check_inputs(checked, model.name, model.backend.unserved)
        return checked

    @staticmethod
    def call_reader(checked: CheckedRequest, hold_text: bool) -> CallReader | None:
        """read call: the reader of the tool call the answer makes; None without tools (the
        replies pass untouched)."""
        chat = checked.tool_chat
        return None if chat is None else CallReader.of(chat, checked.request_id, hold_text)

    @staticmethod
    def shown(calls: CallReader | None, reply: Reply) -> tuple[Reply, ...]:
        """read call: what the client is sent for one of the pipeline's replies (the reply
        itself for a request without tools)."""
        return (reply,) if calls is None else calls.read(reply)

    @staticmethod
    def deadline_of(model: ServedModel, deadline_s: float | None) -> float:
        """Seconds a request has: the client's deadline, or the model's default one."""
        return deadline_s if deadline_s is not None else model.policy.default_deadline_s

    @staticmethod
    def budget(
        model: ServedModel,
        checked: CheckedRequest,
        deadline_s: float | None,
        since: float | None = None,
    ) -> Budget:
        """The client's deadline, or the model's default one: a hung engine never holds a client
        that set none forever. The TTFT budget is the client's or the model's default. Both run
        from `since` (time.monotonic(); now when None): the check stage's start."""
        now = time.monotonic() if since is None else since
        expires = now + Pipeline.deadline_of(model, deadline_s)
        ttft_s = (
            checked.ttft_budget_ms / 1000
            if checked.ttft_budget_ms is not None
            else model.policy.ttft_budget_s
        )
        if ttft_s is not None and now + ttft_s < expires:
            limit = TTFT_BUDGET if checked.ttft_budget_ms is not None else MODEL_TTFT_BUDGET
            return Budget(expires, now + ttft_s, model.policy.ttft_budget_s, limit)
        limit = CLIENT_DEADLINE if deadline_s is not None else MODEL_DEADLINE
        return Budget(expires, expires, model.policy.ttft_budget_s, limit)

    def cache_query(self, model: ServedModel, checked: CheckedRequest) -> CacheQuery | None:
        """The request as the cache sees it; None when its answer may not be cached. An answer
        with log-probabilities is never cached: a cached answer holds none to replay."""
        if self.cache is None or checked.cache_policy == checked.cache_policy.BYPASS:
            return None
        if checked.logprobs:
            self.cache.metrics.not_cacheable += 1
            return None
        within = 0
        if checked.default_max_tokens:
            within = context_limit(model.limits, model.backend.engine_limits)[0]
        sampling = sampling_key(checked, within)
        if not is_deterministic(sampling):
            self.cache.metrics.not_cacheable += 1
            return None
        key = cache_key(
            checked.namespace, model.identity, checked.prompt, checked.messages, sampling
        )
        return CacheQuery(
            key,
            checked.namespace,
            model.identity,
            checked.prompt,
            checked.messages,
            sampling,
            checked.semantic_cache,
        )

    @staticmethod
    def cache_plan(checked: CheckedRequest, query: CacheQuery | None) -> CachePlan:
        try:
            return plan(checked.cache_policy, cacheable=query is not None)
        except OnlyNotPossible as exc:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None

    async def lookup(self, query: CacheQuery, cache_plan: CachePlan) -> Hit | Undecided | None:
        """The tiers in order, up to the first whose lookup overlaps the engine (never for ONLY,
        which must not generate): a miss there leaves the rest Undecided."""
        assert self.cache is not None
        split = len(self.cache.tiers) if cache_plan.only else self.cache.split(query)
        try:  # ONLY: a miss with a tier not asked (Redis failing) is no NOT_FOUND
            hit = await self.cache.lookup(query, stop=split, sure=cache_plan.only)
        except MissUnsure as exc:
            retry_ms = max(UNAVAILABLE_RETRY_MS, round(exc.retry_after_s * 1000))
            raise RequestError(grpc.StatusCode.UNAVAILABLE, str(exc), retry_ms) from None
        if hit is None and split < len(self.cache.tiers):
            return Undecided(query, split)
        if hit is None and cache_plan.only:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND, "no cached answer for this request (cache_policy ONLY)"
            )
        return hit

    async def overlap(
        self,
        undecided: Undecided,
        start: Callable[[], Awaitable[Generation]],
        report: RequestReport,
    ) -> Hit | Generation:
        """The undecided tiers, asked while the generation starts. The request holds the
        generation until the tiers decide: a hit leaves it, a miss follows it from its first event.
        A generation that could not start (unavailable, refused) matters only on a miss."""
        assert self.cache is not None
        lookup = asyncio.get_running_loop().create_task(
            self.cache.lookup(undecided.query, start=undecided.first)
        )
        generation: Generation | None = None
        failure: RequestError | None = None
        try:
            await asyncio.sleep(0)  # the lookup's first step hands its embedding to a thread
            answered = lookup.result() if lookup.done() else None
            if answered is not None:
                # It needed no thread (the question's vector was a recent one): nothing to overlap.
                return answered
            try:
                generation = await start()
            except RequestError as exc:
                failure = exc
            else:
                # The flight was made without an await since: nobody has left it yet.
                generation.flight.hold()
                generation.held = True
            hit = await lookup
        except BaseException:
            lookup.cancel()
            if generation is not None:
                generation.flight.release()
            raise
        if hit is not None:
            report.overlap = self.leave(generation)
            return hit
        report.overlap = "missed"
        if failure is not None:
            raise failure
        assert generation is not None
        return generation

    def leave(self, generation: Generation | None) -> str:
        """Lets go of a generation a hit made unneeded; what became of it, for the report."""
        if generation is None:
            return "failed"
        if generation.flight.release():
            if not generation.flight.started.is_set():
                return "unstarted"  # cancelled before its first step: no engine work was done
            assert self.cache is not None
            self.cache.metrics.engine_cancelled_by_hit += 1
            return "cancelled"
        return "ended" if generation.flight.done else "shared"

    def replay(
        self, hit: Hit, report: RequestReport, received: int, prompt_tokens: int
    ) -> tuple[Delta, Final]:
        """A cached answer in the shape of a generated one: one delta, then the Final, which
        counts `prompt_tokens` (the request's own: a semantic hit's answer was cached for
        another question)."""
        answer, report.tier, report.cache_entry = hit.answer, hit.tier, hit.entry.hex()
        report.similarity = hit.similarity
        started = time.monotonic_ns()
        report.answered_by = report.model
        report.finish_reason = answer.finish_reason
        report.prompt_tokens = prompt_tokens
        report.completion_tokens = answer.completion_tokens
        delta = Delta(answer.text, answer.token_ids, None, prompt_tokens)
        return delta, final_of(report, received, started, time.monotonic_ns())

    def failover(self, model: ServedModel, skip_primary: bool = False) -> ServedModel:
        """The model whose engine generates: this one, its fallback, or none (UNAVAILABLE)."""
        if model.health.routable() and not skip_primary:
            return model
        fallback = self.models.get(model.policy.fallback or "")
        if fallback is not None and fallback.health.routable():
            return fallback
        why = model.health.describe()
        also = (
            f"; its fallback '{fallback.name}' is unavailable too ({fallback.health.describe()})"
            if fallback is not None
            else "; no fallback model is configured"
        )
        retry_s = max(0.0, model.health.breaker.retry_in())
        raise RequestError(
            grpc.StatusCode.UNAVAILABLE,
            f"model '{model.name}' (inference server at {model.backend.address}) is "
            f"unavailable: {why}{also}",
            retry_after_ms=max(UNAVAILABLE_RETRY_MS, round(retry_s * 1000)),
        )

    @staticmethod
    def refused_for_its_leader(generation: Generation, exc: RequestError, budget: Budget) -> bool:
        """Whether admission refused a flight this request only followed, before the engine
        started it, by the leader's own budget (its TTFT budget, its deadline): this request's
        own may still be met by a generation of its own. A refusal that applies to every request
        alike (a full line, an open breaker, a stopping gateway) is this request's too."""
        return (
            generation.follows
            and exc is generation.flight.error
            and isinstance(exc, OverBudget)
            and not generation.flight.events  # admitted: its first event is Started
            and time.monotonic() < budget.first_token_by
        )

    def may_fall_back(
        self, model: ServedModel, target: ServedModel, exc: RequestError, report: RequestReport
    ) -> bool:
        """Whether a failed generation may go to the fallback: the requested model's engine was
        unreachable or failed the request itself (UNAVAILABLE, engine_failure) and the client has
        seen nothing of an answer yet."""
        fallback = self.models.get(model.policy.fallback or "")
        return (
            target is model
            and exc.code == grpc.StatusCode.UNAVAILABLE
            and report.ttft_us == 0
            and fallback is not None
            and fallback.health.routable()
        )

    async def start(
        self,
        model: ServedModel,
        checked: CheckedRequest,
        cache_plan: CachePlan,
        budget: Budget,
        looked: CacheQuery | None,
        skip_primary: bool = False,
    ) -> Generation:
        """failover → tokenize → single flight: the generation under way, not yet followed.
        `looked`: the query the cache was asked; the answer's query takes its marks (what each
        tier's store compares against), or, for another model's key or a plan that did not
        read, marks of its own taken before the engine is asked."""
        target = self.failover(model, skip_primary)
        prepared = await self.tokenize(target, checked, budget.expires)
        shared = self.cache_query(target, checked) if cache_plan.write else None
        if shared is not None and self.cache is not None:
            if looked is not None and looked.key == shared.key:
                shared = looked
            await self.cache.mark(shared)
        flight, led = self.single_flight(target, prepared, shared, budget)
        if led:
            flight.owner = shared
        return Generation(
            target,
            shared,
            flight,
            len(prepared.prompt_ids),
            follows=not led,
            input_field=checked.input_field,
        )

    async def tokenize(
        self, model: ServedModel, checked: CheckedRequest, expires: float
    ) -> PreparedRequest:
        """The request's token ids; a long input is tokenized on a worker thread, and its wait
        for one ends at the request's deadline (`expires`, time.monotonic()) or when the drain's
        grace is over (refused like every request still waiting then: a retry hint)."""
        chars = len(checked.prompt or "") + sum(len(c) for _, c in checked.messages)
        engine = model.backend.engine_limits
        if chars <= INLINE_CHARS:
            return tokenize(checked, model.text, model.limits, engine)
        return await self.on_worker(
            functools.partial(tokenize, checked, model.text, model.limits, engine),
            model,
            expires,
            "the prompt was still waiting to be tokenized",
        )

    async def on_worker(
        self, work_of: Callable[[], T], model: ServedModel, expires: float, waiting: str
    ) -> T:
        """`work_of()` run on a tokenizer thread, the event loop free meanwhile. The wait ends
        at `expires` (time.monotonic(): DEADLINE_EXCEEDED, saying the request was `waiting`)
        or when the drain's grace is over (refused like every request still waiting then: a
        retry hint)."""
        if self.draining:
            raise stopping()
        loop = asyncio.get_running_loop()
        if self._grace_over is None:
            self._grace_over = loop.create_future()
        work = loop.run_in_executor(self._tokenizers, work_of)
        try:
            async with asyncio.timeout_at(self._loop_time(expires)):
                await asyncio.wait((work, self._grace_over), return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise stopping()
            return work.result()
        except TimeoutError:
            raise RequestError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no complete answer from model '{model.name}' within the deadline ({waiting}); "
                "give the request a longer deadline",
            ) from None
        finally:
            # Not waited for any more: work not begun never starts; an error it ended with
            # meanwhile is not logged as never retrieved.
            if not work.cancel() and not work.cancelled():
                work.exception()
            # The future holds the error it ended with, whose traceback holds this frame: a
            # cycle that would keep the work's inputs and outputs (a refused prompt's token ids)
            # alive until a garbage collection, which then frees them on the event loop.
            del work

    def single_flight(
        self,
        model: ServedModel,
        prepared: PreparedRequest,
        shared: CacheQuery | None,
        budget: Budget,
    ) -> tuple[Flight[Event], bool]:
        """The generation this client follows: its own, or the flight for its cache key; and
        whether this client leads it.

        Deadlines differ on purpose. Alone, the client is the only one waiting, so the engine call
        carries the client's deadline and the engine stops at it. In a flight the generation is
        shared by followers whose deadlines differ, so it carries none: each follower's own
        deadline ends its own wait, and the generation is cancelled when its last follower leaves.
        """
        if shared is None:
            timeout = max(0.0, budget.expires - time.monotonic())
            return Flight(self.engine(model, prepared, timeout, budget), lambda _: None), True
        return self.flights.join(
            shared.key, lambda: self.engine(model, prepared, None, budget), self._joinable
        )

    def _joinable(self, flight: Flight[Event]) -> bool:
        """A flight whose answer an invalidation since it began covers is not followed: a
        request sent after the invalidation gets a generation of its own."""
        owner = flight.owner
        return not (
            self.cache is not None and isinstance(owner, CacheQuery) and self.cache.overtaken(owner)
        )

    async def engine(
        self,
        model: ServedModel,
        prepared: PreparedRequest,
        timeout_s: float | None,
        budget: Budget,
    ) -> AsyncIterator[Event]:
        """Admission, then the generation; the slot is held exactly as long as it runs, and the
        model's breaker learns whether the engine answered, failed, or was too slow. Once the
        breaker's time open has passed, one generation at a time probes the engine; the others
        are refused as while it was open (a fallback answers them where there is one)."""
        ticket = await self.admission.admit(
            model.name,
            len(prepared.prompt_ids),
            prepared.max_tokens,
            budget.first_token_by,
            budget.limit,
        )
        breaker = model.health.breaker
        probe = breaker.state == "half-open"

        def fault(why: str) -> None:
            """The engine failed this generation. One let through before the breaker opened
            that fails while a probe is out says nothing the probe does not: the probe decides
            (counted, it would reopen the breaker and let a second probe through)."""
            if probe or not breaker.probing:
                model.health.failed(why)
            else:
                model.health.last_failure = why

        if not breaker.allow():
            ticket.release(0)
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"model '{model.name}' is unavailable: {model.health.describe()}",
                retry_after_ms=max(UNAVAILABLE_RETRY_MS, round(breaker.retry_in() * 1000)),
            )
        yield Started(time.monotonic_ns())
        started = time.monotonic()
        first = False
        judged = False  # the breaker heard how the engine did
        completion = 0
        try:
            request = GenerationRequest(
                request_id=next(self._engine_ids),
                prompt_ids=prepared.prompt_ids,
                max_tokens=prepared.max_tokens,
                end_id=model.text.end_id,
                pad_id=model.text.pad_id,
                sampling=prepared.sampling,
                timeout_s=timeout_s,
                guide=prepared.guide,
                min_tokens=prepared.min_tokens,
                ignore_eos=prepared.ignore_eos,
                logprobs=prepared.logprobs,
                speculation=prepared.speculation,
                top_logprobs=prepared.top_logprobs,
            )
            async for event in generate(model, request, prepared.stops):
                if not first and (isinstance(event, Outcome) or event.token_ids):
                    first = judged = True
                    ticket.first_token()
                    self._first_token(model, time.monotonic() - started, budget, fault)
                if isinstance(event, Outcome):
                    completion = event.completion_tokens
                else:
                    ticket.generated(len(event.token_ids))
                yield event
        except BackendError as exc:
            if exc.code in ENGINE_FAULTS and not (
                first and exc.code == grpc.StatusCode.DEADLINE_EXCEEDED
            ):
                fault(f"{exc.code.name}: {exc.message}")
                judged = True
            raise
        except Exception as exc:
            # A backend that raised what is no BackendError (a bug of its own, against the
            # Backend contract): the engine's failure, not the client's, and told as one.
            failure = backend_bug(model, exc)
            fault(f"{failure.code.name}: {failure.message}")
            judged = True
            raise failure from exc
        except (asyncio.CancelledError, GeneratorExit):
            waited = time.monotonic() - started
            if not first and budget.engine_ttft_s is not None and waited > budget.engine_ttft_s:
                fault(f"no first token in {waited:.1f} s")
                judged = True
            raise
        finally:
            ticket.release(completion)
            if probe and not judged:
                breaker.release()

    @staticmethod
    def _first_token(
        model: ServedModel, ttft_s: float, budget: Budget, fault: Callable[[str], None]
    ) -> None:
        if budget.engine_ttft_s is not None and ttft_s > budget.engine_ttft_s:
            fault(
                f"first token after {ttft_s * 1000:.0f} ms, over the budget of "
                f"{budget.engine_ttft_s * 1000:.0f} ms"
            )
        else:
            model.health.succeeded()

    async def deliver(
        self,
        generation: Generation,
        report: RequestReport,
        received: int,
        budget: Budget,
        requested: ServedModel,
    ) -> AsyncIterator[Reply]:
        """Events as this client's replies, within its deadline; the report gets its timings.
        A generation the drain cancels ends with a final message that counts what this client was
        sent, or, when it was sent nothing yet, with a refusal it may retry elsewhere."""
        if generation.follows and not report.followed and self.cache is not None:
            report.followed = True  # once, however many flights it follows
            self.cache.metrics.single_flight_followers += 1
        started = generation.since_ns
        first = last = 0
        sent = 0
        gaps = report.inter_token_us
        events = generation.flight.follow()
        try:
            while True:
                try:
                    async with asyncio.timeout_at(self._loop_time(budget.expires)):
                        event = await anext(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise RequestError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no complete answer from model '{requested.name}' within the deadline",
                    ) from None
                if isinstance(event, Started):
                    started = max(started, event.at_ns)
                    continue
                if isinstance(event, Delta):
                    yield event
                    sent += len(event.token_ids)
                    now = time.monotonic_ns()
                    if event.token_ids:
                        if last:
                            gaps.append((now - last) // 1000)
                        last = now
                    if not first:
                        first = now
                        report.ttft_us = (now - received) // 1000
                    continue
                self._outcome(report, event)
                if generation.shared is not None and event.finish_reason in CACHED_FINISHES:
                    report.cache_entry = keyed_by(generation.shared, event.produced_by).key.hex()
                yield final_of(report, received, started, first)
        except BackendError as exc:
            if not (self.draining and exc.code == grpc.StatusCode.CANCELLED):
                raise engine_failure(exc, generation.input_field) from None
            if not first:
                raise stopping() from None
            report.finish_reason = "cancelled"
            report.prompt_tokens = generation.prompt_tokens
            report.completion_tokens = sent
            report.answered_by = generation.model.name
            yield final_of(report, received, started, first)
        finally:
            await events.aclose()
            if generation.held:
                generation.held = False
                generation.flight.release()
            if not report.finish_reason:  # no outcome (cancelled, failed, out of time)
                report.prompt_tokens = generation.prompt_tokens
                report.completion_tokens = sent

    def store(self, generation: Generation) -> None:
        """Once per flight, after the final message: a complete answer, keyed by its producer."""
        query, flight = generation.shared, generation.flight
        if query is None or self.cache is None:
            return
        if isinstance(flight.owner, CacheQuery):  # the leader's: marked before the flight began
            query = flight.owner
        if not flight.done or flight.written or not flight.events:
            return
        outcome = flight.events[-1]
        if not isinstance(outcome, Outcome) or outcome.finish_reason not in CACHED_FINISHES:
            return
        flight.written = True
        self.cache.store(keyed_by(query, outcome.produced_by), answer_of(flight.events))

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _loop_time(monotonic: float) -> float:
        """asyncio's clock for a time.monotonic() instant (the same clock by default)."""
        loop = asyncio.get_running_loop()
        return loop.time() + (monotonic - time.monotonic())

    @staticmethod
    def _cancelled_status(deadline_s: float | None, received_ns: int) -> grpc.StatusCode:
        """The status of a request whose stream was closed under it: DEADLINE_EXCEEDED when the
        client's deadline had passed (gRPC ends such a call itself), else CANCELLED."""
        elapsed_ns = time.monotonic_ns() - received_ns
        if deadline_s is not None and elapsed_ns >= deadline_s * 1e9 - DEADLINE_SLACK_NS:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED

    @staticmethod
    def _outcome(report: RequestReport, outcome: Outcome) -> None:
        report.finish_reason = outcome.finish_reason
        report.prompt_tokens = outcome.prompt_tokens
        report.completion_tokens = outcome.completion_tokens
        report.answered_by = outcome.produced_by.name
        report.draft_tokens = outcome.draft_tokens
        report.accepted_draft_tokens = outcome.accepted_draft_tokens
        report.cached_tokens = outcome.cached_tokens

    def refused(
        self, front_end: str, status: str, received_ns: int, key_id: str = "", namespace: str = ""
    ) -> None:
        """A request its front end refused before the pipeline could read it still counts in the
        metrics and the access log (with the key id it claimed and the namespace it named, where
        the front end read them)."""
        report = RequestReport(
            front_end=front_end,
            status=status,
            key_id=key_id,
            namespace=namespace[:MAX_NAMESPACE],
        )
        report.total_us = (time.monotonic_ns() - received_ns) // 1000
        self.sink.report(report)

    def end_generations(self) -> None:
        """The drain's grace is over: requests waiting for a tokenizer thread or for the engine
        are refused (before any text, with a retry hint), none starts from now on, and every
        generation under way is cancelled: its clients get a final message counting what they
        were sent."""
        self.draining = True
        if self._grace_over is not None and not self._grace_over.done():
            self._grace_over.set_result(None)
        self.admission.close(STOPPING, UNAVAILABLE_RETRY_MS)
        for model in self.models.values():
            model.backend.cancel_all()

    def close(self) -> None:
        self._tokenizers.shutdown(wait=False, cancel_futures=True)
