"""sysctls of tuned's latency-performance and network-latency profiles (via /proc/sys)."""

from __future__ import annotations

from host_tuning.cores import CorePlan
from host_tuning.facts.model import Facts
from host_tuning.items import Advice, Item
from host_tuning.plugins.base import FilePlugin
from host_tuning.profile import Profile, is_sched_sysctl, sysctl_path

# key -> (value, reason). Never kernel.sched_*: moved to debugfs in 5.13, renamed in 6.6.
DEFAULTS: dict[str, tuple[str, str]] = {
    "vm.swappiness": ("10", "tuned latency-performance: keep serving memory resident"),
    "net.core.busy_read": ("50", "tuned network-latency: busy-poll sockets 50 µs before sleeping"),
    "net.core.busy_poll": ("50", "tuned network-latency: busy-poll in poll/select for 50 µs"),
    "net.ipv4.tcp_fastopen": ("3", "tuned network-latency: TFO for client and server saves an RTT"),
    "kernel.numa_balancing": ("0", "tuned network-latency: no page migration under the GPU feeder"),
    "kernel.nmi_watchdog": ("0", "tuned network-latency: no periodic NMI on serving cores"),
    "vm.stat_interval": ("10", "tuned network-latency: vmstat work every 10 s, not every 1 s"),
    "kernel.timer_migration": (
        "0",
        "tuned network-latency: timers stay on the CPU that armed them",
    ),
}


class Sysctl(FilePlugin):
    name = "sysctl"

    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        chosen = {k: v for k, v in DEFAULTS.items()}
        for key, value in profile.sysctl.items():
            # A default named in the other spelling (vm/swappiness) is the same file: one item.
            for default in [k for k in chosen if sysctl_path(k) == sysctl_path(key)]:
                del chosen[default]
            chosen[key] = (value, "set by profile [sysctl]")
        items = [
            Item(self.name, f"sysctl {k}", sysctl_path(k), v, why)
            for k, (v, why) in sorted(chosen.items())
            if not is_sched_sysctl(k)
        ]
        return items, []

    def same(self, item: Item, current: str | None) -> bool:
        # Multi-value sysctls read back tab-separated; compare word by word.
        return current is not None and current.split() == item.desired.split()
