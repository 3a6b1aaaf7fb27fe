"""Draining without stopping (SIGUSR1): the first step of taking a host out of a fleet.

Stopping a gateway (SIGTERM) closes its listener at once, so a client that has not yet heard of the
stop fails a request. A rolling upgrade first quiesces the host instead: every health status turns
NOT_SERVING, so clients that balance on gRPC health (round_robin with healthCheckConfig) stop
picking this host within one health-watch message; a request that still arrives (a client that
does not follow health, or one already on the wire) is answered as usual. systemd's status line
says how many requests are still being answered, then `drained` once none has been for
`QUIET_S`, which is when the upgrade may stop the process (`systemctl show -p StatusText`).
There is no way back short of a restart: a drained host is about to be replaced.
"""

from __future__ import annotations

import asyncio
import logging
import time

from appliance import sdnotify
from appliance.gateway.health import HealthMonitor

log = logging.getLogger(__name__)

# A request picked by a client just before its health watch delivered NOT_SERVING may still be on
# the wire: `drained` waits for this long without any request in flight, not just for zero.
QUIET_S = 1.0
POLL_S = 0.05
DRAINED = "drained"


def status_line(in_flight: int, quiet: bool) -> str:
    """The STATUS= text: `drained: ...` once quiet, else `draining: N requests in flight`."""
    if quiet:
        return f"{DRAINED}: no request in flight, health NOT_SERVING"
    return f"draining: {in_flight} requests in flight, health NOT_SERVING"


async def quiesce(
    monitor: HealthMonitor, in_flight: dict[str, int], quiet_s: float = QUIET_S
) -> None:
    """Turns health NOT_SERVING, then keeps systemd's status line current until cancelled
    (`in_flight`: requests being answered, by model, as the pipeline counts them)."""
    await monitor.drain()
    log.info("draining: health NOT_SERVING; new requests are still answered")
    last_busy = time.monotonic()
    said = ""
    while True:
        now = time.monotonic()
        busy = sum(in_flight.values())
        if busy:
            last_busy = now
        line = status_line(busy, quiet=not busy and now - last_busy >= quiet_s)
        if line != said:
            sdnotify.notify(f"STATUS={line}")
            if line.startswith(DRAINED):
                log.info("drained: no request in flight for %.1f s", quiet_s)
            said = line
        await asyncio.sleep(POLL_S)
