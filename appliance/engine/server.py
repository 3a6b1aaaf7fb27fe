"""The engine server: Triton's GRPCInferenceService for the `tensorrt_llm` model, computed with torch.

It is the inference process on hosts without the GPU stack and the peer every test runs against, so it
keeps Triton's semantics on every point the gateway relies on: decoupled streaming with
`triton_final_response` on every response; in-band `error_message` with the stream left open (or a gRPC
status with header `triton_grpc_error: true`); ModelInfer refused for decoupled models; `stop=true` with
the same id cancels; closing the stream cancels what is in flight on it. Each request is checked and
read into the engine's request (`Decoded`) by infer_request.py; this module serves, answers and counts.

A stopped or cancelled request ends the way the tensorrtllm backend ends it: the executor returns a final
result (possibly no new tokens) and the backend sends it as a response with its output tensors and the
final flag, so its stream ends whether or not the client set `triton_enable_empty_final_response` (Triton
only drops a *null* final response). The `stop=true` request itself is answered at once with a response
without outputs carrying the final flag.

Its streams can also be served on a Unix socket (`--stream-socket`; appliance/backends/stream_socket.py),
with the same semantics and none of gRPC's per-message cost; Triton has no such socket.

It stops as Triton stops (`--exit-timeout-secs`, `stop_engine`): new calls are refused, requests in
flight get up to the exit timeout to finish, then whatever still runs is cancelled.

The RPCs Triton has and this server does not (shared memory, trace, log settings, model load/unload)
answer with the status and wording Triton uses when the feature is absent; ServerMetadata lists only the
extensions served here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import re
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import grpc
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance import logline, sdnotify
from appliance.backends import wire
from appliance.backends.stream_socket import SocketInUse, StreamSocketServer
from appliance.engine.guided import Grammars
from appliance.engine.infer_request import (
    Decoded,
    InferError,
    ModelSpec,
    compile_guide,
    decode_request,
    dtype_name,
    refused_after_core,
)
from appliance.engine.llama import CheckpointError, LlamaModel
from appliance.engine.loading import load_model
from appliance.engine.metrics import serve_metrics
from appliance.engine.options import EngineOptions, FitError
from appliance.engine.repository import (
    ModelEntry,
    RepositoryError,
    lock_repository,
    read_repository,
)
from appliance.engine.runner import Emission, Job, RequestPerf, Runner
from appliance.engine.sampling import TopLogprobs
from appliance.engine.statistics import ModelStatistics, RequestClock
from appliance.grpc_limits import MAX_REQUEST_BYTES, RECEIVE_LIMIT
from appliance.heap import freeze_heap
from appliance.listen import first_taken, serving_problem
from engine_build.pbtxt import (
    ACCEPTANCE_RATE_OUTPUT,
    ACCEPTED_DRAFT_TOKENS_OUTPUT,
    DRAFT_TOKENS_OUTPUT,
    SPECULATION_INPUT,
    TOP_LOGPROB_IDS_OUTPUT,
    TOP_LOGPROBS_INPUT,
    TOP_LOGPROBS_OUTPUT,
    declare_perf_metrics,
)

log = logging.getLogger(__name__)

SERVER_NAME = "appliance-engine"
SERVER_VERSION = "1"
# The protocol extensions this server implements (Triton's names): ModelConfig, ModelStatistics,
# request and response parameters. perf_analyzer reads server-side statistics only when
# "statistics" is listed.
EXTENSIONS = ("model_configuration", "statistics", "parameters")
# Triton's refusal (UNAVAILABLE) of a request once its gRPC server is stopping: in-band for one sent on
# a stream already open, the call's status for a ModelInfer call (grpc/stream_infer_handler.cc and
# grpc/infer_handler.cc, while `accepting_new_conn_` is false).
STOPPING = "GRPC server is shutting down and has stopped accepting new requests."
# Triton core's answers (UNAVAILABLE) once it is exiting: to ServerLive and ServerReady
# (InferenceServer::IsLive, IsReady), and to ModelReady, ModelMetadata, ModelStatistics and
# RepositoryIndex (ModelIsReady, ModelReadyVersions, RepositoryIndex) (core src/server.cc).
EXITING = "Server exiting"
NOT_READY = "Server not ready"


# What std::stol reads of a version string: C whitespace, a sign, digits (the rest is ignored).
_VERSION = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_INT64_MAX = 2**63 - 1


def model_version(version: str) -> int:
    """The version a call names, read as Triton's frontends read it (GetModelVersionFromString:
    std::stol); -1, the latest, when empty. Anything else is refused INVALID_ARGUMENT."""
    if not version:
        return -1
    digits = _VERSION.match(version)
    number = int(digits.group(1)) if digits else None
    if number is None or not -_INT64_MAX - 1 <= number <= _INT64_MAX:
        raise InferError(
            f"failed to get model version from specified version string '{version}' (details: "
            "stol), version should be an integral value > 0"
        )
    if number < 0:
        raise InferError(
            f"invalid model version specified '{version}' , version should be an integral value > 0"
        )
    return number


def _fault(request: ts.ModelInferRequest, exc: Exception) -> InferError:
    """A fault of this server's own code on an issued request, logged with its traceback: that
    request's final error response."""
    log.exception("request %r failed in this server", request.id[:64])
    fault = refused_after_core(request, InferError(_fault_words(exc)))
    fault.request_id = request.id
    return fault


def _fault_words(exc: Exception) -> str:
    """A fault of this server's own code while it took a request, in the words of the error
    response the TensorRT-LLM backend sends for an exception it catches (its type and text, the
    text cut at 300 characters)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


@dataclass(kw_only=True)
class EngineModel(ModelSpec):
    """One model of the repository as the engine server runs it: what its requests are checked
    against, and what computes them."""

    model: LlamaModel
    runner: Runner


def _perf_outputs(perf: RequestPerf) -> dict[str, tuple[str, int | float]]:
    """The backend's `return_perf_metrics` outputs (shape [1, 1] each): name -> (datatype, value).

    KV blocks as TensorRT-LLM counts them when it adds the sequence to its cache: reused (taken
    from the pool) and allocated (the rest of the prompt's blocks, taken from the free list). A
    block is "new" when it held no reusable K/V before: the working cache this server computes in
    never does, so every allocated block is new."""
    return {
        "kv_cache_alloc_new_blocks": ("INT32", perf.kv.new_blocks),
        "kv_cache_reused_blocks": ("INT32", perf.kv.reused_blocks),
        "kv_cache_alloc_total_blocks": ("INT32", perf.kv.new_blocks),
        "arrival_time_ns": ("INT64", perf.arrival_ns),
        "first_scheduled_time_ns": ("INT64", perf.first_scheduled_ns),
        "first_token_time_ns": ("INT64", perf.first_token_ns),
        "last_token_time_ns": ("INT64", perf.last_token_ns),
        ACCEPTANCE_RATE_OUTPUT: ("FP32", acceptance_rate(perf)),
        ACCEPTED_DRAFT_TOKENS_OUTPUT: ("INT32", perf.accepted_draft_tokens),
        DRAFT_TOKENS_OUTPUT: ("INT32", perf.draft_tokens),
    }


def acceptance_rate(perf: RequestPerf) -> float:
    """Accepted draft tokens per draft token proposed, as the executor computes it; 0 without
    drafts."""
    return perf.accepted_draft_tokens / perf.draft_tokens if perf.draft_tokens else 0.0


def _response(
    model_name: str,
    request: ts.ModelInferRequest,
    tokens: list[int] | None,
    final: bool,
    perf: RequestPerf | None = None,
    declared: frozenset[str] = frozenset(),
    log_probs: list[float] | None = None,
    top: TopLogprobs | None = None,
) -> ts.ModelInferResponse:
    response = ts.ModelInferResponse(model_name=model_name, model_version="1", id=request.id)
    response.parameters["triton_final_response"].bool_param = final
    if tokens is None:
        return response
    wanted = {o.name for o in request.outputs}
    # Shapes of the tensorrt_llm model with its batch dimension: [batch, beam, tokens], [batch, beam].
    if not wanted or "output_ids" in wanted:
        wire.add_output(response, "output_ids", "INT32", tokens, [1, 1, len(tokens)])
    if not wanted or "sequence_length" in wanted:
        wire.add_output(response, "sequence_length", "INT32", [len(tokens)], [1, 1])
    if log_probs is not None:
        # return_log_probs: every generated token's log-probability so far, [batch, beam, tokens]
        # (streamed too, as TensorRT-LLM's executor sends them), and their sum, [batch, beam].
        if "output_log_probs" in declared and (not wanted or "output_log_probs" in wanted):
            wire.add_output(response, "output_log_probs", "FP32", log_probs, [1, 1, len(log_probs)])
        if "cum_log_probs" in declared and (not wanted or "cum_log_probs" in wanted):
            wire.add_output(response, "cum_log_probs", "FP32", [sum(log_probs)], [1, 1])
    if top is not None:
        # The alternatives of this response's generated tokens, [batch, beam, tokens, k].
        shape = [1, 1, len(top.ids), top.k]
        ids = [i for row in top.ids for i in row]
        values = [v for row in top.logprobs for v in row]
        if TOP_LOGPROB_IDS_OUTPUT in declared and (not wanted or TOP_LOGPROB_IDS_OUTPUT in wanted):
            wire.add_output(response, TOP_LOGPROB_IDS_OUTPUT, "INT32", ids, shape)
        if TOP_LOGPROBS_OUTPUT in declared and (not wanted or TOP_LOGPROBS_OUTPUT in wanted):
            wire.add_output(response, TOP_LOGPROBS_OUTPUT, "FP32", values, shape)
    if perf is not None:
        # Only outputs the model config declares, as Triton allows a backend no others.
        for name, (datatype, value) in _perf_outputs(perf).items():
            if name in declared and (not wanted or name in wanted):
                wire.add_output(response, name, datatype, [value], [1, 1])
    return response


# One answer on a stream: a response, or an error to send in-band (or out of band).
_Answer: TypeAlias = ts.ModelStreamInferResponse | InferError


def _log_failure(task: asyncio.Future[None]) -> None:
    """Logs a stream reader's failure; one whose stream ended with an error sent out of band
    (`triton_grpc_error`) ends with grpc's AbortError, which is no failure."""
    if task.cancelled():
        return
    failure = task.exception()
    if failure is not None and not isinstance(failure, grpc.aio.AbortError):
        log.error("stream reader failed", exc_info=failure)


async def _no_region(context: grpc.aio.ServicerContext, kind: str, name: str) -> None:
    """A status request naming a shared-memory region: none is ever registered here."""
    if name:
        await context.abort(
            grpc.StatusCode.NOT_FOUND, f"Unable to find {kind} shared memory region: '{name}'"
        )


class EngineService(ts_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, models: dict[str, EngineModel]) -> None:
        self.models = models
        # (Model, request id) -> the jobs running or queued under it (for stop=true, which
        # reaches the model it is sent to only, as each model's backend keeps its own ids). A
        # set: a client may send any number of requests under one id, and each is forgotten in
        # constant time.
        self._by_id: dict[tuple[str, str], set[Job]] = {}
        # Every job queued or running, with its model (jobs compare by identity).
        self._live: dict[Job, str] = {}
        self.statistics = {name: ModelStatistics() for name in models}
        # Set by stop_streams: the server is stopping.
        self.stopping = False
        # Each open ModelStreamInfer stream's way to end once nothing runs on it.
        self._winding_down: set[Callable[[], None]] = set()
        # Where the streams are also served (start_engine's stream_socket), if anywhere.
        self.stream_socket: StreamSocketServer | None = None

    def stop_streams(self) -> None:
        """The server is stopping: a request sent on an open stream from now on is refused
        in-band, as Triton refuses it; a stream with nothing running ends now (a client may keep
        streams open between requests, and the server's stop would wait for them), and the others
        once their requests end."""
        self.stopping = True
        for wind_down in list(self._winding_down):
            wind_down()

    def in_flight(self) -> int:
        """Requests queued or running, on either RPC or transport."""
        return len(self._live)

    # --- health and metadata -------------------------------------------------------------------

    # Once stopping, a health call that still reaches the server (the gRPC server refuses new
    # calls as soon as it stops, but one may have arrived just before) gets Triton core's answer.

    async def ServerLive(
        self, request: ts.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> ts.ServerLiveResponse:
        if self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, EXITING)
        return ts.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: ts.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> ts.ServerReadyResponse:
        if self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, EXITING)
        return ts.ServerReadyResponse(ready=True)

    async def ServerMetadata(
        self, request: ts.ServerMetadataRequest, context: Any
    ) -> ts.ServerMetadataResponse:
        return ts.ServerMetadataResponse(
            name=SERVER_NAME, version=SERVER_VERSION, extensions=list(EXTENSIONS)
        )

    async def ModelReady(
        self, request: ts.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> ts.ModelReadyResponse:
        # Triton's frontend reads the version string first; core (ModelIsReady) then refuses a
        # server that is not ready and answers `ready: false` for a model or version it does not
        # serve (its failed lookup is no error).
        try:
            version = model_version(request.version)
        except InferError as exc:
            await context.abort(exc.code, exc.message)
        if self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY)
        return ts.ModelReadyResponse(ready=request.name in self.models and version in (-1, 1))

    def lookup(self, name: str, version: str) -> EngineModel:
        """The model a call names, or Triton's refusal (core's GetModel): the version string
        first, then the name, then the version (only version 1 is served)."""
        number = model_version(version)
        model = self.models.get(name)
        if model is None:
            raise InferError(
                f"Request for unknown model: '{name}' is not found", grpc.StatusCode.NOT_FOUND
            )
        if number not in (-1, 1):
            raise InferError(
                f"Request for unknown model: '{name}' version {number} is not found",
                grpc.StatusCode.NOT_FOUND,
            )
        return model

    async def _model(
        self, name: str, version: str, context: grpc.aio.ServicerContext
    ) -> EngineModel:
        try:
            return self.lookup(name, version)
        except InferError as exc:
            await context.abort(exc.code, exc.message)
            raise  # not reached: abort raises

    async def ModelMetadata(
        self, request: ts.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> ts.ModelMetadataResponse:
        model = await self._model(request.name, request.version, context)
        if self.stopping:  # core's ModelReadyVersions
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY)
        config = model.entry.config
        batch = [-1] if config.max_batch_size > 0 else []
        reply = ts.ModelMetadataResponse(name=config.name, versions=["1"], platform=config.backend)
        for i in config.input:
            reply.inputs.add(
                name=i.name, datatype=dtype_name(i.data_type), shape=batch + list(i.dims)
            )
        for o in config.output:
            reply.outputs.add(
                name=o.name, datatype=dtype_name(o.data_type), shape=batch + list(o.dims)
            )
        return reply

    async def ModelConfig(
        self, request: ts.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> ts.ModelConfigResponse:
        model = await self._model(request.name, request.version, context)
        return ts.ModelConfigResponse(config=model.entry.config)

    async def ModelStatistics(
        self, request: ts.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> ts.ModelStatisticsResponse:
        try:
            version = model_version(request.version)
        except InferError as exc:
            await context.abort(exc.code, exc.message)
        if self.stopping:  # core's ModelReadyVersions
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY)
        # Triton core's refusals (TRITONSERVER_ServerModelStatistics); without a name, every
        # model's, whatever the version.
        if request.name and request.name not in self.models:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"requested model '{request.name}' is not available",
            )
        if request.name and version not in (-1, 1):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"requested model version is not available for model '{request.name}'",
            )
        names = [request.name] if request.name else sorted(self.models)
        reply = ts.ModelStatisticsResponse()
        for name in names:
            self.statistics[name].write(reply.model_stats.add(name=name, version="1"))
        return reply

    # --- what Triton has and this server does not -------------------------------------------------
    # Answered the way Triton answers when the feature is absent from its build or its model control
    # mode; never the servicer base class's NotImplementedError (an UNKNOWN status and a traceback).

    async def RepositoryIndex(
        self, request: ts.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> ts.RepositoryIndexResponse:
        if request.repository_name:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "'repository_name' specification is not supported"
            )
        if self.stopping:  # core's RepositoryIndex
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY)
        reply = ts.RepositoryIndexResponse()
        for name in sorted(self.models):
            reply.models.add(name=name, version="1", state="READY")
        return reply

    async def _load_unload(self, context: grpc.aio.ServicerContext) -> None:
        # The repository is fixed at start-up, like Triton's model control mode NONE.
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "explicit model load / unload is not allowed if polling is enabled",
        )

    async def RepositoryModelLoad(
        self, request: ts.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> ts.RepositoryModelLoadResponse:
        await self._load_unload(context)
        return ts.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: ts.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> ts.RepositoryModelUnloadResponse:
        await self._load_unload(context)
        return ts.RepositoryModelUnloadResponse()

    async def SystemSharedMemoryStatus(
        self, request: ts.SystemSharedMemoryStatusRequest, context: grpc.aio.ServicerContext
    ) -> ts.SystemSharedMemoryStatusResponse:
        await _no_region(context, "system", request.name)
        return ts.SystemSharedMemoryStatusResponse()  # no region is ever registered

    async def SystemSharedMemoryRegister(
        self, request: ts.SystemSharedMemoryRegisterRequest, context: grpc.aio.ServicerContext
    ) -> ts.SystemSharedMemoryRegisterResponse:
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, "the server does not support system shared memory"
        )
        return ts.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(
        self, request: ts.SystemSharedMemoryUnregisterRequest, context: grpc.aio.ServicerContext
    ) -> ts.SystemSharedMemoryUnregisterResponse:
        return ts.SystemSharedMemoryUnregisterResponse()  # nothing registered: nothing to do

    async def CudaSharedMemoryStatus(
        self, request: ts.CudaSharedMemoryStatusRequest, context: grpc.aio.ServicerContext
    ) -> ts.CudaSharedMemoryStatusResponse:
        await _no_region(context, "cuda", request.name)
        return ts.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(
        self, request: ts.CudaSharedMemoryRegisterRequest, context: grpc.aio.ServicerContext
    ) -> ts.CudaSharedMemoryRegisterResponse:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"failed to register CUDA shared memory region: '{request.name}', GPUs not supported",
        )
        return ts.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(
        self, request: ts.CudaSharedMemoryUnregisterRequest, context: grpc.aio.ServicerContext
    ) -> ts.CudaSharedMemoryUnregisterResponse:
        return ts.CudaSharedMemoryUnregisterResponse()

    async def TraceSetting(
        self, request: ts.TraceSettingRequest, context: grpc.aio.ServicerContext
    ) -> ts.TraceSettingResponse:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the server does not support trace")
        return ts.TraceSettingResponse()

    async def LogSettings(
        self, request: ts.LogSettingsRequest, context: grpc.aio.ServicerContext
    ) -> ts.LogSettingsResponse:
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, "the server does not support dynamic logging"
        )
        return ts.LogSettingsResponse()

    # --- inference -----------------------------------------------------------------------------

    async def ModelInfer(
        self, request: ts.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> ts.ModelInferResponse:
        try:
            response = await self._model_infer(request, context)
            # The final flag is a stream's (Triton's stream handler sets it); ModelInfer's
            # response carries none.
            del response.parameters["triton_final_response"]
            return response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a fault of this server's code: the call's error, as a stream's
            fault = _fault(request, exc)
            await context.abort(fault.code, fault.message)
            raise  # not reached: abort raises

    async def _model_infer(
        self, request: ts.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> ts.ModelInferResponse:
        clock = RequestClock()
        if self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING)
        model = await self._model(request.model_name, request.model_version, context)
        if model.entry.decoupled:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "ModelInfer RPC doesn't support models with decoupled transaction policy",
            )
        statistics = self.statistics[model.entry.name]
        try:
            decoded = decode_request(request, model)
            if decoded.stop:
                return self.stop_request(request, model)
            await compile_guide(decoded, model, request)
        except InferError as exc:
            if exc.executor:
                statistics.finished(clock, ok=False)
            await context.abort(exc.code, exc.message)
        clock.taken()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Emission] = loop.create_future()

        def ended(e: Emission) -> None:
            if done.cancelled():
                # The client cancelled the call: its request still ends with the runner's final
                # result, and is counted then, as a request on a cancelled stream is.
                clock.computed()
                statistics.finished(clock, ok=not e.error)
            elif not done.done():  # one final result counts, however many are emitted
                done.set_result(e)

        def emit(_: Job, e: Emission) -> None:
            if e.final:
                loop.call_soon_threadsafe(ended, e)

        job = self._submit(model, request, decoded, emit)
        clock.enqueued()
        try:
            emission = await done
        except asyncio.CancelledError:
            if done.done() and not done.cancelled():  # it ended as the call was cancelled
                clock.computed()
                statistics.finished(clock, ok=not done.result().error)
            raise
        finally:
            job.cancel.set()
            self._forget(job)
        clock.computed()
        if emission.error:
            statistics.finished(clock, ok=False)
            await context.abort(grpc.StatusCode.INTERNAL, emission.error)
        try:
            response = _response(
                model.entry.name,
                request,
                _output_ids(decoded, emission.tokens or []),
                True,
                emission.perf,
                model.output_names,
                emission.log_probs,
                emission.top_logprobs,
            )
        except Exception:
            statistics.finished(clock, ok=False)
            raise
        statistics.finished(clock, ok=True)
        return response

    def _submit(
        self,
        model: EngineModel,
        request: ts.ModelInferRequest,
        decoded: Decoded,
        emit: Callable[[Job, Emission], None],
    ) -> Job:
        """Queues the decoded request on the model's compute thread, reachable by its id (for
        `stop=true`) and counted as pending until `_forget`."""
        job = Job(
            request_id=request.id,
            prompt_ids=decoded.prompt_ids,
            max_new_tokens=decoded.max_new_tokens,
            end_id=decoded.end_id,
            params=decoded.params,
            streaming=decoded.streaming,
            emit=lambda e: None,
            return_perf=decoded.return_perf,
            guide=decoded.compiled,
            min_tokens=decoded.min_tokens,
            return_log_probs=decoded.return_log_probs,
            speculate=decoded.speculation,
            top_logprobs=decoded.top_logprobs,
        )
        job.emit = functools.partial(emit, job)
        if request.id:
            self._by_id.setdefault((model.entry.name, request.id), set()).add(job)
        self._live[job] = model.entry.name
        model.runner.submit(job)
        return job

    def _forget(self, job: Job) -> None:
        model = self._live.pop(job, None)
        if model is None:  # forgotten already
            return
        key = (model, job.request_id)
        jobs = self._by_id.get(key)
        if jobs is not None and job in jobs:
            jobs.discard(job)
            if not jobs:
                del self._by_id[key]

    def pending_by_model(self) -> dict[str, int]:
        """Requests queued or running, by model (Triton's pending request count)."""
        counts: dict[str, int] = {}
        for model in list(self._live.values()):
            counts[model] = counts.get(model, 0) + 1
        return counts

    def pending_requests(self) -> int:
        """Requests queued or running under an id (what `stop=true` can reach)."""
        return sum(len(jobs) for jobs in self._by_id.values())

    def cancel_request(self, model: str, request_id: str) -> int:
        """What `stop=true` does: cancels every job of the model queued or running under this
        id."""
        jobs = self._by_id.get((model, request_id), set())
        for job in jobs:
            job.cancel.set()
        return len(jobs)

    def stop_request(
        self, request: ts.ModelInferRequest, model: EngineModel
    ) -> ts.ModelInferResponse:
        """A `stop=true` request, on either RPC: cancels what runs under its id and is answered
        with a response without outputs, flagged final; nothing is generated for it."""
        if not request.id:
            raise refused_after_core(
                request, InferError("Trying to stop a request but request ID is not provided")
            )
        self.cancel_request(model.entry.name, request.id)
        return _response(model.entry.name, request, None, True)

    def _decoupled(self, request: ts.ModelInferRequest) -> bool:
        """Whether Triton's stream handler takes the request to be for a decoupled model: the
        server is not stopping and the model it names is found and decoupled."""
        try:
            model = self.lookup(request.model_name, request.model_version)
        except InferError:
            return False
        return not self.stopping and model.entry.decoupled

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[ts.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ts.ModelStreamInferResponse]:
        metadata = dict(context.invocation_metadata() or ())
        errors_out_of_band = metadata.get("triton_grpc_error") == "true"  # exactly, as Triton
        async for response in self.stream(
            request_iterator, context.abort if errors_out_of_band else None
        ):
            yield response

    async def stream(
        self,
        request_iterator: AsyncIterator[ts.ModelInferRequest],
        abort: Callable[[grpc.StatusCode, str], Awaitable[None]] | None = None,
    ) -> AsyncGenerator[ts.ModelStreamInferResponse, None]:
        """One stream's responses to its requests, whatever carries them (a gRPC
        `ModelStreamInfer` call or the stream socket). An error goes in-band, or to `abort`
        (Triton's `triton_grpc_error` header: the stream ends with the error's status). Leaving
        early (the client closed or cancelled the stream) cancels whatever runs on it."""
        loop = asyncio.get_running_loop()
        outbox: asyncio.Queue[_Answer | None] = asyncio.Queue()
        jobs: set[Job] = set()
        reading = True
        # The answers to requests Triton does not know to be for a decoupled model, one each,
        # leave in the order the requests came (its stream handler queues them:
        # EnqueueForResponse); a decoupled model's leave as they come.
        ordered: deque[list[_Answer]] = deque()

        def in_order() -> Callable[[_Answer], None]:
            slot: list[_Answer] = []
            ordered.append(slot)

            def put(answer: _Answer) -> None:
                slot.append(answer)
                while ordered and ordered[0]:
                    outbox.put_nowait(ordered.popleft()[0])

            return put

        async def start(request: ts.ModelInferRequest, put: Callable[[_Answer], None]) -> None:
            clock = RequestClock()
            if self.stopping:
                raise InferError(STOPPING, grpc.StatusCode.UNAVAILABLE)
            model = self.lookup(request.model_name, request.model_version)
            statistics = self.statistics[model.entry.name]
            try:
                decoded = decode_request(request, model)
            except InferError as exc:
                if exc.executor:
                    statistics.finished(clock, ok=False)
                raise
            if decoded.stop:
                response = self.stop_request(request, model)
                put(ts.ModelStreamInferResponse(infer_response=response))
                return
            await compile_guide(decoded, model, request)
            clock.taken()

            def deliver(job: Job, e: Emission) -> None:
                if job not in jobs:  # answered already: a fault ended it (`fail`)
                    return
                try:
                    respond(job, e)
                except Exception as exc:  # a fault of this server's code: that request's
                    fail(job, exc)

            def fail(job: Job, exc: Exception) -> None:
                """Its final error response, once; the job is cancelled and what it still
                emits is dropped."""
                put(_fault(request, exc))
                job.cancel.set()
                clock.computed()
                statistics.finished(clock, ok=False)
                finish(job)

            def respond(job: Job, e: Emission) -> None:
                if e.final:
                    clock.computed()
                if e.error:
                    failure = InferError(e.error, grpc.StatusCode.INTERNAL)
                    failure.request_id = request.id
                    failure.issued = (request.model_name, request.model_version, e.final)
                    put(failure)
                else:
                    # A final emission without tokens is a stopped or cancelled request: the
                    # executor's final result, sent with (empty) outputs, never dropped.
                    tokens = e.tokens if e.tokens is not None else []
                    response = _response(
                        model.entry.name,
                        request,
                        _output_ids(decoded, tokens),
                        e.final,
                        e.perf,
                        model.output_names,
                        e.log_probs,
                        e.top_logprobs,
                    )
                    put(ts.ModelStreamInferResponse(infer_response=response))
                if e.final:
                    statistics.finished(clock, ok=not e.error)
                    finish(job)

            def emit(job: Job, e: Emission) -> None:
                loop.call_soon_threadsafe(deliver, job, e)

            job = self._submit(model, request, decoded, emit)
            jobs.add(job)
            clock.enqueued()

        def finish(job: Job) -> None:
            jobs.discard(job)
            self._forget(job)
            if (not reading or self.stopping) and not jobs:
                outbox.put_nowait(None)

        def wind_down() -> None:
            if not jobs:
                outbox.put_nowait(None)

        async def read_requests() -> None:
            nonlocal reading
            try:
                async for request in request_iterator:
                    put = outbox.put_nowait if self._decoupled(request) else in_order()
                    try:
                        await start(request, put)
                    except InferError as exc:
                        exc.request_id = request.id
                        put(exc)
                    except Exception as exc:  # a fault of this server's code: that request's
                        put(_fault(request, exc))
            finally:
                reading = False
                if not jobs:
                    outbox.put_nowait(None)

        reader = asyncio.ensure_future(read_requests())
        reader.add_done_callback(_log_failure)
        self._winding_down.add(wind_down)
        try:
            while (item := await outbox.get()) is not None:
                if isinstance(item, InferError):
                    if abort is not None:
                        await abort(item.code, item.message)
                    item = item.in_band()
                yield item
        finally:
            self._winding_down.discard(wind_down)
            # The client closed or cancelled the stream: whatever is in flight on it is cancelled.
            for job in list(jobs):
                job.cancel.set()
                self._forget(job)
            reader.cancel()


def _output_ids(decoded: Decoded, generated: list[int]) -> list[int]:
    """A non-streaming answer holds the prompt before the generated ids unless the request
    excluded it (`exclude_input_in_output`); streamed responses hold only new ids."""
    if decoded.streaming or decoded.exclude_input:
        return generated
    return decoded.prompt_ids + generated


def _served(entry: ModelEntry, options: EngineOptions) -> EngineModel:
    try:
        model, runner = load_model(entry, options)
    except (CheckpointError, RepositoryError, FitError) as exc:
        raise RepositoryError(f"model '{entry.name}': {exc}") from exc
    grammars = None
    try:
        guided = entry.guided_decoding
        if guided is not None:
            grammars = Grammars.load(guided.tokenizer_info_path, model.config.vocab_size)
    except (RepositoryError, ValueError) as exc:
        runner.close()
        raise RepositoryError(f"model '{entry.name}': {exc}") from exc
    config = served_config(entry.config)
    if runner.speculation is not None:
        config = speculative_config(config)
    entry = dataclasses.replace(entry, config=config)
    return EngineModel(
        entry=entry,
        model=model,
        runner=runner,
        max_len=runner.cache.max_seq_len,
        vocab_size=model.config.vocab_size,
        output_names=frozenset(o.name for o in entry.config.output),
        grammars=grammars,
    )


def served_config(config: mc.ModelConfig) -> mc.ModelConfig:
    """The config every model is served with: the repository's, plus what only this server
    computes, the most likely alternatives per token (TOP_LOGPROBS_INPUT, TOP_LOGPROB_IDS_OUTPUT,
    TOP_LOGPROBS_OUTPUT), so a client sees from ModelConfig that it may ask for them."""
    served = mc.ModelConfig()
    served.CopyFrom(config)
    if TOP_LOGPROBS_INPUT not in {i.name for i in served.input}:
        t = served.input.add(
            name=TOP_LOGPROBS_INPUT, data_type=mc.TYPE_INT32, dims=[1], optional=True
        )
        t.reshape.SetInParent()
    outputs = {o.name for o in served.output}
    for name, dtype in (
        (TOP_LOGPROB_IDS_OUTPUT, mc.TYPE_INT32),
        (TOP_LOGPROBS_OUTPUT, mc.TYPE_FP32),
    ):
        if name not in outputs:
            served.output.add(name=name, data_type=dtype, dims=[-1, -1, -1])
    return served


def speculative_config(config: mc.ModelConfig) -> mc.ModelConfig:
    """The config a speculating model is served with: the repository's, plus the per-request
    switch (SPECULATION_INPUT) and the input and outputs that report drafts (PERF_METRICS_INPUT,
    PERF_OUTPUTS), so a client sees from ModelConfig that the model drafts and may ask for them."""
    served = mc.ModelConfig()
    served.CopyFrom(config)
    if SPECULATION_INPUT not in {i.name for i in served.input}:
        t = served.input.add(
            name=SPECULATION_INPUT, data_type=mc.TYPE_BOOL, dims=[1], optional=True
        )
        t.reshape.SetInParent()
    declare_perf_metrics(served)
    return served


def load_repository(
    repository: Path, options: EngineOptions | None = None
) -> dict[str, EngineModel]:
    """Every model of the repository, loaded and with its compute thread running."""
    entries = read_repository(repository)
    return {name: _served(entry, options or EngineOptions()) for name, entry in entries.items()}


async def start_engine(
    models: dict[str, EngineModel], listen: str, stream_socket: Path | None = None
) -> tuple[grpc.aio.Server, EngineService, int]:
    """Starts serving; returns the bound port (listen may end in :0 for a free port). With
    `stream_socket` the service's streams are served there too (stream_socket.py), from before
    the gRPC server answers ServerReady; `stop_engine` stops both."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), RECEIVE_LIMIT])
    service = EngineService(models)
    ts_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as exc:
        raise RepositoryError(f"cannot listen on {listen}: {exc}") from exc
    if stream_socket is not None:
        sockets = StreamSocketServer(stream_socket, service.stream, MAX_REQUEST_BYTES)
        try:
            await sockets.start()
        except (SocketInUse, OSError) as exc:  # taken since the check before loading
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            await server.stop(grace=None)
            raise _socket_refused(stream_socket, why) from None
        service.stream_socket = sockets
    await server.start()
    return server, service, port


def _socket_refused(path: Path, why: str) -> RepositoryError:
    return RepositoryError(f"cannot serve the stream socket {path}: {why}")


async def stop_engine(
    server: grpc.aio.Server, service: EngineService, exit_timeout_s: float
) -> int:
    """Triton's stop (server main.cc: the endpoints' graceful stop, then the server's, both
    bounded by --exit-timeout-secs): the gRPC server and the stream socket stop accepting, so a
    new call is refused (UNAVAILABLE) and a request sent on an open stream is refused in-band
    (STOPPING); a stream with nothing running ends; requests in flight get up to
    `exit_timeout_s` to finish, then every call still open is cancelled (UNAVAILABLE) and its
    requests with it. Returns how many requests were still in flight at the exit timeout."""
    service.stop_streams()
    left = 0

    def expired() -> None:
        nonlocal left
        left = service.in_flight()

    timer = asyncio.get_running_loop().call_later(exit_timeout_s, expired)
    try:
        if service.stream_socket is None:
            await server.stop(grace=exit_timeout_s)
        else:
            await asyncio.gather(
                server.stop(grace=exit_timeout_s), service.stream_socket.close(exit_timeout_s)
            )
    finally:
        timer.cancel()
    return left


async def run_engine(
    repository: Path,
    listen: str,
    options: EngineOptions | None = None,
    metrics_listen: str | None = None,
    stream_socket: Path | None = None,
    *,
    exit_timeout_s: float,
) -> int:
    """The `appliance engine` process: serve until SIGTERM/SIGINT, then stop as Triton stops,
    giving requests in flight up to `exit_timeout_s` (`--exit-timeout-secs`); 1 when some were
    still in flight then, as Triton's."""
    started = time.monotonic()
    try:
        lock = lock_repository(repository)  # before loading: a second server fails in ms
        if (taken := first_taken(listen, metrics_listen)) is not None:
            raise RepositoryError(taken)
        if stream_socket is not None and (problem := serving_problem(stream_socket)) is not None:
            raise _socket_refused(stream_socket, problem)
        models = load_repository(repository, options)
        try:
            server, service, port = await start_engine(models, listen, stream_socket)
        except RepositoryError:
            for model in models.values():
                model.runner.close()
            raise
    except RepositoryError as exc:
        logline.last_line(f"appliance engine: {exc}")
        return 2
    metrics_on = ""
    if metrics_listen is not None:
        try:
            metrics = serve_metrics(service, models, metrics_listen)
            # port 0 in --metrics: the one picked
            metrics_on = f"; metrics on {metrics_listen.rpartition(':')[0]}:{metrics.server_port}"
        except OSError as exc:
            logline.last_line(
                f"appliance engine: cannot serve metrics on {metrics_listen}: {exc.strerror or exc}"
            )
            await stop_engine(server, service, 0.0)
            for model in models.values():
                model.runner.close()
            return 1
    # Models loaded, graphs captured, compute threads running: what is alive now lives as long
    # as the process, and a full collection walking it would stall the compute thread.
    frozen = freeze_heap()
    bound = f"{listen.rpartition(':')[0]}:{port}"  # port 0 in --listen: the one picked
    served_on = bound if stream_socket is None else f"{bound} and {stream_socket}"
    log.info(
        "engine serving %s on %s%s (loaded in %.1f s; %d objects frozen out of the collector)",
        ", ".join(models),
        served_on,
        metrics_on,
        time.monotonic() - started,
        frozen,
    )
    await sdnotify.ready_until_signalled(f"serving {', '.join(models)} on {served_on}")
    stopping = time.monotonic()
    log.info(
        "engine stopping: waiting up to %g s (--exit-timeout-secs) for %d requests in flight",
        exit_timeout_s,
        service.in_flight(),
    )
    left = await stop_engine(server, service, exit_timeout_s)
    if left:
        # Triton exits 1 then ("Exit timeout expired. Exiting immediately."): systemd shows the
        # stop as failed, and the log says what was cut.
        log.warning(
            "exit timeout expired: %d requests still in flight were cancelled (exit status 1)",
            left,
        )
    # Cancel and join every compute thread before the interpreter exits (Runner.close).
    joined = all([model.runner.close() for model in models.values()])
    os.close(lock)
    log.info(
        "engine stopped in %.1f s%s",
        time.monotonic() - stopping,
        "" if joined else " (a compute thread was still running)",
    )
    return 1 if left else 0
