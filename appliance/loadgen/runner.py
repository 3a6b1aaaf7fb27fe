"""Sends the bench's requests to a deployment and records what the client sees (the network edge).

Closed loop (`concurrency N`): N clients each send their next request when the previous answer has
ended. Open loop (`rate R`): arrivals are a Poisson process of R per second, sent whether or not
earlier answers have ended, so a slow server meets a growing queue, as with independent users;
the client keeps at most `--max-in-flight` of them outstanding, and counts an arrival over that
as NOT_SENT. A target whose connection is refused or lost, or that answers only UNAVAILABLE for
UNAVAILABLE_FOR_S (and UNAVAILABLE_RUN answers at least), that leaves `--stop-after-timeouts`
requests in a row without a single message until their deadline (it stopped answering), or that
refuses the API key (UNAUTHENTICATED or PERMISSION_DENIED: revoked, or its scopes changed), ends the
run (`LoadRunner.lost`): nothing more is sent, and the requests in flight end on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import grpc
import numpy as np

from appliance.client import StreamResult, generate
from appliance.loadgen.options import BenchInputError, Level, Settings, Target
from appliance.loadgen.progress import Progress
from appliance.loadgen.stats import (
    CANCELLED_BY_SERVER,
    INTERRUPTED,
    NO_FINAL,
    NOT_SENT,
    OK,
    Record,
)
from appliance.loadgen.workload import Prompt, Workload
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc


class BenchRunError(Exception):
    """The deployment answered the first request with an error that is not the input's fault."""


# Statuses of the first request that mean the command line is wrong, not the deployment.
# The run stops once every answer for this long, and at least this many in a row, was UNAVAILABLE:
# the gateway answers, but what is behind it (the engine) no longer does, so every further request
# would fail the same way at once. The time keeps a blip (an engine restart, a breaker's probe) from
# ending a run at a high rate, where 20 answers take milliseconds.
UNAVAILABLE_FOR_S = 3.0
# The request id of the request sent before the run (`Runner.preflight`).
PREFLIGHT_ID = "bench-preflight"
UNAVAILABLE_RUN = 20

INPUT_STATUSES = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}
# Refusals of the API key: every further request would be refused the same way.
KEY_STATUSES = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
# What to change for a first request refused with this status.
INPUT_HINTS = {
    grpc.StatusCode.UNIMPLEMENTED: "nothing there serves appliance.v1.Inference: is it the gateway?",
    grpc.StatusCode.UNAUTHENTICATED: "give the API key with --api-key-file or $APPLIANCE_API_KEY",
}


async def open_channel(target: Target) -> grpc.aio.Channel:
    """A channel that is connected, or BenchInputError after the connect timeout."""
    tls = target.credentials.tls
    if tls is None:
        channel = grpc.aio.insecure_channel(target.address)
    else:
        channel = grpc.aio.secure_channel(target.address, tls, options=target.credentials.options)
    try:
        await asyncio.wait_for(channel.channel_ready(), target.connect_timeout_s)
    except TimeoutError:
        await channel.close()
        within = f"within {target.connect_timeout_s:g} s"
        if not await _listening(target.address):
            why = f"nothing answered {within} (is the gateway running there?"
        elif tls is None:
            why = (
                f"a server listens but no gRPC connection came up {within} (if the gateway "
                "serves TLS, give --ca-file;"
            )
        else:
            why = (
                f"a server listens but no TLS connection came up {within} (does --ca-file hold "
                "the CA of its certificate, for this host name or --server-name? with mutual TLS, "
                "give --cert-file and --key-file;"
            )
        raise BenchInputError(f"--address {target.address}: {why} see --connect-timeout)") from None
    return channel


async def _listening(address: str) -> bool:
    """Whether a TCP connection to HOST:PORT opens (something listens there)."""
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), 5)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


def _name(value: int, enum: str) -> str:
    prefix = "FINISH_REASON_" if enum == "finish" else "CACHE_TIER_"
    kind = pb.FinishReason if enum == "finish" else pb.CacheTier
    return kind.Name(value).removeprefix(prefix)


class LoadRunner:
    def __init__(
        self,
        settings: Settings,
        prompts: list[Prompt] | None,
        stub: pb_grpc.InferenceStub,
        progress: Progress,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        self.settings = settings
        self.channel = channel
        self.prompts = prompts
        self.stub = stub
        self.progress = progress
        self.t0 = time.perf_counter()
        self.records: list[Record] = []
        self.stopping = asyncio.Event()
        self.in_flight: set[asyncio.Task[object]] = set()
        self.level_done = 0
        self.level_errors = 0
        # Why the run stopped on its own: the target became unreachable, or answered only
        # UNAVAILABLE (None: it did not).
        self.lost: str | None = None
        self.unavailable_run = 0  # answers in a row that were UNAVAILABLE
        self.unavailable_since = 0.0  # when the first of them ended (time.perf_counter())
        self.unanswered_run = 0  # requests in a row that got no message before their deadline
        self.cancelling = False  # interrupted: the bench cancels the requests in flight

    def interrupt(self) -> None:
        """Stops sending and ends the requests in flight (recorded as INTERRUPTED)."""
        self.cancelling = True
        self.stopping.set()
        for task in self.in_flight:
            task.cancel()

    def _lose(self, why: str) -> None:
        """Stops sending because the target stopped serving; the requests in flight end on their
        own (a gateway that drains still answers them; a lost connection fails them at once)."""
        self.lost = why
        self.stopping.set()
        if self.in_flight:
            self.progress.say(
                f"stopped sending ({why}); waiting for the {len(self.in_flight)} requests in "
                "flight (Ctrl-C ends them)"
            )

    async def preflight(self) -> None:
        """One request of the workload (cache bypassed), left after its first message: a wrong
        model, a length the model does not take or an API that is not ours stops the run before
        any load, with the deployment's own message."""
        request = Workload(self.settings, self.prompts, len(self.settings.levels) + 1).next()
        request.cache_policy = pb.CACHE_POLICY_BYPASS
        request.request_id = PREFLIGHT_ID
        call = asyncio.create_task(self._first_message(request))
        self.in_flight.add(call)
        try:
            await call
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
            # Interrupted (Ctrl-C): the sweep stops before its first level.
        except grpc.aio.AioRpcError as exc:
            line = f"{self.settings.target.address}: {exc.code().name}: {exc.details()}"
            if exc.code() in KEY_STATUSES and self.settings.target.key_source is not None:
                line = self._key_refused(exc)
            elif exc.code() in INPUT_HINTS:
                line += f" ({INPUT_HINTS[exc.code()]})"
            if exc.code() in INPUT_STATUSES:
                raise BenchInputError(line) from None
            raise BenchRunError(f"the first request failed: {line}") from None
        finally:
            self.in_flight.discard(call)

    async def _first_message(self, request: pb.GenerateRequest) -> None:
        """Streams `request` until its first message, then cancels the rest of it."""
        call = self.stub.Generate(
            request,
            timeout=self.settings.timeout_s,
            metadata=self.settings.target.credentials.metadata,
        )
        try:
            async for _ in call:
                break
        finally:
            call.cancel()

    async def _generate(
        self, request: pb.GenerateRequest, result: StreamResult | None = None
    ) -> StreamResult:
        return await generate(
            self.stub,
            request,
            timeout=self.settings.timeout_s,
            metadata=self.settings.target.credentials.metadata,
            result=result,
        )

    async def warmup(self) -> dict[str, int]:
        """`warmup` requests one after another, not recorded; returns their statuses."""
        workload = Workload(self.settings, self.prompts, len(self.settings.levels))
        statuses: dict[str, int] = {}
        for i in range(self.settings.warmup):
            if self.stopping.is_set():
                break
            record = await self._one("warmup", i, workload.next())
            statuses[record.status] = statuses.get(record.status, 0) + 1
        return statuses

    async def level(self, index: int, level: Level) -> list[Record]:
        """Runs one load level to its count or duration (or until interrupted)."""
        workload = Workload(self.settings, self.prompts, index)
        s = self.settings
        goal = f"{s.requests} requests" if s.requests is not None else f"{s.duration_s:g} s"
        self.progress.start(level.label, goal)
        self.level_done = self.level_errors = 0
        first = len(self.records)
        started = time.monotonic()

        def more(issued: int) -> bool:
            if self.stopping.is_set():
                return False
            if s.requests is not None:
                return issued < s.requests
            assert s.duration_s is not None
            return time.monotonic() - started < s.duration_s

        ticker = asyncio.create_task(self._tick())  # progress even while no answer ends
        try:
            if level.mode == "concurrency":
                await self._closed_loop(level, workload, int(level.value), more)
            else:
                await self._open_loop(level, workload, index, more)
        finally:
            ticker.cancel()
        self.progress.end(self.level_done, self.level_errors)
        return self.records[first:]

    async def _closed_loop(
        self, level: Level, workload: Workload, clients: int, more: Callable[[int], bool]
    ) -> None:
        issued = 0

        async def client() -> None:
            nonlocal issued
            while more(issued):
                issued += 1
                await self._one(level.label, issued - 1, workload.next())

        await asyncio.gather(*(client() for _ in range(clients)))

    async def _open_loop(
        self, level: Level, workload: Workload, index: int, more: Callable[[int], bool]
    ) -> None:
        arrivals = np.random.default_rng([self.settings.seed, index, 1])
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Task[Record]] = set()
        started = next_at = loop.time()
        end_at = None if self.settings.duration_s is None else started + self.settings.duration_s
        issued = 0
        while True:
            next_at += float(arrivals.exponential(1.0 / level.value))
            # An arrival due after the level's end is never waited for.
            wake_at = next_at if end_at is None else min(next_at, end_at)
            delay = wake_at - loop.time()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), delay)
            if not more(issued) or (end_at is not None and next_at >= end_at):
                break
            request = workload.next()
            if len(pending) >= self.settings.max_in_flight:
                # The client holds no more outstanding requests than this: the arrival is
                # recorded as a failure of the level, not sent.
                self._not_sent(level.label, issued, request)
            else:
                task = asyncio.create_task(self._one(level.label, issued, request))
                pending.add(task)
                task.add_done_callback(pending.discard)
            issued += 1
            self._show()
        await asyncio.gather(*pending)

    def _not_sent(self, level: str, index: int, request: pb.GenerateRequest) -> None:
        record = Record(level, index, time.perf_counter() - self.t0, max_tokens=request.max_tokens)
        record.status = NOT_SENT
        record.error = (
            f"{self.settings.max_in_flight} requests were outstanding (--max-in-flight): "
            "the arrival was not sent"
        )
        record.latency_s = 0.0
        self.records.append(record)
        self.level_done += 1
        self.level_errors += 1

    async def _one(self, level: str, index: int, request: pb.GenerateRequest) -> Record:
        record = Record(level, index, time.perf_counter() - self.t0, max_tokens=request.max_tokens)
        if level != "warmup":
            self.records.append(record)
        partial = StreamResult()  # how far a stream that fails got
        call = asyncio.create_task(self._generate(request, partial))
        self.in_flight.add(call)
        try:
            result = await call
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
            record.status = INTERRUPTED
            return record
        except grpc.aio.AioRpcError as exc:
            if self.cancelling and exc.code() == grpc.StatusCode.CANCELLED:
                # The bench's own cancellation, seen by the RPC before the task.
                record.status = INTERRUPTED
                return record
            self._check_reachable(exc)
            self._count_unavailable(exc)
            self._count_unanswered(exc, partial)
            if exc.code() in KEY_STATUSES and not self.stopping.is_set():
                self._lose(self._key_refused(exc))
            record.status = exc.code().name
            record.error = exc.details() or ""
            record.latency_s = time.perf_counter() - self.t0 - record.start_s
            self.level_errors += level != "warmup"
            return record
        finally:
            self.in_flight.discard(call)
            if level != "warmup":
                self.level_done += record.status != INTERRUPTED
                self._show()
        self.unavailable_run = self.unanswered_run = 0
        final = result.final
        record.status = OK
        if final.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            # Every answer ends with a message whose `final` is set: this stream was cut short.
            record.status = NO_FINAL
            record.error = "the stream ended without its final message"
        elif final.finish_reason == pb.FINISH_REASON_CANCELLED:
            record.status = CANCELLED_BY_SERVER
            record.error = (
                "the server ended the answer early (FINISH_REASON_CANCELLED), after "
                f"{final.usage.completion_tokens} of {request.max_tokens} tokens"
            )
        if record.status != OK and level != "warmup":
            self.level_errors += 1
        record.request_id = result.request_id
        record.ttft_s = result.ttft_s if result.messages and result.token_ids else None
        record.latency_s = result.latency_s
        record.gaps_s = result.gaps_s
        record.input_tokens = final.usage.prompt_tokens
        record.output_tokens = final.usage.completion_tokens or len(result.token_ids)
        record.finish_reason = _name(final.finish_reason, "finish")
        record.cache_tier = _name(final.cache_tier, "tier")
        record.degraded = final.degraded
        record.server_queue_us = final.timings.queue_us
        record.server_ttft_us = final.timings.ttft_us
        record.server_total_us = final.timings.total_us
        return record

    def _check_reachable(self, exc: grpc.aio.AioRpcError) -> None:
        """A connection refused or lost (the channel, not the deployment, failed) stops the run:
        every further request would fail at once without reaching anything."""
        if (
            exc.code() != grpc.StatusCode.UNAVAILABLE
            or self.channel is None
            or self.channel.get_state() != grpc.ChannelConnectivity.TRANSIENT_FAILURE
            or self.stopping.is_set()
        ):
            return
        self._lose(f"{self.settings.target.address} became unreachable: {exc.details()}")

    def _key_refused(self, exc: grpc.aio.AioRpcError) -> str:
        """What the deployment said of the API key, and where the key came from."""
        target = self.settings.target
        said = f"{exc.code().name}: {exc.details()}"
        if target.key_source is None:
            return (
                f"{target.address}: a request without an API key was refused: {said} (give one "
                "with --api-key-file or $APPLIANCE_API_KEY)"
            )
        return f"{target.address}: the API key of {target.key_source} was refused: {said}"

    def _count_unavailable(self, exc: grpc.aio.AioRpcError) -> None:
        """Answers that were all UNAVAILABLE for UNAVAILABLE_FOR_S, UNAVAILABLE_RUN of them at
        least, stop the run: the gateway answers, but nothing behind it does (its engine is down,
        its breaker open)."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            self.unavailable_run = 0
            return
        now = time.perf_counter()
        if not self.unavailable_run:
            self.unavailable_since = now
        self.unavailable_run += 1
        lasted = now - self.unavailable_since
        if (
            self.unavailable_run < UNAVAILABLE_RUN
            or lasted < UNAVAILABLE_FOR_S
            or self.stopping.is_set()
        ):
            return
        self._lose(
            f"{self.settings.target.address}: the last {self.unavailable_run} answers, over "
            f"{lasted:.1f} s, were UNAVAILABLE ({exc.details()}): the deployment stopped serving"
        )

    def _count_unanswered(self, exc: grpc.aio.AioRpcError, partial: StreamResult) -> None:
        """`--stop-after-timeouts` requests in a row that got not one message before their
        deadline stop the run: the gateway accepts requests but no longer answers them, and every
        further request would wait out its --timeout the same way. Any other outcome (an answer,
        an error answer, a stream that timed out after it began) starts the count again."""
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or partial.messages:
            self.unanswered_run = 0
            return
        self.unanswered_run += 1
        limit = self.settings.stop_after_timeouts
        if not limit or self.unanswered_run < limit or self.stopping.is_set():
            return
        self._lose(
            f"{self.settings.target.address}: the last {self.unanswered_run} requests got no "
            f"answer within --timeout {self.settings.timeout_s:g} s: the gateway stopped "
            "answering (see --stop-after-timeouts)"
        )

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.progress.interval_s)
            self._show()

    def _show(self) -> None:
        self.progress.update(self.level_done, self.level_errors, len(self.in_flight))
