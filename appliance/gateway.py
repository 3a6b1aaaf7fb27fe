"""The gateway: the public gRPC API in front of the inference server.

Request path, top to bottom (InferenceService._answer): find the model → check the request and
normalize its text (request.check) → if the answer is deterministic, build the cache key and look in
L1 then L2 (cache/) → on a miss tokenize (request.tokenize) and join or start the single flight for
the key → the flight streams token ids from the Triton-protocol backend (triton_backend.py),
detokenizes incrementally (detokenize.py) and cuts at stop strings (stopstrings.py) → every follower
gets the deltas live, then one final message with finish reason, usage, timings and the cache tier →
after the final message has gone out, a complete answer is written back to the cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from appliance import sdnotify
from appliance.cache.entry import CachedAnswer
from appliance.cache.keys import ModelIdentity, cache_key, is_deterministic
from appliance.cache.l1 import LruCache
from appliance.cache.l2 import RedisTier
from appliance.cache.metrics import CacheMetrics
from appliance.cache.singleflight import SingleFlight
from appliance.cache.tiers import ResponseCache
from appliance.config import CacheConfig, GatewayConfig, ModelConfig
from appliance.detokenize import IncrementalDecoder
from appliance.request import (
    CheckedRequest,
    Limits,
    PreparedRequest,
    RequestError,
    Sampling,
    check,
    tokenize,
)
from appliance.stopstrings import StopMatcher
from appliance.tokenizer import ModelText, TokenizerLoadError
from appliance.triton_backend import BackendError, TritonBackend
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheAdmin"].full_name
CACHEABLE_FINISH = (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


class StartupError(Exception):
    """The gateway cannot start; the message is the one line an operator reads."""


@dataclass
class ServedModel:
    name: str
    text: ModelText
    limits: Limits
    backend: TritonBackend
    identity: ModelIdentity


@dataclass(slots=True)
class Delta:
    """New text and the token ids it came from."""

    text: str
    token_ids: list[int]


@dataclass(slots=True)
class Outcome:
    """How a generation ended; the last event of every stream."""

    finish_reason: pb.FinishReason
    prompt_tokens: int
    completion_tokens: int


Event = Delta | Outcome


class InferenceService(pb_grpc.InferenceServicer):  # type: ignore[misc]
    def __init__(self, models: dict[str, ServedModel], cache: ResponseCache | None) -> None:
        self._models = models
        self.cache = cache
        self._flights: SingleFlight[Event] = SingleFlight()
        self._active = 0
        # Engine-side request ids are the gateway's own: a client's request_id is not unique across
        # clients, and `stop=true` with a shared id would cancel another client's generation.
        self._backend_ids = (f"gw{os.getpid()}-{n}" for n in itertools.count())
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        received = time.monotonic_ns()
        self._active += 1
        self._idle.clear()
        try:
            async for message in self._answer(request, context, received):
                yield message
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def Complete(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompleteResponse:
        text: list[str] = []
        ids: list[int] = []
        reply = pb.CompleteResponse()
        async for message in self.Generate(request, context):
            text.append(message.text)
            ids.extend(message.token_ids)
            reply.request_id = message.request_id
            if message.HasField("final"):
                reply.final.CopyFrom(message.final)
        reply.text = "".join(text)
        reply.token_ids.extend(ids)
        return reply

    async def _answer(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, received: int
    ) -> AsyncIterator[pb.GenerateResponse]:
        model = self._models.get(request.model)
        if model is None:
            known = ", ".join(sorted(self._models))
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}; known models: {known}"
            )
        assert model is not None
        try:
            checked = check(request, model.limits)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        policy = checked.cache_policy
        key = self._cache_key(model, checked)
        if key is None and policy == pb.CACHE_POLICY_ONLY:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "cache_policy ONLY needs a cacheable request: temperature 0 or a seed, and a "
                "gateway with the cache enabled",
            )
        if key is not None and policy in (pb.CACHE_POLICY_DEFAULT, pb.CACHE_POLICY_ONLY):
            assert self.cache is not None
            hit = await self.cache.lookup(checked.namespace, model.name, key)
            if hit is not None:
                for message in _replay(checked.request_id, hit[0], hit[1], received):
                    yield message
                return
            if policy == pb.CACHE_POLICY_ONLY:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    "no cached answer for this request (cache_policy ONLY)",
                )
        try:
            prepared = tokenize(checked, model.text, model.limits)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

        if key is None:
            events = self._generate(model, prepared, context.time_remaining())
            async for message in self._deliver(events, checked.request_id, received, context):
                yield message
            return
        flight, led = self._flights.join(key, lambda: self._generate(model, prepared, None))
        if not led and self.cache is not None:
            self.cache.metrics.single_flight_followers += 1
        async for message in self._deliver(flight.follow(), checked.request_id, received, context):
            yield message
        # The final message is out: now, and once per flight, write a complete answer back.
        outcome = flight.events[-1] if flight.done and flight.events else None
        complete = isinstance(outcome, Outcome) and outcome.finish_reason in CACHEABLE_FINISH
        if complete and not flight.written and self.cache is not None:
            flight.written = True
            self.cache.store(checked.namespace, model.name, key, _answer_of(flight.events))

    def _cache_key(self, model: ServedModel, checked: CheckedRequest) -> bytes | None:
        if self.cache is None or checked.cache_policy == pb.CACHE_POLICY_BYPASS:
            return None
        sampling = checked.sampling_key()
        if not is_deterministic(sampling):
            self.cache.metrics.not_cacheable += 1
            return None
        return cache_key(
            checked.namespace, model.identity, checked.prompt, checked.messages, sampling
        )

    async def _deliver(
        self,
        events: AsyncIterator[Event],
        request_id: str,
        received: int,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Events of a generation as this client's messages, with this client's timings."""
        started = time.monotonic_ns()
        first_sent = 0
        try:
            async for event in events:
                if isinstance(event, Delta):
                    yield pb.GenerateResponse(
                        request_id=request_id, text=event.text, token_ids=event.token_ids
                    )
                    if not first_sent:
                        first_sent = time.monotonic_ns()
                    continue
                yield _final(request_id, event, received, started, first_sent, pb.CACHE_TIER_MISS)
        except BackendError as exc:
            if not (self.draining and exc.code == grpc.StatusCode.CANCELLED):
                log.warning("request %s failed: %s", request_id, exc.message)
                await context.abort(exc.code, exc.message)
            ended = Outcome(pb.FINISH_REASON_CANCELLED, 0, 0)
            yield _final(request_id, ended, received, started, first_sent, pb.CACHE_TIER_MISS)

    async def _generate(
        self, model: ServedModel, p: PreparedRequest, timeout: float | None
    ) -> AsyncIterator[Event]:
        """One generation on the engine: text deltas as they decode, then the Outcome."""
        decoder = IncrementalDecoder(model.text.table)
        stops = StopMatcher(p.stops)
        end_id = model.text.end_id
        completion = 0
        ended_by_stop = False
        tokens_stream = model.backend.stream(
            next(self._backend_ids),
            p.prompt_ids,
            p.max_tokens,
            end_id,
            model.text.pad_id,
            p.sampling,
            timeout,
        )
        try:
            async for tokens in tokens_stream:
                if end_id is not None and end_id in tokens:
                    tokens = tokens[: tokens.index(end_id)]
                    ended_by_stop = True
                completion += len(tokens)
                text = stops.feed("".join([decoder.push(t) for t in tokens]))
                if text or tokens:
                    yield Delta(text, tokens)
                if stops.stopped or ended_by_stop:
                    ended_by_stop = True
                    break
        finally:
            await tokens_stream.aclose()
        tail = "" if stops.stopped else stops.feed(decoder.flush()) + stops.flush()
        if tail:
            yield Delta(tail, [])
        stopped = ended_by_stop or completion < p.max_tokens
        finish = pb.FINISH_REASON_STOP if stopped else pb.FINISH_REASON_LENGTH
        yield Outcome(finish, len(p.prompt_ids), completion)

    async def wait_idle(self) -> None:
        await self._idle.wait()


def _final(
    request_id: str,
    outcome: Outcome,
    received: int,
    started: int,
    first_sent: int,
    tier: pb.CacheTier,
) -> pb.GenerateResponse:
    done = time.monotonic_ns()
    return pb.GenerateResponse(
        request_id=request_id,
        final=pb.Final(
            finish_reason=outcome.finish_reason,
            usage=pb.Usage(
                prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens
            ),
            timings=pb.Timings(
                queue_us=(started - received) // 1000,
                ttft_us=((first_sent or done) - received) // 1000,
                total_us=(done - received) // 1000,
            ),
            cache_tier=tier,
        ),
    )


def _replay(
    request_id: str, answer: CachedAnswer, tier: pb.CacheTier, received: int
) -> list[pb.GenerateResponse]:
    """A cached answer in the shape of a generated one: a delta, then the final message."""
    started = time.monotonic_ns()
    delta = pb.GenerateResponse(request_id=request_id, text=answer.text, token_ids=answer.token_ids)
    first_sent = time.monotonic_ns()
    finish = cast(pb.FinishReason, answer.finish_reason)
    outcome = Outcome(finish, answer.prompt_tokens, answer.completion_tokens)
    return [delta, _final(request_id, outcome, received, started, first_sent, tier)]


def _answer_of(events: list[Event]) -> CachedAnswer:
    outcome = events[-1]
    assert isinstance(outcome, Outcome)
    deltas = [e for e in events if isinstance(e, Delta)]
    return CachedAnswer(
        text="".join(d.text for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        finish_reason=outcome.finish_reason,
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens,
    )


class CacheAdminService(pb_grpc.CacheAdminServicer):  # type: ignore[misc]
    def __init__(self, cache: ResponseCache | None) -> None:
        self._cache = cache

    async def Invalidate(
        self, request: pb.InvalidateRequest, context: grpc.aio.ServicerContext
    ) -> pb.InvalidateResponse:
        if self._cache is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the cache is disabled")
        assert self._cache is not None
        if not (request.namespace or request.model or request.all):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "name a namespace, a model or both; set all=true to drop every cached answer",
            )
        try:
            l1, l2 = await self._cache.invalidate(request.namespace, request.model)
        except Exception as exc:  # Redis down: say so, L1 was still dropped
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"redis invalidation failed: {exc}")
        return pb.InvalidateResponse(l1_removed=l1, l2_removed=l2)

    async def Stats(
        self, request: pb.CacheStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.CacheStatsResponse:
        counters = self._cache.counters() if self._cache is not None else {}
        return pb.CacheStatsResponse(counters=counters)


def _file_digest(*paths: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for path in paths:
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _identity(cfg: ModelConfig, text: ModelText, need_fingerprint: bool) -> ModelIdentity:
    engine = ""
    if need_fingerprint:
        try:
            engine = cfg.fingerprint_path.read_text().strip()
        except OSError as exc:
            raise StartupError(
                f"model '{cfg.name}': engine fingerprint {cfg.fingerprint_path} unreadable "
                f"({exc.strerror}); cache keys need it so a rebuilt engine never serves old "
                "answers (set fingerprint_file, or [cache] enabled = false)"
            ) from exc
        if not engine:
            raise StartupError(
                f"model '{cfg.name}': engine fingerprint {cfg.fingerprint_path} is empty"
            )
    return ModelIdentity(
        name=cfg.name,
        engine_fingerprint=engine,
        tokenizer_fingerprint=_file_digest(
            cfg.tokenizer_dir / "tokenizer.json", cfg.tokenizer_dir / "tokenizer_config.json"
        ),
        template_version=text.template_version,
    )


def make_cache(config: CacheConfig) -> ResponseCache | None:
    if not config.enabled:
        return None
    metrics = CacheMetrics()
    l1 = LruCache(config.l1_max_entries, config.l1_max_bytes, config.l1_ttl_s)
    l2 = RedisTier(config.redis, metrics) if config.redis is not None else None
    return ResponseCache(l1, l2, metrics)


def _limits(cfg: ModelConfig, text: ModelText) -> Limits:
    context = text.context_length or (cfg.max_input_tokens or 0) + cfg.max_output_tokens
    max_input = cfg.max_input_tokens or max(1, context - 1)
    if max_input >= context:
        raise StartupError(
            f"model '{cfg.name}': max_input_tokens {max_input} must be below the model's "
            f"context of {context} tokens"
        )
    return Limits(
        max_input_tokens=max_input,
        max_output_tokens=cfg.max_output_tokens,
        default_max_tokens=cfg.default_max_tokens,
        context_length=context,
    )


async def load_models(config: GatewayConfig) -> dict[str, ServedModel]:
    """Loads every tokenizer and waits for every backend; StartupError says which failed and why."""
    models: dict[str, ServedModel] = {}
    try:
        for name, cfg in config.models.items():
            try:
                text = ModelText.load(cfg.tokenizer_dir)
            except (TokenizerLoadError, ValueError) as exc:
                raise StartupError(f"model '{name}': {exc}") from exc
            identity = _identity(cfg, text, need_fingerprint=config.cache.enabled)
            backend = TritonBackend(cfg.backend, cfg.triton_model)
            models[name] = ServedModel(name, text, _limits(cfg, text), backend, identity)
            try:
                await backend.wait_ready(cfg.ready_timeout_s)
            except BackendError as exc:
                raise StartupError(f"model '{name}': {exc.message}") from exc
    except BaseException:
        for m in models.values():
            await m.backend.close()
        raise
    return models


@dataclass
class RunningGateway:
    server: grpc.aio.Server
    service: InferenceService
    health: health.aio.HealthServicer
    models: dict[str, ServedModel]
    port: int

    async def drain(self, drain_seconds: float) -> None:
        """Stops taking requests, lets in-flight ones finish, then ends the rest as CANCELLED."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        stopping = asyncio.ensure_future(self.server.stop(grace=drain_seconds + 2.0))
        try:
            await asyncio.wait_for(self.service.wait_idle(), timeout=drain_seconds)
        except TimeoutError:
            self.service.draining = True
            for m in self.models.values():
                m.backend.cancel_all()
        await stopping
        for m in self.models.values():
            await m.backend.close()
        if self.service.cache is not None:
            await self.service.cache.close()


async def start_server(config: GatewayConfig, models: dict[str, ServedModel]) -> RunningGateway:
    server = grpc.aio.server()
    cache = make_cache(config.cache)
    service = InferenceService(models, cache)
    pb_grpc.add_InferenceServicer_to_server(service, server)
    pb_grpc.add_CacheAdminServicer_to_server(CacheAdminService(cache), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            ADMIN_SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    try:
        port = server.add_insecure_port(config.server.listen)
    except RuntimeError as exc:
        raise StartupError(f"cannot listen on {config.server.listen}: {exc}") from exc
    if port == 0:
        raise StartupError(f"cannot listen on {config.server.listen}: address in use or invalid")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningGateway(server, service, health_servicer, models, port)


async def warm_up(models: dict[str, ServedModel]) -> None:
    """One token through each model before READY=1, so the first client does not pay for cold
    paths (connection set-up, engine graph capture); StartupError if a model cannot answer."""
    for model in models.values():
        prompt = model.text.encode_prompt("warm-up")
        greedy = Sampling(temperature=1.0, top_k=1, top_p=1.0, seed=None)
        stream = model.backend.stream(f"warm-up-{os.getpid()}", prompt, 1, None, None, greedy, 30.0)
        try:
            async for _ in stream:
                pass
        except BackendError as exc:
            raise StartupError(
                f"model '{model.name}': warm-up request failed: {exc.message}"
            ) from exc
        finally:
            await stream.aclose()


async def serve(config: GatewayConfig) -> int:
    """Runs the gateway until SIGTERM or SIGINT. Returns the process exit status."""
    try:
        models = await load_models(config)
        await warm_up(models)
        running = await start_server(config, models)
    except StartupError as exc:
        print(f"appliance serve: {exc}", file=sys.stderr, flush=True)
        return 2
    log.info("gateway listening on %s, models: %s", config.server.listen, ", ".join(models))
    await sdnotify.ready_until_signalled(f"serving {', '.join(models)} on {config.server.listen}")
    log.info("draining for up to %.1f s", config.server.drain_seconds)
    await running.drain(config.server.drain_seconds)
    return 0
