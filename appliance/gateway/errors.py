"""The error a request ends with when the gateway refuses or cannot finish it.

Every stage raises RequestError with the gRPC status and a message that says what to fix; a front end
(the gRPC service, an HTTP API) turns it into its own status. Statuses are gRPC's because that is the
public API's vocabulary; no stage ever lets a request end in INTERNAL or UNKNOWN.
"""

from __future__ import annotations

import grpc

from appliance.backends.base import CONTEXT_LENGTH_EXCEEDED as CONTEXT_LENGTH_EXCEEDED


class RequestError(Exception):
    """A request the gateway refuses or cannot finish; carries the status the client gets."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        retry_after_ms: int | None = None,
        *,
        reason: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # When trying again later can succeed (overload): how long to wait, in milliseconds.
        self.retry_after_ms = retry_after_ms
        # What a program can branch on, in OpenAI's words (its error `code`): e.g.
        # "context_length_exceeded", "model_not_found"; None: the status says it all.
        self.reason = reason
        # The request field at fault (OpenAI's `param`), where one is.
        self.field = field


# Reasons a refusal names (OpenAI's error codes); an engine's refusal can say the first.
MODEL_NOT_FOUND = "model_not_found"


def invalid(message: str, *, reason: str | None = None, field: str | None = None) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, reason=reason, field=field)
