"""The facts of one finished request, reported once to a sink (metrics, an access log).

The pipeline fills a RequestReport as the request passes its stages and hands it to the sink when the
request ends, whatever way it ends; sinks must be cheap (they run on the event loop) and never raise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

access = logging.getLogger("appliance.access")

# The model of a request refused before its model was known (an unknown name, a body that was not
# a request, a key refused first): in the access log and the metrics' `model` label, never the
# name the client sent.
UNKNOWN_MODEL = "unknown"


@dataclass(slots=True)
class RequestReport:
    request_id: str = ""
    # Which front end received it: "grpc" (the Inference service) or "http" (the OpenAI API).
    front_end: str = "grpc"
    # The API key's id (never the key): "anonymous" without keys; "" when none was presented.
    key_id: str = ""
    namespace: str = ""
    # The served model the request named (UNKNOWN_MODEL until it is routed).
    model: str = UNKNOWN_MODEL
    # Which model produced the answer: differs from `model` when a fallback answered.
    answered_by: str = ""
    # "miss" (generated), or the cache tier that answered ("l1", "l2", ...).
    tier: str = "miss"
    # The key (hex) the answer is cached under: of the answering entry for a hit (another request's
    # for a semantic one, with the two questions' similarity: None where no tier judged one), of
    # this request's answer for a cacheable miss; "" when it is not cached.
    similarity: float | None = None
    cache_entry: str = ""
    # A lookup that overlapped the engine's start: "missed" (the generation answers); on a hit,
    # what became of the generation: "cancelled", "unstarted" (cancelled before its first step),
    # "shared" (others follow it), "ended" (finished or failed before the hit), "failed" (it could
    # not start). "" when no lookup overlapped.
    overlap: str = ""
    # It followed a generation another request led (a single-flight follower).
    followed: bool = False
    # gRPC status name the request ended with: "OK", "INVALID_ARGUMENT", "CANCELLED", ...
    status: str = "OK"
    # On DEADLINE_EXCEEDED only, whose deadline passed: "client" (it set one) or "model" (it set
    # none: the model's default_deadline_s, the server's failure); "" on any other outcome.
    deadline: str = ""
    # "stop", "length", "cancelled", or "" when the request failed.
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens of a generated answer the engine took from its prefix cache (0 for a cached
    # answer: no engine read its prompt).
    cached_tokens: int = 0
    # Speculative decoding of a generated answer: draft tokens proposed, and accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # Microseconds from arrival at the gateway.
    queue_us: int = 0
    ttft_us: int = 0
    total_us: int = 0
    # Gaps between consecutive messages with tokens, as the client receives them.
    inter_token_us: list[int] = field(default_factory=list)


class ReportSink(Protocol):
    def report(self, r: RequestReport) -> None: ...


def _with_extras(line: str) -> dict[tuple[bool, bool, bool], str]:
    """The access line's format by (a semantic hit, an entry named, a deadline named)."""
    return {
        (semantic, named, deadline): line
        + (" similarity=%.3f" if semantic else "")
        + (" cache_entry=%s" if named else "")
        + (" deadline=%s" if deadline else "")
        for semantic in (False, True)
        for named in (False, True)
        for deadline in (False, True)
    }


class AccessLog:
    """One INFO line per finished request on the `appliance.access` logger.

    The client's values are written with repr(), which quotes them and escapes every control
    character, so a request id cannot start a forged line. The report rides on the record as
    `access`, so a JSON formatter writes its fields as fields."""

    FORMAT = (
        "front_end=%s request_id=%r key_id=%r namespace=%r model=%r answered_by=%r tier=%s overlap=%s status=%s finish_reason=%s "
        "prompt_tokens=%d completion_tokens=%d queue_ms=%.3f ttft_ms=%.3f total_ms=%.3f"
    )

    # What an audit of a wrong answer needs: the key `appliance cache invalidate --entry` takes
    # (of a cached or cacheable answer), and a semantic hit's similarity; on DEADLINE_EXCEEDED,
    # whose deadline passed. Keyed by (a semantic hit, an entry named, a deadline named).
    FORMATS: ClassVar[dict[tuple[bool, bool, bool], str]] = _with_extras(FORMAT)

    def report(self, r: RequestReport) -> None:
        if not access.isEnabledFor(logging.INFO):
            return
        semantic, named, deadline = r.similarity is not None, bool(r.cache_entry), bool(r.deadline)
        args: tuple[object, ...] = (
            r.front_end,
            r.request_id,
            r.key_id,
            r.namespace,
            r.model,
            r.answered_by,
            r.tier,
            r.overlap or "-",
            r.status,
            r.finish_reason,
            r.prompt_tokens,
            r.completion_tokens,
            r.queue_us / 1000,
            r.ttft_us / 1000,
            r.total_us / 1000,
        )
        if semantic:
            args = (*args, r.similarity)
        if named:
            args = (*args, r.cache_entry)
        if deadline:
            args = (*args, r.deadline)
        # The record goes to the handlers as Logger.info would send it, less the caller lookup
        # (a walk up the stack for a file and line that no access-line format shows). The line
        # itself is formatted by a handler, so nothing is built when none takes it.
        access.handle(
            access.makeRecord(
                access.name,
                logging.INFO,
                __file__,
                0,
                self.FORMATS[semantic, named, deadline],
                args,
                None,
                "report",
                {"access": r},
            )
        )


def admin_call(
    method: str,
    key_id: str,
    namespace: str,
    model: str,
    everything: bool,
    status: str,
    outcome: str,
) -> None:
    """One INFO line per CacheAdmin call on `appliance.access`, whatever `access_log` says: who
    invalidated what is an audit record."""
    access.info(
        "admin method=%s key_id=%r namespace=%r model=%r all=%s status=%s %s",
        method,
        key_id,
        namespace,
        model,
        everything,
        status,
        outcome,
    )


class Sinks:
    """Several sinks as one; one that raises is logged and the others still get the report."""

    def __init__(self, *sinks: ReportSink) -> None:
        self.sinks = sinks

    def report(self, r: RequestReport) -> None:
        for sink in self.sinks:
            try:
                sink.report(r)
            except Exception:
                logging.getLogger(__name__).exception("report sink %r failed", sink)
