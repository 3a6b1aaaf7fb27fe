"""CPU frequency governor, energy/performance bias, intel_pstate floor (tuned latency-performance)."""

from __future__ import annotations

from host_tuning.cores import CorePlan
from host_tuning.facts.model import Facts
from host_tuning.items import Advice, Item
from host_tuning.plugins.base import Context, FilePlugin
from host_tuning.profile import Profile

SYS_CPU = "/sys/devices/system/cpu"
# energy_perf_bias reads back as a number even when written by name; plan and compare numbers.
EPB = {
    "performance": "0",
    "balance-performance": "4",
    "normal": "6",
    "balance-power": "8",
    "power": "15",
}


class Cpu(FilePlugin):
    name = "cpu"

    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        items: list[Item] = []
        advice: list[Advice] = []
        online = [c for c in facts.cpus if c.online]  # as tuned: an offline CPU is skipped
        if facts.cpufreq.get("governor_cpu0") is not None:
            for c in online:
                items.append(
                    Item(
                        self.name,
                        f"cpu{c.id} governor",
                        f"{SYS_CPU}/cpu{c.id}/cpufreq/scaling_governor",
                        profile.governor,
                        "tuned latency-performance: no frequency ramp-up after idle",
                    )
                )
        else:
            advice.append(
                Advice("cpu", "no cpufreq driver: set performance mode in firmware", "no sysfs")
            )
        if facts.cpufreq.get("energy_perf_bias_cpu0") is not None:
            value = EPB.get(profile.energy_perf_bias, profile.energy_perf_bias)
            for c in online:
                items.append(
                    Item(
                        self.name,
                        f"cpu{c.id} energy_perf_bias",
                        f"{SYS_CPU}/cpu{c.id}/power/energy_perf_bias",
                        value,
                        f"tuned latency-performance: energy bias {profile.energy_perf_bias}",
                    )
                )
        if facts.cpufreq.get("min_perf_pct") is not None:
            items.append(
                Item(
                    self.name,
                    "intel_pstate min_perf_pct",
                    f"{SYS_CPU}/intel_pstate/min_perf_pct",
                    "100",
                    "tuned latency-performance: P-state floor at 100% of max",
                )
            )
        return items, advice

    def unoffered(self, ctx: Context, item: Item) -> str | None:
        """A governor missing from ``scaling_available_governors`` is skipped, as tuned does:
        the kernel refuses it with EINVAL, so writing it would fail at every apply."""
        if not item.target.endswith("/scaling_governor"):
            return None
        offered_path = item.target.rsplit("/", 1)[0] + "/scaling_available_governors"
        offered = (ctx.root.read_value(offered_path) or "").split()
        if not offered or item.desired in offered:
            return None  # no list (older drivers): the write and its read-back decide
        return (
            f"governor {item.desired} not offered by this kernel's cpufreq driver "
            f"(scaling_available_governors: {' '.join(offered)}); not written"
        )


class PmQos(FilePlugin):
    """Per-CPU resume-latency limit on serving CPUs: a persistent sysfs form of PM QoS.

    The global ``/dev/cpu_dma_latency`` request lasts only while its file stays open, so it is held
    by ``host-tune hold-latency``; the per-CPU attribute holds by itself and touches only the cores
    that serve, leaving housekeeping cores free to sleep deeply.
    """

    name = "pmqos"

    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        us = profile.pm_qos_latency_us
        items = [
            Item(
                self.name,
                f"cpu{c} pm_qos_resume_latency_us",
                f"{SYS_CPU}/cpu{c}/power/pm_qos_resume_latency_us",
                str(us),
                f"serving CPU: idle states with exit latency above {us} µs are not used",
            )
            for c in cores.serving
        ]
        advice = [
            Advice(
                "pmqos",
                f"run `host-tune hold-latency --us {us}` as a service (holds /dev/cpu_dma_latency)",
                "a PM QoS request written to /dev/cpu_dma_latency ends when the file is closed",
            )
        ]
        return items, advice
