"""The gRPC services of the public API: Inference (Generate, Complete) and CacheAdmin.

Thin on purpose: each RPC translates the request (messages.py), hands it with the caller's
credentials (the `authorization` metadata, the client certificate's names under mutual TLS) to the
pipeline, translates the replies back and turns a RequestError into the call's status; nothing
about keys, caching, tokenizing, the engine or reading a tool call out of an answer is decided
here (the pipeline's Final carries the call; the text streams as generated).

With keys configured, every method is gated (grpc_methods.add_service): what access control can
judge from the call's metadata alone (the key, its rate, that it may call the method at all, a
key's requests open at once) is checked before the request message is read, so a caller without a
valid key is refused UNAUTHENTICATED, and its stream closed, before its message is read (even one
over the receive limit, which a caller with a key gets RESOURCE_EXHAUSTED for); the scope and
namespace the message names are checked once it is read, before it is translated.
"""

from __future__ import annotations

import asyncio
import string
import time
from collections.abc import AsyncIterator

import grpc

from appliance import namespace as namespaces
from appliance.cache.tiers import TierCascade
from appliance.gateway import grpc_methods, messages, report
from appliance.gateway.errors import RequestError
from appliance.gateway.generation import Delta
from appliance.gateway.pipeline import Pipeline, scope_of
from appliance.gateway.request import MAX_MODEL_NAME_LENGTH, IncomingRequest
from appliance.security.auth import (
    CACHE_ONLY,
    GENERATE,
    AccessControl,
    Credentials,
    Grant,
    bearer_token,
)
from appliance.security.tls import grpc_peer_names
from appliance.v1 import inference_pb2 as pb
from appliance.v1 import inference_pb2_grpc as pb_grpc


def credentials(context: grpc.aio.ServicerContext, mutual_tls: bool) -> Credentials:
    """What the call presents; the certificate's names are read only when no key is sent."""
    bearer = None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            bearer = bearer_token(value) if isinstance(value, str) else None
            if bearer is None:
                bearer = ""  # present but not a Bearer token: an invalid key, not no key
            break
    if bearer is None and mutual_tls:
        return Credentials(None, grpc_peer_names(context))
    return Credentials(bearer)


def _set_pushback(context: grpc.aio.ServicerContext, exc: RequestError) -> None:
    if exc.retry_after_ms is not None:
        # gRPC's retry policy reads this trailer (gRFC A6) and waits as long before retrying.
        context.set_trailing_metadata((("grpc-retry-pushback-ms", str(exc.retry_after_ms)),))


def _detached(exc: RequestError) -> RequestError:
    """The refusal without its traceback and chain, to abort the call with: the error abort
    raises has the refusal as its context and stays in a reference cycle with grpc's frames, and
    the refusal's traceback holds the pipeline's frames and what they hold (a refused prompt's
    token ids, the checked request), which a garbage collection would then free on the event
    loop, during whatever request triggers it."""
    exc.__traceback__ = None
    exc.__cause__ = exc.__context__ = None
    return exc


def _admitted() -> Grant | None:
    """The grant the method's gate gave the call (None: the servicer was called ungated)."""
    grant = grpc_methods.held()
    assert grant is None or isinstance(grant, Grant)
    return grant


def key_gate(access: AccessControl, mutual_tls: bool) -> grpc_methods.Gate:
    """A gate that lets through a call with a known key (any scope) and takes one request of its
    rate; with no keys configured, every call."""

    async def gate(method: str, context: grpc.aio.ServicerContext) -> Grant:
        try:
            return access.admit_key(credentials(context, mutual_tls))
        except RequestError as exc:
            _set_pushback(context, exc)
            await context.abort(exc.code, exc.message)
            raise  # abort raises; this line is never reached

    return gate


def entry_key(request: pb.InvalidateRequest) -> bytes | None:
    """The one cached answer an Invalidate names (None: every answer that matches); a request that
    names it, its namespace or its model wrongly is refused with what to fix."""
    if (problem := namespaces.problem(request.namespace)) is not None:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"namespace {problem}")
    if len(request.model) > MAX_MODEL_NAME_LENGTH:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"model is longer than {MAX_MODEL_NAME_LENGTH} characters",
        )
    if not request.entry:
        return None
    if request.all:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT, "entry names one answer: give it without all=true"
        )
    if not request.namespace:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "entry needs the namespace of the request it answered",
        )
    if len(request.entry) != 32 or not all(c in string.hexdigits for c in request.entry):
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "entry must be a cache key of 32 hex digits (an answer's cache_entry), "
            f"got {request.entry[:40]!r}",
        )
    return bytes.fromhex(request.entry)


class InferenceService(pb_grpc.InferenceServicer):  # type: ignore[misc]
    def __init__(self, pipeline: Pipeline, mutual_tls: bool = False) -> None:
        self.pipeline = pipeline
        self.mutual_tls = mutual_tls
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def before_read(self, method: str, context: grpc.aio.ServicerContext) -> Grant:
        """The gate of Generate and Complete: the key, its rate, a scope to generate with and
        its requests open at once (this one counted), from the metadata; a refusal ends the call
        before its message is read (the access log has no namespace for it)."""
        received = time.monotonic_ns()
        presented = credentials(context, self.mutual_tls)
        try:
            return self.pipeline.access.admit(presented, (GENERATE, CACHE_ONLY))
        except RequestError as exc:
            self.pipeline.refused("grpc", exc.code.name, received, presented.claimed_key_id())
            _set_pushback(context, exc)
            await context.abort(exc.code, exc.message)
            raise  # abort raises; this line is never reached

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self._begin()
        grant = _admitted()
        try:
            presented = credentials(context, self.mutual_tls)
            incoming, grant = self._incoming(request, presented, grant)
            replies = self.pipeline.run(
                incoming, context.time_remaining(), presented, admitted=grant
            )
            request_id = incoming.request_id
            async for reply in replies:
                if isinstance(reply, Delta):
                    yield messages.delta(request_id, reply)
                else:
                    yield messages.final(reply)
        except RequestError as exc:
            _set_pushback(context, exc)
            await context.abort(exc.code, _detached(exc).message)
        finally:
            if grant is not None:
                grant.release()  # the pipeline's, done already unless its replies were left
            self._end()

    async def Complete(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompleteResponse:
        """Generate's replies gathered into one message."""
        text: list[str] = []
        reply = pb.CompleteResponse()
        self._begin()
        grant = _admitted()
        try:
            presented = credentials(context, self.mutual_tls)
            incoming, grant = self._incoming(request, presented, grant)
            reply.request_id = incoming.request_id
            deadline_s = context.time_remaining()
            async for part in self.pipeline.run(incoming, deadline_s, presented, admitted=grant):
                if isinstance(part, Delta):
                    text.append(part.text)
                    reply.token_ids.extend(part.token_ids)
                    if part.logprobs is not None:
                        messages.add_logprobs(reply.logprobs, part)
                else:
                    messages.fill_final(reply.final, part)
        except RequestError as exc:
            _set_pushback(context, exc)
            await context.abort(exc.code, _detached(exc).message)
        finally:
            if grant is not None:
                grant.release()
            self._end()
        reply.text = "".join(text)
        return reply

    def _incoming(
        self, request: pb.GenerateRequest, presented: Credentials, admitted: Grant | None
    ) -> tuple[IncomingRequest, Grant]:
        """The message in the pipeline's terms, and the caller's grant; a refusal here is
        reported as the pipeline's. All of access control (on the gate's grant: the scope its
        cache_policy needs, its namespace, fields read as they are) comes before any of the
        message is translated (its tools and chat cost work to read)."""
        received = time.monotonic_ns()
        grant = admitted
        try:
            if grant is None:
                grant = self.pipeline.access.authorize(
                    presented, request.namespace, scope_of(request.cache_policy)
                )
            else:
                self.pipeline.access.permit(
                    grant, request.namespace, scope_of(request.cache_policy)
                )
            return messages.request_of(request), grant
        except RequestError as exc:
            key_id = presented.claimed_key_id() if grant is None else grant.key_id
            if grant is not None:
                grant.release()
            self.pipeline.refused("grpc", exc.code.name, received, key_id, request.namespace)
            raise

    def _begin(self) -> None:
        self._active += 1
        self._idle.clear()

    def _end(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


class CacheAdminService(pb_grpc.CacheAdminServicer):  # type: ignore[misc]
    """Needs the `admin` scope; every call, refused or not, is an access-log line."""

    def __init__(
        self,
        cache: TierCascade | None,
        access: AccessControl | None = None,
        mutual_tls: bool = False,
    ) -> None:
        self._cache = cache
        self._access = access or AccessControl()
        self._mutual_tls = mutual_tls
        # Invalidations whose caller went away (deadline, cancel) and that still run to the end.
        self._invalidating: set[asyncio.Task[dict[str, int]]] = set()

    def _invalidated(self, work: asyncio.Task[dict[str, int]]) -> None:
        """Its failure retrieved: the caller may be gone (the cascade has logged what it did)."""
        self._invalidating.discard(work)
        if not work.cancelled():
            work.exception()

    async def before_read(self, method: str, context: grpc.aio.ServicerContext) -> Grant:
        """The gate of every CacheAdmin call: the key, its rate and the `admin` scope, from the
        metadata; a refusal ends the call before its message is read."""
        presented = credentials(context, self._mutual_tls)
        try:
            return self._access.admit_admin(presented)
        except RequestError as exc:
            report.admin_call(
                method, presented.claimed_key_id(), "", "", False, exc.code.name, "refused"
            )
            _set_pushback(context, exc)
            await context.abort(exc.code, exc.message)
            raise  # abort raises; this line is never reached

    async def _admit(
        self, method: str, request: pb.InvalidateRequest | None, context: grpc.aio.ServicerContext
    ) -> str:
        """The caller's key id once the namespace the message names is allowed too; else the call
        ends here."""
        presented = credentials(context, self._mutual_tls)
        namespace = request.namespace if request is not None else ""
        model = request.model if request is not None else ""
        everything = request.all if request is not None else False
        try:
            grant = _admitted()
            if grant is None:
                return self._access.authorize_admin(presented, namespace).key_id
            self._access.permit_admin(grant, namespace)
            return grant.key_id
        except RequestError as exc:
            report.admin_call(
                method,
                presented.claimed_key_id(),
                namespace[:64],
                model[:64],
                everything,
                exc.code.name,
                "refused",
            )
            _set_pushback(context, exc)
            await context.abort(exc.code, exc.message)
            raise  # abort raises; this line is never reached

    async def Invalidate(
        self, request: pb.InvalidateRequest, context: grpc.aio.ServicerContext
    ) -> pb.InvalidateResponse:
        key_id = await self._admit("Invalidate", request, context)
        if self._cache is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the cache is disabled")
        assert self._cache is not None
        if not (request.namespace or request.model or request.all):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "name a namespace, a model or both; set all=true to drop every cached answer",
            )
        try:
            entry = entry_key(request)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)
        audit = (key_id, request.namespace, request.model, request.all)
        # Shielded: a caller that gives up (its deadline passes during a long unlink) must not
        # leave Redis half unlinked and the other gateways unannounced.
        work = asyncio.ensure_future(
            self._cache.invalidate(request.namespace, request.model, entry)
        )
        self._invalidating.add(work)
        work.add_done_callback(self._invalidated)
        try:
            removed = await asyncio.shield(work)
        except Exception as exc:  # Redis down: say so; the in-process tier was still dropped
            why = str(exc) or type(exc).__name__
            report.admin_call("Invalidate", *audit, "UNAVAILABLE", f"error={why:.200}")
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"redis invalidation failed: {why}")
        counts = {f"{tier}_removed": removed.get(tier, 0) for tier in ("l1", "l2", "semantic")}
        what = " ".join(f"{name}_removed={n}" for name, n in removed.items())
        report.admin_call(
            "Invalidate", *audit, "OK", what if entry is None else f"entry={entry.hex()} {what}"
        )
        return pb.InvalidateResponse(**counts, removed=removed)

    async def Stats(
        self, request: pb.CacheStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.CacheStatsResponse:
        key_id = await self._admit("Stats", None, context)
        report.admin_call("Stats", key_id, "", "", False, "OK", "")
        counters = self._cache.counters() if self._cache is not None else {}
        return pb.CacheStatsResponse(counters=counters)
