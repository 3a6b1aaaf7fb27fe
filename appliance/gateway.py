"""The gateway: the public gRPC API in front of the inference server.

Request path, top to bottom: find the model → validate and tokenize (request.py) → stream token ids
from the Triton-protocol backend (triton_backend.py) → detokenize incrementally (detokenize.py) → hold
back and cut at stop strings (stopstrings.py) → send deltas → one final message with finish reason,
usage, timings and the cache tier.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from appliance.config import GatewayConfig, ModelConfig
from appliance.detokenize import IncrementalDecoder
from appliance.request import Limits, PreparedRequest, RequestError, prepare
from appliance.stopstrings import StopMatcher
from appliance.tokenizer import ModelText, TokenizerLoadError
from appliance.triton_backend import BackendError, TritonBackend
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name


class StartupError(Exception):
    """The gateway cannot start; the message is the one line an operator reads."""


@dataclass
class ServedModel:
    name: str
    text: ModelText
    limits: Limits
    backend: TritonBackend


class InferenceService(pb_grpc.InferenceServicer):  # type: ignore[misc]
    def __init__(self, models: dict[str, ServedModel]) -> None:
        self._models = models
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
        model, prepared = await self._admit(request, context)
        async for message in self._generate(model, prepared, context, received):
            yield message

    async def Complete(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompleteResponse:
        received = time.monotonic_ns()
        model, prepared = await self._admit(request, context)
        text: list[str] = []
        ids: list[int] = []
        final = pb.Final()
        async for message in self._generate(model, prepared, context, received):
            text.append(message.text)
            ids.extend(message.token_ids)
            if message.HasField("final"):
                final = message.final
        return pb.CompleteResponse(
            request_id=prepared.request_id, text="".join(text), token_ids=ids, final=final
        )

    async def _admit(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[ServedModel, PreparedRequest]:
        model = self._models.get(request.model)
        if model is None:
            known = ", ".join(sorted(self._models))
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}; known models: {known}"
            )
        assert model is not None
        try:
            return model, prepare(request, model.text, model.limits)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        raise AssertionError("unreachable")

    async def _generate(
        self,
        model: ServedModel,
        p: PreparedRequest,
        context: grpc.aio.ServicerContext,
        received: int,
    ) -> AsyncIterator[pb.GenerateResponse]:
        self._active += 1
        self._idle.clear()
        try:
            async for message in self._stream(model, p, context, received):
                yield message
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def _stream(
        self,
        model: ServedModel,
        p: PreparedRequest,
        context: grpc.aio.ServicerContext,
        received: int,
    ) -> AsyncIterator[pb.GenerateResponse]:
        decoder = IncrementalDecoder(model.text.table)
        stops = StopMatcher(p.stops)
        end_id = model.text.end_id
        completion = 0
        ended_by_stop = False
        finish = pb.FINISH_REASON_UNSPECIFIED
        first_sent = 0
        sent_at = time.monotonic_ns()
        tokens_stream = model.backend.stream(
            next(self._backend_ids),
            p.prompt_ids,
            p.max_tokens,
            end_id,
            model.text.pad_id,
            p.sampling,
            context.time_remaining(),
        )
        try:
            async for tokens in tokens_stream:
                if end_id is not None and end_id in tokens:
                    tokens = tokens[: tokens.index(end_id)]
                    ended_by_stop = True
                completion += len(tokens)
                text = stops.feed("".join([decoder.push(t) for t in tokens]))
                if stops.stopped or ended_by_stop:
                    ended_by_stop = True
                    if text or tokens:
                        yield pb.GenerateResponse(
                            request_id=p.request_id, text=text, token_ids=tokens
                        )
                    break
                yield pb.GenerateResponse(request_id=p.request_id, text=text, token_ids=tokens)
                if not first_sent:
                    first_sent = time.monotonic_ns()
        except BackendError as exc:
            if not (self.draining and exc.code == grpc.StatusCode.CANCELLED):
                log.warning("request %s failed: %s", p.request_id, exc.message)
                await context.abort(exc.code, exc.message)
            finish = pb.FINISH_REASON_CANCELLED
        finally:
            await tokens_stream.aclose()

        tail = "" if stops.stopped else stops.feed(decoder.flush()) + stops.flush()
        if finish != pb.FINISH_REASON_CANCELLED:
            stopped = ended_by_stop or stops.stopped or completion < p.max_tokens
            finish = pb.FINISH_REASON_STOP if stopped else pb.FINISH_REASON_LENGTH
        done = time.monotonic_ns()
        yield pb.GenerateResponse(
            request_id=p.request_id,
            text=tail,
            final=pb.Final(
                finish_reason=finish,
                usage=pb.Usage(prompt_tokens=len(p.prompt_ids), completion_tokens=completion),
                timings=pb.Timings(
                    queue_us=(sent_at - received) // 1000,
                    ttft_us=((first_sent or done) - received) // 1000,
                    total_us=(done - received) // 1000,
                ),
                cache_tier=pb.CACHE_TIER_MISS,
            ),
        )

    async def wait_idle(self) -> None:
        await self._idle.wait()


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
            limits = _limits(cfg, text)
            backend = TritonBackend(cfg.backend, cfg.triton_model)
            models[name] = ServedModel(name, text, limits, backend)
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
        await drain(self.server, self.service, self.health, self.models, drain_seconds)


async def start_server(config: GatewayConfig, models: dict[str, ServedModel]) -> RunningGateway:
    server = grpc.aio.server()
    service = InferenceService(models)
    pb_grpc.add_InferenceServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
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


async def drain(
    server: grpc.aio.Server,
    service: InferenceService,
    health_servicer: health.aio.HealthServicer,
    models: dict[str, ServedModel],
    drain_seconds: float,
) -> None:
    """Stops taking requests, lets in-flight ones finish, then ends the rest with CANCELLED."""
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    stopping = asyncio.ensure_future(server.stop(grace=drain_seconds + 2.0))
    try:
        await asyncio.wait_for(service.wait_idle(), timeout=drain_seconds)
    except TimeoutError:
        service.draining = True
        for m in models.values():
            m.backend.cancel_all()
    await stopping
    for m in models.values():
        await m.backend.close()


async def serve(config: GatewayConfig) -> int:
    """Runs the gateway until SIGTERM or SIGINT. Returns the process exit status."""
    try:
        models = await load_models(config)
        running = await start_server(config, models)
    except StartupError as exc:
        print(f"appliance serve: {exc}", file=sys.stderr, flush=True)
        return 2
    log.info("gateway listening on %s, models: %s", config.server.listen, ", ".join(models))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining for up to %.1f s", config.server.drain_seconds)
    await running.drain(config.server.drain_seconds)
    return 0
