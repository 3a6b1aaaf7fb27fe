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
class Conflict:
    """A kernel parameter host-tune did not write that disagrees with the plan's core split."""

    param: str  # isolcpus, nohz_full
    source: str  # /proc/cmdline (the running kernel) or the bootloader file that sets it
    token: str  # as found: isolcpus=domain,1-3
    found: str  # its CPUs in list form ("" when none or unreadable)
    wanted: str  # the plan's CPUs for the parameter ("" when the plan isolates none)
    text: str  # one line for the operator: which cores, what the plan wants, what to do


@dataclass(frozen=True)
class Advice:
    """A choice the tool does not apply itself (boot-time, hardware, or another issue's unit)."""

    topic: str
    text: str
    reason: str
