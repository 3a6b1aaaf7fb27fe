"""The error a request ends with when the gateway refuses or cannot finish it.

Every stage raises RequestError with the gRPC status and a message that says what to fix; a front end
(the gRPC service, an HTTP API) turns it into its own status. Statuses are gRPC's because that is the
public API's vocabulary; no stage ever lets a request end in INTERNAL or UNKNOWN.
"""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A request the gateway refuses or cannot finish; carries the status the client gets."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # When trying again later can succeed (overload): how long to wait, in milliseconds.
        self.retry_after_ms = retry_after_ms


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)
