"""The gRPC services of the public API: Inference (Generate, Complete) and CacheAdmin.

Thin on purpose: each RPC hands the request to the pipeline and turns a RequestError into the call's
status; nothing about caching, tokenizing or the engine is decided here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from appliance.cache.tiers import TierCascade
from appliance.errors import RequestError
from appliance.gateway.pipeline import Pipeline
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc


class InferenceService(pb_grpc.InferenceServicer):  # type: ignore[misc]
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self._active += 1
        self._idle.clear()
        try:
            async for message in self.pipeline.run(request, context.time_remaining()):
                yield message
        except RequestError as exc:
            if exc.retry_after_ms is not None:
                # gRPC's retry policy reads this trailer (gRFC A6) and waits as long before retrying.
                context.set_trailing_metadata(
                    (("grpc-retry-pushback-ms", str(exc.retry_after_ms)),)
                )
            await context.abort(exc.code, exc.message)
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

    async def wait_idle(self) -> None:
        await self._idle.wait()


class CacheAdminService(pb_grpc.CacheAdminServicer):  # type: ignore[misc]
    def __init__(self, cache: TierCascade | None) -> None:
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
            removed = await self._cache.invalidate(request.namespace, request.model)
        except Exception as exc:  # Redis down: say so; the in-process tier was still dropped
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"redis invalidation failed: {exc}")
        return pb.InvalidateResponse(
            l1_removed=removed.get("l1", 0), l2_removed=removed.get("l2", 0)
        )

    async def Stats(
        self, request: pb.CacheStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.CacheStatsResponse:
        counters = self._cache.counters() if self._cache is not None else {}
        return pb.CacheStatsResponse(counters=counters)
