"""What a plan is made of: settings a plugin can apply, and advice an operator must act on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    """One setting. ``key`` is unique and stable so saved prior values survive re-planning."""

    plugin: str
    key: str
    target: str  # what the plugin writes: a path under the root, or a NIC spec
    desired: str
    reason: str


@dataclass(frozen=True)
class Advice:
    """A choice the tool does not apply itself (boot-time, hardware, or another issue's unit)."""

    topic: str
    text: str
    reason: str
