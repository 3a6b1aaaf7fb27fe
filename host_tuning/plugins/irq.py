"""Interrupt affinity: serving-NIC vectors to the NIC cores, other device IRQs to housekeeping.

Managed IRQs (NVMe queues, some NIC drivers) refuse affinity writes with EIO; host_tuning.actions
records them as managed and skipped. ``isolcpus=managed_irq`` in the planned command line is what keeps
those off isolated cores after reboot. Vectors of NICs the profile does not name are not touched:
one of them is the management NIC.
"""

from __future__ import annotations

from host_tuning import cpulist
from host_tuning.cores import CorePlan
from host_tuning.facts.model import Facts
from host_tuning.items import Advice, Item
from host_tuning.plugins.base import FilePlugin
from host_tuning.profile import Profile


def target(irq: int) -> str:
    return f"/proc/irq/{irq}/smp_affinity_list"


class Irq(FilePlugin):
    name = "irq"

    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        items: list[Item] = []
        hk = cpulist.format(cores.housekeeping)
        nic_irqs: dict[int, tuple[str, str]] = {}
        unnamed: set[int] = set()
        for nic in facts.nics:
            if nic.name not in profile.nics:
                unnamed.update(nic.irqs)
                continue
            vectors = list(nic.irqs)
            if vectors and nic.driver == "mlx5_core" and profile.skip_first_mlx5_vector:
                # The first mlx5 vector is the async/command EQ, not a data queue (mlnx-tools
                # skips it too): it goes with the housekeeping IRQs.
                nic_irqs[vectors[0]] = (hk, f"{nic.name} async/command vector: housekeeping")
                vectors = vectors[1:]
            dest = cpulist.format(cores.nic_irq or cores.housekeeping)
            for v in vectors:
                nic_irqs[v] = (dest, f"{nic.name} queue vector on NIC cores of node {cores.node}")
        for irq in facts.irqs:
            if irq.affinity is None or irq.number in unnamed:
                continue
            dest, why = nic_irqs.get(
                irq.number, (hk, f"device IRQ ({irq.actions or '?'}) kept off serving cores")
            )
            items.append(Item(self.name, f"irq {irq.number}", target(irq.number), dest, why))
        ncpus = max((c.id for c in facts.cpus), default=0) + 1
        items.append(
            Item(
                self.name,
                "irq default_smp_affinity",
                "/proc/irq/default_smp_affinity",
                cpulist.format_mask(cores.housekeeping, ncpus),
                "IRQs registered later start on housekeeping cores",
            )
        )
        return items, []

    def same(self, item: Item, current: str | None) -> bool:
        if current is None:
            return False
        try:
            if item.target.endswith("default_smp_affinity"):
                return cpulist.parse_mask(current) == cpulist.parse_mask(item.desired)
            return cpulist.parse(current) == cpulist.parse(item.desired)
        except ValueError:
            return False
