"""Transparent huge pages: ``never`` so khugepaged and compaction stop stealing serving time."""

from __future__ import annotations

from host_tuning.cores import CorePlan
from host_tuning.facts.model import Facts
from host_tuning.facts.system import THP
from host_tuning.items import Advice, Item
from host_tuning.plugins.base import Context, FilePlugin
from host_tuning.profile import Profile
from host_tuning.rootfs import selected


class Thp(FilePlugin):
    name = "thp"

    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        why = "tuned network-latency: THP compaction and khugepaged stalls add tail latency"
        return [
            Item(self.name, f"thp {k}", f"{THP}/{k}", profile.thp, why)
            for k in ("enabled", "defrag")
        ], []

    def current(self, ctx: Context, item: Item) -> str | None:
        return selected(ctx.root.read(item.target))

    def restore_value(self, snapshot: str) -> str:
        # The kernel takes the bare choice and shows all options with the choice bracketed.
        return (selected(snapshot) or "") + "\n"
