"""Huge pages reserved on the GPU's NUMA node only (pinned host buffers stay local)."""

from __future__ import annotations

from host_tuning.cores import CorePlan
from host_tuning.facts.model import Facts
from host_tuning.items import Advice, Item
from host_tuning.plugins.base import FilePlugin
from host_tuning.profile import Profile


class HugePages(FilePlugin):
    name = "hugepages"

    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        if profile.hugepages <= 0:
            return [], []
        kb = profile.hugepage_kb
        target = (
            f"/sys/devices/system/node/node{cores.node}/hugepages/hugepages-{kb}kB/nr_hugepages"
        )
        item = Item(
            self.name,
            f"hugepages node{cores.node} {profile.hugepage_size}",
            target,
            str(profile.hugepages),
            f"{profile.hugepages} x {profile.hugepage_size} on node {cores.node}, the GPU's node; "
            "runtime per-node reservation (boot-time hugepages= would split across nodes)",
        )
        advice = []
        if profile.hugepage_size == "1G":
            advice.append(
                Advice(
                    "hugepages",
                    "if verify shows fewer pages than asked, memory was fragmented: reboot with "
                    "the planned command line and apply early in boot",
                    "1 GiB pages need contiguous memory, which a long-running host may lack",
                )
            )
        return [item], advice

    def shortfall(self, item: Item, current: str | None) -> str | None:
        if current is None or not current.isdigit() or int(current) >= int(item.desired):
            return None
        return (
            f"the kernel reserved only {current} of {item.desired} pages: not enough free "
            "contiguous memory on the node; free memory and apply again, or reboot with the "
            "planned command line and apply early in boot"
        )
