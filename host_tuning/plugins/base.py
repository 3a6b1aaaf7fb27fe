"""The contract every plugin meets, and the file-backed implementation most of them share.

``host_tuning.actions`` owns ordering, saved prior values and reporting; a plugin only
knows how to read, compare, set and restore its own kind of setting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from host_tuning.cores import CorePlan
from host_tuning.facts.model import Facts
from host_tuning.items import Advice, Item
from host_tuning.profile import Profile
from host_tuning.rootfs import Root


@dataclass(frozen=True)
class Context:
    root: Root
    netns: str | None = None


class Plugin(ABC):
    name: str = ""
    #: False for kernel attributes (absent means unsupported here); True for files the tool owns.
    owns_files: bool = False

    @property
    def persistent(self) -> bool:
        """True when a setting survives a reboot (the files under /etc the tool writes); False for
        runtime kernel state, which the kernel starts afresh at each boot."""
        return self.owns_files

    @abstractmethod
    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        """Pure: the settings and advice for this subsystem."""

    @abstractmethod
    def snapshot(self, ctx: Context, item: Item) -> str | None:
        """Raw prior state to save before the first change (None: absent)."""

    @abstractmethod
    def current(self, ctx: Context, item: Item) -> str | None:
        """Current value in the same form as ``item.desired`` (None: absent/unsupported)."""

    def same(self, item: Item, current: str | None) -> bool:
        return current is not None and current.strip() == item.desired.strip()

    @abstractmethod
    def set(self, ctx: Context, item: Item) -> list[str]:
        """Make the desired value true; answer directories created (removed again on revert)."""

    @abstractmethod
    def restore(self, ctx: Context, target: str, snapshot: str | None) -> None:
        """Put the saved raw state back."""

    def unoffered(self, ctx: Context, item: Item) -> str | None:
        """Why the kernel does not offer ``item.desired`` here (it is then not written), or None."""
        return None

    def shortfall(self, item: Item, current: str | None) -> str | None:
        """Why the kernel holds ``current`` rather than the value written, when it is known."""
        return None

    def pending(self, ctx: Context, item: Item) -> str | None:
        """Why an applied setting is not yet in effect (e.g. reboot required), or None."""
        return None

    def restored_pending(self, ctx: Context, key: str, target: str) -> str | None:
        """Why a restored setting is not yet back in effect (e.g. reboot required), or None."""
        return None


class FilePlugin(Plugin):
    """Settings that are one kernel attribute or file each; ``item.target`` is its path."""

    def snapshot(self, ctx: Context, item: Item) -> str | None:
        return ctx.root.read(item.target)

    def current(self, ctx: Context, item: Item) -> str | None:
        return ctx.root.read_value(item.target)

    def set(self, ctx: Context, item: Item) -> list[str]:
        if self.owns_files:
            return ctx.root.create(item.target, item.desired + "\n")
        ctx.root.write(item.target, item.desired + "\n")
        return []

    def restore_value(self, snapshot: str) -> str:
        """What to write so the attribute reads back as ``snapshot`` (identity for most)."""
        return snapshot

    def restore(self, ctx: Context, target: str, snapshot: str | None) -> None:
        if snapshot is None:
            if self.owns_files:
                ctx.root.remove(target)
            return
        if self.owns_files:
            ctx.root.create(target, snapshot)
        else:
            ctx.root.write(target, self.restore_value(snapshot))
