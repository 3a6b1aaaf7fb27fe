"""A circuit breaker: stop calling a dependency that keeps failing, probe it again later.

Closed: calls go through; `threshold` consecutive failures open it. Open: calls are refused until
`reset_s` has passed. Half-open: one probe goes through; success closes, failure opens again.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(
        self, threshold: int, reset_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.threshold = threshold
        self.reset_s = reset_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False
        self.opened = 0  # times it opened (a metric)

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        return "half-open" if self._clock() - self._opened_at >= self.reset_s else "open"

    @property
    def probing(self) -> bool:
        """Half-open with its one probe let through and not yet back."""
        return self._probing

    def retry_in(self) -> float:
        """Seconds until a probe may go through (0 when closed or half-open)."""
        if self._opened_at is None:
            return 0.0
        return max(0.0, self.reset_s - (self._clock() - self._opened_at))

    def allow(self) -> bool:
        if self._opened_at is None:
            return True
        if self._clock() - self._opened_at < self.reset_s or self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._probing = False

    def release(self) -> None:
        """The probe let through ended without a verdict on the dependency (refused before it was
        sent, or a client's own error or cancellation): the next call may probe."""
        self._probing = False

    def abandoned(self) -> None:
        """A call let through ended without an outcome (cancelled): a probe counts as failed,
        any other call counts as nothing."""
        if self._probing:
            self.failure()

    def failure(self) -> None:
        self._failures += 1
        if self._probing or self._failures >= self.threshold:
            if self._opened_at is None or self._probing:
                self.opened += 1
            self._opened_at = self._clock()
            self._probing = False
