"""Health that tells the truth: per model, from the engine's readiness and the model's breaker.

A model is SERVING while its engine answers readiness checks and its breaker is not open, or while its
fallback is serving in its place; NOT_SERVING otherwise. The gateway as a whole ("" and the Inference
service) is SERVING only while every model is. A gateway told to drain (a rolling upgrade) is
NOT_SERVING under every name, whatever its engines say, so clients that follow health send it nothing. A monitor task polls each engine's readiness, so health
flips when an engine dies or comes back even without traffic, and a restarted engine's configuration
is read again before it takes requests. The watchdog is separate and never depends on this.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2

from appliance.gateway.breaker import CircuitBreaker

if TYPE_CHECKING:
    from appliance.gateway.models import ServedModel

log = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ModelHealth:
    """What the gateway knows about one model's engine: reachable, and its breaker."""

    def __init__(self, breaker: CircuitBreaker) -> None:
        self.breaker = breaker
        self.reachable = True
        self.last_failure = ""

    def usable(self) -> bool:
        """Whether requests may be sent to the engine now (no side effect on the breaker)."""
        return self.reachable and self.breaker.state != "open"

    def routable(self) -> bool:
        """Whether a request routed here now would be let through to the engine: usable, and not
        while a half-open breaker's one probe is out (health still says SERVING then: the probe
        decides within one request)."""
        return self.usable() and not self.breaker.probing

    def succeeded(self) -> None:
        if self.breaker.state != "closed":
            log.info("engine recovered; breaker closed")
        self.breaker.success()

    def failed(self, why: str) -> None:
        self.last_failure = why
        before = self.breaker.opened
        self.breaker.failure()
        if self.breaker.opened != before:
            log.warning("engine failing (%s): breaker open for %.1f s", why, self.breaker.reset_s)

    def describe(self) -> str:
        if not self.reachable:
            return f"engine unreachable ({self.last_failure or 'readiness check failed'})"
        if self.breaker.state == "open":
            return f"breaker open after repeated failures (last: {self.last_failure})"
        if self.breaker.probing:
            return (
                f"breaker open after repeated failures (last: {self.last_failure}); one request "
                "is probing the engine now"
            )
        return "serving"


# Health Watch calls one connection may hold open at once. A Watch stays open after its one
# message, and gRPC's core lets its stream take up to the receive limit (4 MiB) of further bytes
# that nothing reads; health answers callers without a key, so without this bound one connection
# could hold that for each of its streams. gRPC's client-side health checking opens one Watch per
# connection.
MAX_WATCHES_PER_CONNECTION = 4


class WatchBoundedHealth(health.aio.HealthServicer):  # type: ignore[misc]
    """grpc's health servicer with at most MAX_WATCHES_PER_CONNECTION Watch calls open per TCP
    connection (a Unix socket's peers carry no address to tell them apart: its file mode guards
    it); one more is refused RESOURCE_EXHAUSTED as its message is read."""

    def __init__(self) -> None:
        super().__init__()
        self._watches: Counter[str] = Counter()

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        peer = context.peer()
        counted = not peer.startswith("unix:")
        if counted and self._watches[peer] >= MAX_WATCHES_PER_CONNECTION:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {MAX_WATCHES_PER_CONNECTION} health Watch calls are open at once on "
                "one connection: end one first",
            )
        if counted:
            self._watches[peer] += 1
        try:
            await super().Watch(request, context)
        finally:
            if counted:
                self._watches[peer] -= 1
                if not self._watches[peer]:
                    del self._watches[peer]


def health_name(service: str, model: str) -> str:
    """The grpc.health.v1 service name of one model: SERVICE/MODEL."""
    return f"{service}/{model}"


class HealthMonitor:
    """Polls engine readiness and keeps grpc.health.v1 statuses up to date."""

    def __init__(
        self,
        servicer: health.aio.HealthServicer,
        service: str,
        models: dict[str, ServedModel],
        interval_s: float = 1.0,
    ) -> None:
        self._models = models
        self._servicer = servicer
        self._service = service
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None
        self._statuses: dict[str, int] = {}
        # Models whose engine gave the last round no answer while still reachable.
        self._unanswered: set[str] = set()
        self.draining = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self._interval)

    async def check(self) -> None:
        """One round: every engine's readiness, then every status. An engine that gives one
        round no answer within its time is busy (a long prefill on a loaded host), not gone: it
        is unreachable when the next round gets none either, or an answer that says not ready."""
        loop = asyncio.get_running_loop()
        timeout_s = min(self._interval, 2.0)
        for name, model in self._models.items():
            asked = loop.time()
            try:
                ready, why = await model.backend.readiness(timeout_s)
            except Exception as exc:
                # A backend whose check raises (against its contract) cannot be called ready;
                # the monitor goes on for every model.
                ready, why = False, f"its readiness check raised {type(exc).__name__}"
            # gRPC's deadline and this loop's clock differ by a little: nine tenths is all of it.
            unanswered = not ready and loop.time() - asked >= 0.9 * timeout_s
            if unanswered and model.health.reachable and name not in self._unanswered:
                self._unanswered.add(name)
                log.info(
                    "model '%s': engine at %s gave no answer in %.1f s: %s",
                    name,
                    model.backend.address,
                    timeout_s,
                    why,
                )
                continue
            self._unanswered.discard(name)
            if ready and not model.health.reachable:
                log.info("model '%s': engine at %s reachable again", name, model.backend.address)
            elif not ready and model.health.reachable:
                log.warning(
                    "model '%s': engine at %s unreachable: %s", name, model.backend.address, why
                )
            if not ready:
                model.health.last_failure = why
            model.health.reachable = ready
        await self.publish()

    async def drain(self) -> None:
        """NOT_SERVING from now on, under every name (the readiness polls go on)."""
        self.draining = True
        await self.publish()

    async def publish(self) -> None:
        usable = {name: m.health.usable() for name, m in self._models.items()}
        every = not self.draining
        for name, model in self._models.items():
            fallback = model.policy.fallback
            serving = usable[name] or (fallback is not None and usable.get(fallback, False))
            serving = serving and not self.draining
            every = every and serving
            await self._set(health_name(self._service, name), serving)
        for name in ("", self._service):
            await self._set(name, every)

    async def _set(self, name: str, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        if self._statuses.get(name) != status:
            self._statuses[name] = status
            await self._servicer.set(name, status)
