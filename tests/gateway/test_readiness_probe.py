"""The gateway's readiness poll of each engine: an engine that gives one poll no answer in its time
(busy: a long prefill on a loaded host) is not yet unreachable; two polls in a row without an
answer, or an answer that says not ready, make it so. The gateway runs in the test's event loop
against engine server processes (the fixtures of test_latency_discipline)."""

from __future__ import annotations

import signal

from appliance.gateway.server import RunningGateway
from tests.gateway.test_latency_discipline import (  # noqa: F401  (fixtures)
    EngineProcess,
    engines,
    gateway,
)


async def test_one_poll_without_an_answer_leaves_the_engine_reachable(
    gateway: RunningGateway,  # noqa: F811
    engines: tuple[EngineProcess, ...],  # noqa: F811
) -> None:
    monitor = gateway.monitor
    await monitor.stop()  # the polls below are the only ones
    health = gateway.pipeline.models["primary"].health
    engines[0].signal(signal.SIGSTOP)  # the engine answers nothing
    try:
        await monitor.check()
        assert health.reachable, health.describe()
        await monitor.check()
        assert not health.reachable
        assert "DEADLINE_EXCEEDED" in health.describe()
    finally:
        engines[0].signal(signal.SIGCONT)
    await monitor.check()
    assert health.reachable
    # Answered again: the next poll without an answer starts counting anew.
    engines[0].signal(signal.SIGSTOP)
    try:
        await monitor.check()
        assert health.reachable
    finally:
        engines[0].signal(signal.SIGCONT)
