"""CPU partitioning beyond the kernel command line: unbound workqueues and every service's default
CPU affinity stay on housekeeping CPUs.

The serving cores are isolated without ``isolcpus=domain`` (see the cmdline plugin): the gateway's
and Triton's threads must be load-balanced across their own cores, and ``domain`` would pin each
thread to the core it first ran on. What ``domain`` used to keep away is kept away here instead,
as tuned's cpu-partitioning profile does: the unbound-workqueue cpumasks (``[sysfs]``) and
systemd's default ``CPUAffinity=`` for every unit (``[systemd] cpu_affinity``); the appliance's own
units override it with their serving cores in their drop-ins.
"""

from __future__ import annotations

from host_tuning import cpulist
from host_tuning.cores import CorePlan
from host_tuning.facts.cpu import online
from host_tuning.facts.model import Facts
from host_tuning.items import Advice, Item
from host_tuning.plugins.base import Context, FilePlugin
from host_tuning.profile import Profile

WORKQUEUE_MASKS = (
    "/sys/devices/virtual/workqueue/cpumask",
    "/sys/bus/workqueue/devices/writeback/cpumask",
)
SYSTEMD_DROPIN = "/etc/systemd/system.conf.d/99-host-tune.conf"
_SYSTEMD_HEADER = "# Written by host-tune; `host-tune revert` removes it.\n[Manager]\n"


class Workqueue(FilePlugin):
    """Kernel attributes: absent on a kernel without them means unsupported, not a failure."""

    name = "workqueue"

    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        if not (profile.isolate and cores.isolated):
            return [], []
        mask = cpulist.format_mask(cores.housekeeping, len(facts.cpus))
        why = (
            "tuned cpu-partitioning: unbound kernel work (writeback, flushes) runs on "
            "housekeeping CPUs, never on serving cores"
        )
        name = {WORKQUEUE_MASKS[0]: "workqueue cpumask", WORKQUEUE_MASKS[1]: "writeback cpumask"}
        return [Item(self.name, name[path], path, mask, why) for path in WORKQUEUE_MASKS], []

    def same(self, item: Item, current: str | None) -> bool:
        return current is not None and cpulist.parse_mask(current) == cpulist.parse_mask(
            item.desired
        )


class SystemdAffinity(FilePlugin):
    """A systemd.conf drop-in; the manager reads it at boot (or ``systemctl daemon-reexec``)."""

    name = "systemd"
    owns_files = True

    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        if not (profile.isolate and cores.isolated):
            return [], []
        item = Item(
            self.name,
            "systemd default CPUAffinity",
            SYSTEMD_DROPIN,
            cpulist.format(cores.housekeeping),
            "tuned cpu-partitioning: services run on housekeeping CPUs unless their unit "
            "says otherwise (gateway and Triton have their own CPUAffinity= drop-ins)",
        )
        return [item], []

    def current(self, ctx: Context, item: Item) -> str | None:
        for line in (ctx.root.read(item.target) or "").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "CPUAffinity":
                return value.strip()
        return None

    def same(self, item: Item, current: str | None) -> bool:
        # A hand-edited value that is no CPU list is drift to rewrite.
        try:
            return current is not None and cpulist.parse(current) == cpulist.parse(item.desired)
        except ValueError:
            return False

    def set(self, ctx: Context, item: Item) -> list[str]:
        return ctx.root.create(item.target, f"{_SYSTEMD_HEADER}CPUAffinity={item.desired}\n")

    def pending(self, ctx: Context, item: Item) -> str | None:
        # PID 1's own affinity is the manager default once it has (re)read its configuration.
        status = ctx.root.read("/proc/1/status") or ""
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                running = cpulist.parse(line.split(":", 1)[1])
                wanted = cpulist.parse(item.desired)
                # The kernel leaves offline CPUs out of a task's allowed CPUs.
                if running in (wanted, wanted & online(ctx.root)):
                    return None
                return "systemctl daemon-reexec (or reboot) required: PID 1 still runs on " + (
                    cpulist.format(running)
                )
        return None
