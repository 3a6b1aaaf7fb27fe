"""The gateway process: composition of its parts, start-up, serving until a signal, draining.

What a client without a key can make the gateway hold on the gRPC port: gRPC's core announces a
stream window of the 4 MiB receive limit, so each open call may hold up to that much of what its
client sent, read or not, for as long as it stays open. When keys are configured, every call of
the appliance's own services and of server reflection is gated (grpc_methods.add_service): a call
without a valid key is answered UNAUTHENTICATED from its metadata alone and its stream closed
before its message is read, so what it sent is dropped at once. Health stays open to
probes without a key: a Check or Watch whose message has not arrived within `HEALTH_READ_S` ends
DEADLINE_EXCEEDED, and a Watch, once its message is read, stays open and its stream still takes up
to 4 MiB of further messages that nothing reads: at most health.MAX_WATCHES_PER_CONNECTION of them
per connection. Such a client thus holds up to 16 MiB per connection for as long as it likes, and
up to `MAX_STREAMS_PER_CONNECTION` × 4 MiB (400 MiB) per connection only while it keeps sending
(docs/OPERATIONS.md, "Memory: what a client can make the gateway hold").
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from appliance import logline, sdnotify
from appliance.backends.base import GREEDY, BackendError, GenerationRequest
from appliance.cache.invalidation_feed import InvalidationFeed
from appliance.cache.metrics import CacheMetrics
from appliance.cache.semantic import SemanticTier
from appliance.cache.tiers import CacheTier, L1Tier, TierCascade, TierContext, tier_class
from appliance.config import CacheConfig, GatewayConfig
from appliance.gateway import grpc_methods
from appliance.gateway.admission import GatedAdmission, ModelGate
from appliance.gateway.health import HealthMonitor, WatchBoundedHealth
from appliance.gateway.http_api import HttpApi
from appliance.gateway.metrics import GatewayMetrics, MetricsSink
from appliance.gateway.models import ServedModel, StartupError, load_models
from appliance.gateway.pipeline import Pipeline
from appliance.gateway.quiesce import quiesce
from appliance.gateway.report import AccessLog, ReportSink, Sinks
from appliance.gateway.service import CacheAdminService, InferenceService, key_gate
from appliance.grpc_limits import RECEIVE_LIMIT
from appliance.heap import freeze_heap
from appliance.listen import first_taken, serving_problem
from appliance.security.api_keys import KeyRing, KeysFileError
from appliance.security.auth import AccessControl
from appliance.security.tls import ServerTls, TlsError
from appliance.text.tokenizer import tokenize_on_calling_thread
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
# After the drain's grace, the time the cancelled streams' final messages get before the front ends
# cut what is left.
FINAL_MESSAGE_S = 2.0
# Calls at once on one gRPC connection; a client's calls past it wait on the client for a stream
# (a raw client's are reset). Above what one key may run at once by default
# (`[auth] max_streams` 32) and `appliance bench`'s concurrency 64 over its one channel, so bench
# sees the gateway's own RESOURCE_EXHAUSTED before this limit. It also bounds what one connection
# makes the gateway hold: each open stream may hold up to MAX_REQUEST_BYTES of what its client
# sent (the module's docstring says which streams a client without a key keeps open).
MAX_STREAMS_PER_CONNECTION = 100
# How long a health Check or Watch waits for its request message (sent with the call's headers
# by every client; the probes' own timeouts are shorter).
HEALTH_READ_S = 2.0
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheAdmin"].full_name


def make_cache(config: CacheConfig) -> TierCascade | None:
    """The configured tiers in their order (a tier whose `build` says it is off is left out), L1's
    invalidation feed with Redis; StartupError when a tier's counters and declarations differ."""
    if not config.enabled:
        return None
    metrics = CacheMetrics()
    tiers: list[CacheTier] = []
    for spec in config.order:
        tier = tier_class(spec).build(TierContext(config, metrics, tuple(tiers)))
        if tier is not None:
            tiers.append(tier)
    l1 = next((tier for tier in tiers if isinstance(tier, L1Tier)), None)
    feed = None
    if l1 is not None and config.redis is not None:
        feed = InvalidationFeed(config.redis, l1.lru.invalidate)
    cascade = TierCascade(tiers, metrics, feed)
    try:
        cascade.describe()
    except ValueError as exc:
        raise StartupError(str(exc), exit_status=2) from None
    return cascade


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
    metrics: GatewayMetrics
    # Port of the /metrics listener (0: none).
    metrics_port: int = 0
    # The OpenAI-compatible HTTP API (None: not configured).
    http: HttpApi | None = None
    # The health service alone on `[server] health_socket` (None: not configured).
    health_socket: grpc.aio.Server | None = None
    access: AccessControl | None = None
    tls: ServerTls | None = None

    def reload(self) -> None:
        """SIGHUP: re-reads the keys file (a file that cannot be used leaves the keys in use) and
        the TLS files (which are also picked up on their own at the next handshake)."""
        if self.access is not None and self.access.keys is not None:
            try:
                count = self.access.keys.reload()
                log.info("keys file %s reloaded: %d keys", self.access.keys.path, count)
            except KeysFileError as exc:
                log.error("keys file not reloaded, the keys in use stay: %s", exc)
        if self.tls is not None:
            self.tls.refresh()

    @property
    def pipeline(self) -> Pipeline:
        return self.service.pipeline

    async def drain(self, drain_seconds: float) -> None:
        """Stops taking requests and lets those accepted finish for up to `drain_seconds`; then
        refuses those still waiting for the engine (they were sent nothing: a retry hint) and
        cancels the generations under way, whose streams end with a final message counting what
        they were sent. The front ends' own grace is longer by `FINAL_MESSAGE_S`, the time those
        last messages get to go out."""
        await self.monitor.stop()
        await self.health.enter_graceful_shutdown()
        stopping = asyncio.ensure_future(self.server.stop(grace=drain_seconds + FINAL_MESSAGE_S))
        http = self.http
        http_stopping = (
            asyncio.ensure_future(http.close(drain_seconds + FINAL_MESSAGE_S)) if http else None
        )
        idle = [self.service.wait_idle(), *([http.wait_idle()] if http else [])]
        try:
            await asyncio.wait_for(asyncio.gather(*idle), timeout=drain_seconds)
        except TimeoutError:
            log.info("drain grace over: ending the requests still running")
            self.pipeline.end_generations()
        await stopping
        if http_stopping is not None:
            await http_stopping
        if self.health_socket is not None:
            await self.health_socket.stop(grace=None)
        for m in self.models.values():
            await m.backend.close()
        if self.pipeline.cache is not None:
            await self.pipeline.cache.close()
        self.pipeline.close()
        self.metrics.close()


def make_access_control(config: GatewayConfig) -> AccessControl:
    """The keys of `[auth] keys_file` (none: every request is anonymous, allowed on loopback)."""
    auth = config.auth
    if auth.keys_file is None:
        return AccessControl()
    try:
        return AccessControl(KeyRing(auth.keys_file, auth.pepper, auth.limits))
    except KeysFileError as exc:
        raise StartupError(str(exc), exit_status=2) from None


def listen(server: grpc.aio.Server, config: GatewayConfig) -> tuple[int, ServerTls | None]:
    """Binds the public port: TLS when `[tls]` is configured, else plaintext (the configuration
    allows that on loopback only, unless `allow_plaintext`)."""
    address = config.server.listen
    tls = None
    try:
        if config.tls is not None:
            tls = ServerTls(config.tls)
            port = server.add_secure_port(address, tls.grpc_credentials())
        else:
            port = server.add_insecure_port(address)
    except TlsError as exc:
        raise StartupError(str(exc), exit_status=2) from None
    except RuntimeError as exc:
        raise StartupError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise StartupError(f"cannot listen on {address}: address in use or invalid")
    return port, tls


def refuse_taken_addresses(config: GatewayConfig) -> None:
    """StartupError naming the first of the gateway's listen addresses (gRPC, metrics, HTTP)
    that another process holds, does not resolve or is not this host's."""
    if (
        taken := first_taken(config.server.listen, config.metrics.listen, config.http.listen)
    ) is not None:
        raise StartupError(taken)
    socket = config.server.health_socket
    if socket is not None and (problem := serving_problem(socket)) is not None:
        raise StartupError(f"cannot serve health on {socket}: {problem}")


async def serve_health_socket(path: Path, servicer: health.aio.HealthServicer) -> grpc.aio.Server:
    """The health service alone on a Unix socket, plaintext: who may ask is the socket file's
    permission (the process umask; gRPC replaces a dead server's socket and removes its own at
    stop)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), RECEIVE_LIMIT])
    grpc_methods.add_service(
        health_pb2_grpc.add_HealthServicer_to_server, servicer, server, read_s=HEALTH_READ_S
    )
    try:
        server.add_insecure_port(f"unix:{path}")
    except RuntimeError as exc:
        raise StartupError(f"cannot serve health on {path}: {exc}") from exc
    await server.start()
    return server


async def start_server(
    config: GatewayConfig, models: dict[str, ServedModel], sink: ReportSink | None = None
) -> RunningGateway:
    refuse_taken_addresses(config)
    access = make_access_control(config)
    mutual = config.tls is not None and config.tls.client_ca_file is not None
    # Without this gRPC sets SO_REUSEPORT: a second gateway on the same port would start and
    # silently take half of the connections.
    # A TLS handshake that does not finish within the client timeout is dropped (gRPC's own
    # default is 120 s).
    handshake_ms = int(config.http.client_timeout_s * 1000)
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.server_handshake_timeout_ms", handshake_ms),
            RECEIVE_LIMIT,
            # One connection more than this is closed as it is accepted.
            ("grpc.max_allowed_incoming_connections", config.server.max_connections),
            # A connection with no call for this long gets GOAWAY (gRPC's default: never).
            ("grpc.max_connection_idle_ms", int(config.server.idle_connection_s * 1000)),
            # With no limit (gRPC's default), one connection that opens and resets streams
            # without pause (HTTP/2 rapid reset) fills the server's queue of calls not yet
            # taken, and the calls of every other connection end CANCELLED; with a limit, gRPC
            # pushes the resets back and the others are answered.
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ]
    )
    cache = make_cache(config.cache)
    admission = make_admission(config, models)
    metrics = GatewayMetrics()
    sinks: list[ReportSink] = [MetricsSink(metrics)]
    if config.server.access_log:
        sinks.append(AccessLog())
    if sink is not None:
        sinks.append(sink)
    pipeline = Pipeline(models, cache, admission, Sinks(*sinks), access)
    metrics.watch(models, admission, cache, pipeline.in_flight)
    service = InferenceService(pipeline, mutual)
    admin = CacheAdminService(cache, access, mutual)
    # Without keys every call is anonymous (allowed on loopback only): nothing to check before a
    # message is read, and the methods keep grpc's unary handling, a few µs a call cheaper.
    keyed = access.required
    grpc_methods.add_service(
        pb_grpc.add_InferenceServicer_to_server,
        service,
        server,
        gate=service.before_read if keyed else None,
    )
    grpc_methods.add_service(
        pb_grpc.add_CacheAdminServicer_to_server,
        admin,
        server,
        gate=admin.before_read if keyed else None,
    )
    health_servicer = WatchBoundedHealth()
    grpc_methods.add_service(
        health_pb2_grpc.add_HealthServicer_to_server,
        health_servicer,
        server,
        read_s=HEALTH_READ_S,
    )
    reflected = (
        SERVICE_NAME,
        ADMIN_SERVICE_NAME,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    grpc_methods.add_service(
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server,
        reflection.aio.ReflectionServicer(reflected),
        server,
        # grpc.reflection.v1 is v1alpha under its stable name, message for message: clients that
        # ask only v1 (newer grpcurl, Postman) get the same answers.
        also_as=(REFLECTION_V1,),
        # It describes the API, and each of its requests is read as any other call's: with keys
        # configured, a call without a valid key is refused before its first request is read
        # (grpcurl's -H sends the key to reflection too).
        gate=key_gate(access, mutual) if keyed else None,
    )
    port, tls = listen(server, config)
    if cache is not None:
        # Before serving: L1 must not take in answers before its invalidation follower knows
        # where the stream of other gateways' invalidations ends (invalidation_feed.py).
        await cache.check()
    await server.start()
    monitor = HealthMonitor(health_servicer, SERVICE_NAME, models)
    await monitor.publish()
    monitor.start()
    running = RunningGateway(
        server, service, health_servicer, monitor, models, port, metrics, access=access, tls=tls
    )
    if config.server.health_socket is not None:
        try:
            running.health_socket = await serve_health_socket(
                config.server.health_socket, health_servicer
            )
        except StartupError:
            await running.drain(0)
            raise
        log.info("health on unix:%s", config.server.health_socket)
    if config.metrics.listen is not None:
        try:
            running.metrics_port = metrics.serve(config.metrics.listen)
        except OSError as exc:
            await running.drain(0)
            raise StartupError(
                f"cannot serve metrics on {config.metrics.listen}: {exc.strerror or exc}"
            ) from exc
        log.info("metrics on http://%s/metrics", config.metrics.listen)
    if config.http.listen is not None:
        http = HttpApi(
            pipeline,
            health_servicer,
            SERVICE_NAME,
            config.http,
            tls,
            mutual,
            metrics.http_connections_refused,
            metrics.http_requests_refused,
        )
        try:
            await http.start()
        except OSError as exc:
            await running.drain(0)
            raise StartupError(
                f"cannot serve the HTTP API on {config.http.listen}: {exc.strerror or exc}"
            ) from exc
        running.http = http
        scheme = "https" if tls is not None else "http"
        host = config.http.listen.rpartition(":")[0]
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", scheme, host, http.port)
    return running


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


def keep_long_lived_from_gc(running: RunningGateway) -> None:
    """Freezes the heap now (modules, models, an index already rebuilt) and after each rebuild
    of the semantic index (its entries). A rebuild after Redis came back thus pays one full
    collection while the gateway serves, once."""
    freeze_heap()
    for tier in running.pipeline.cache.tiers if running.pipeline.cache else ():
        if isinstance(tier, SemanticTier):
            tier.on_rebuilt = freeze_heap


async def serve(config: GatewayConfig) -> int:
    """Runs the gateway until SIGTERM or SIGINT. Returns the process exit status."""
    tokenize_on_calling_thread()
    try:
        # Before the models load and the backends are waited for: a port in use is said at once.
        refuse_taken_addresses(config)
        models = await load_models(config)
        await warm_up(models)
        running = await start_server(config, models)
    except StartupError as exc:
        logline.last_line(f"appliance serve: {exc}")
        return exc.exit_status
    keep_long_lived_from_gc(running)
    log.info(
        "gateway listening on %s (%s, %s), models: %s",
        config.server.listen,
        "mutual TLS"
        if running.tls and running.tls.mutual
        else "TLS"
        if running.tls
        else "plaintext",
        f"{len(running.access.keys)} API keys"
        if running.access and running.access.keys
        else "no API keys",
        ", ".join(models),
    )
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, running.reload)
    quiescing: list[asyncio.Task[None]] = []

    def start_quiescing() -> None:  # SIGUSR1; a second signal changes nothing
        if not quiescing:
            quiescing.append(
                asyncio.ensure_future(quiesce(running.monitor, running.pipeline.in_flight))
            )

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, start_quiescing)
    await sdnotify.ready_until_signalled(f"serving {', '.join(models)} on {config.server.listen}")
    for task in quiescing:
        task.cancel()
    log.info("draining for up to %.1f s", config.server.drain_seconds)
    draining = time.monotonic()
    await running.drain(config.server.drain_seconds)
    log.info("gateway stopped (drained and closed in %.1f s)", time.monotonic() - draining)
    return 0
