"""Admission: whether a request may use the engine now, later, or not at all.

The pipeline asks for a Ticket after the cache lookup (a hit never needs the engine) and only for a
request that starts a generation (a single-flight follower rides on the leader's ticket). The ticket is
held for as long as the generation runs and released when it ends, however it ends.
"""

from __future__ import annotations

from typing import Protocol


class Ticket(Protocol):
    def release(self) -> None:
        """The generation ended; called exactly once."""
        ...


class Admission(Protocol):
    async def admit(self, model: str, prompt_tokens: int, max_tokens: int) -> Ticket:
        """A ticket once the request may start; raises RequestError when it may not."""
        ...


class _NoTicket:
    def release(self) -> None:
        return None


class AdmitAll:
    """Every request starts at once (the engine queues them itself)."""

    _ticket = _NoTicket()

    async def admit(self, model: str, prompt_tokens: int, max_tokens: int) -> Ticket:
        return self._ticket
