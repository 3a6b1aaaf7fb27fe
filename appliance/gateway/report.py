"""The facts of one finished request, reported once to a sink (metrics, an access log).

The pipeline fills a RequestReport as the request passes its stages and hands it to the sink when the
request ends, whatever way it ends; sinks must be cheap (they run on the event loop) and never raise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger("appliance.requests")


@dataclass(slots=True)
class RequestReport:
    request_id: str = ""
    namespace: str = ""
    model: str = ""
    # Which model produced the answer: differs from `model` when a fallback answered.
    answered_by: str = ""
    # "miss" (generated), or the cache tier that answered ("l1", "l2", ...).
    tier: str = "miss"
    # A semantic hit: the similarity of the two questions and the answering entry's key (hex).
    similarity: float = 0.0
    cache_entry: str = ""
    # gRPC status name the request ended with: "OK", "INVALID_ARGUMENT", "CANCELLED", ...
    status: str = "OK"
    # "stop", "length", "cancelled", or "" when the request failed.
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Microseconds from arrival at the gateway.
    queue_us: int = 0
    ttft_us: int = 0
    total_us: int = 0
    # Gaps between consecutive messages with tokens, as the client receives them.
    inter_token_us: list[int] = field(default_factory=list)


class ReportSink(Protocol):
    def report(self, r: RequestReport) -> None: ...


class DebugLogSink:
    """One debug line per request (the access log proper lives with the metrics)."""

    def report(self, r: RequestReport) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %r model=%s tier=%s status=%s finish=%s tokens=%d/%d ttft_us=%d total_us=%d",
                r.request_id,
                r.model,
                r.tier,
                r.status,
                r.finish_reason,
                r.prompt_tokens,
                r.completion_tokens,
                r.ttft_us,
                r.total_us,
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
