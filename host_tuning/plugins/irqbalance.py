"""irqbalance's banned CPU list, so it never moves interrupts onto isolated cores."""

from __future__ import annotations

import re

from host_tuning import cpulist
from host_tuning.cores import CorePlan
from host_tuning.facts import system
from host_tuning.facts.model import Facts
from host_tuning.items import Advice, Item
from host_tuning.plugins.base import Context, FilePlugin
from host_tuning.profile import Profile

VAR = "IRQBALANCE_BANNED_CPULIST"


def set_var(text: str, var: str, value: str) -> str:
    """Replace (every assignment: a shell takes the last) or append ``VAR="value"`` in a shell
    environment file, keeping everything else."""
    line = f'{var}="{value}"'
    pattern = re.compile(rf"^\s*{re.escape(var)}=.*$", re.MULTILINE)
    if pattern.search(text):
        return pattern.sub(line, text)
    if text and not text.endswith("\n"):
        text += "\n"
    return text + line + "\n"


class Irqbalance(FilePlugin):
    name = "irqbalance"
    owns_files = True

    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        banned = tuple(sorted(set(cores.isolated) | set(cores.nic_irq)))
        if not banned:
            return [], []
        path = str(facts.irqbalance.get("config") or system.IRQBALANCE_CONFIGS[0])
        item = Item(
            self.name,
            "irqbalance banned cpus",
            path,
            cpulist.format(banned),
            "tuned cpu-partitioning: irqbalance must not spread IRQs onto isolated or NIC cores",
        )
        advice = []
        if facts.irqbalance.get("running"):
            advice.append(
                Advice(
                    "irqbalance",
                    "restart irqbalance after apply/revert (systemctl restart irqbalance; the "
                    "host_tuning role does it when the list changed, and at boot "
                    "appliance-host-tune.service runs before irqbalance.service)",
                    "irqbalance reads its banned list only at start",
                )
            )
        return [item], advice

    def current(self, ctx: Context, item: Item) -> str | None:
        return system.env_var(ctx.root.read(item.target), VAR)

    def same(self, item: Item, current: str | None) -> bool:
        # The operator's file: a value that is no CPU list ("$VAR", a typo) is drift to rewrite.
        try:
            return current is not None and cpulist.parse(current) == cpulist.parse(item.desired)
        except ValueError:
            return False

    def set(self, ctx: Context, item: Item) -> list[str]:
        text = ctx.root.read(item.target) or ""
        return ctx.root.create(item.target, set_var(text, VAR, item.desired))
