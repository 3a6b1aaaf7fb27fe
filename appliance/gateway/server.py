"""The gateway process: composition of its parts, start-up, serving until a signal, draining."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from appliance import sdnotify
from appliance.admission import GatedAdmission, ModelGate
from appliance.backends.base import GREEDY, BackendError, GenerationRequest
from appliance.cache.l1 import LruCache
from appliance.cache.l2 import RedisTier
from appliance.cache.metrics import CacheMetrics
from appliance.cache.semantic import make_semantic_tier
from appliance.cache.tiers import CacheTier, L1Tier, TierCascade
from appliance.config import CacheConfig, GatewayConfig
from appliance.gateway.health import HealthMonitor
from appliance.gateway.models import ServedModel, StartupError, load_models
from appliance.gateway.pipeline import Pipeline
from appliance.gateway.report import DebugLogSink, ReportSink
from appliance.gateway.service import CacheAdminService, InferenceService
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheAdmin"].full_name


def make_cache(config: CacheConfig) -> TierCascade | None:
    if not config.enabled:
        return None
    metrics = CacheMetrics()
    tiers: list[CacheTier] = [
        L1Tier(LruCache(config.l1_max_entries, config.l1_max_bytes, config.l1_ttl_s))
    ]
    l2 = RedisTier(config.redis, metrics) if config.redis is not None else None
    if l2 is not None:
        tiers.append(l2)
    if config.semantic.enabled:
        semantic = make_semantic_tier(config.semantic, l2)
        if semantic is not None:
            tiers.append(semantic)
    return TierCascade(tiers, metrics)


def make_admission(config: GatewayConfig, models: dict[str, ServedModel]) -> GatedAdmission:
    """A gate per model: as many slots as the engine runs at full speed, unless configured."""
    return GatedAdmission(
        {
            name: ModelGate(
                name,
                slots=config.models[name].max_in_flight or model.backend.max_batch_size,
                max_queue=config.models[name].max_queue,
            )
            for name, model in models.items()
        }
    )


@dataclass
class RunningGateway:
    server: grpc.aio.Server
    service: InferenceService
    health: health.aio.HealthServicer
    monitor: HealthMonitor
    models: dict[str, ServedModel]
    port: int

    @property
    def pipeline(self) -> Pipeline:
        return self.service.pipeline

    async def drain(self, drain_seconds: float) -> None:
        """Stops taking requests, lets in-flight ones finish, then ends the rest as CANCELLED."""
        await self.monitor.stop()
        await self.health.enter_graceful_shutdown()
        stopping = asyncio.ensure_future(self.server.stop(grace=drain_seconds + 2.0))
        try:
            await asyncio.wait_for(self.service.wait_idle(), timeout=drain_seconds)
        except TimeoutError:
            self.pipeline.draining = True
            for m in self.models.values():
                m.backend.cancel_all()
        await stopping
        for m in self.models.values():
            await m.backend.close()
        if self.pipeline.cache is not None:
            await self.pipeline.cache.close()
        self.pipeline.close()


async def start_server(
    config: GatewayConfig, models: dict[str, ServedModel], sink: ReportSink | None = None
) -> RunningGateway:
    server = grpc.aio.server()
    cache = make_cache(config.cache)
    admission = make_admission(config, models)
    service = InferenceService(Pipeline(models, cache, admission, sink or DebugLogSink()))
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
    monitor = HealthMonitor(health_servicer, SERVICE_NAME, models)
    await monitor.publish()
    monitor.start()
    if cache is not None:
        await cache.check()
    return RunningGateway(server, service, health_servicer, monitor, models, port)


async def warm_up(models: dict[str, ServedModel]) -> None:
    """One token through each model before READY=1, so the first client does not pay for cold
    paths (connection set-up, engine graph capture); StartupError if a model cannot answer."""
    for model in models.values():
        request = GenerationRequest(
            request_id=f"warm-up-{os.getpid()}",
            prompt_ids=model.text.encode_prompt("warm-up"),
            max_tokens=1,
            end_id=None,
            pad_id=None,
            sampling=GREEDY,
            timeout_s=30.0,
        )
        stream = model.backend.stream(request)
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
