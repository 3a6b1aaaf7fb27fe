"""Kernel-wide state: command line, THP, huge pages, IOMMU, IRQs, irqbalance, cpufreq."""

from __future__ import annotations

import re

from host_tuning.facts.model import Irq
from host_tuning.rootfs import Root, selected

THP = "/sys/kernel/mm/transparent_hugepage"
IRQBALANCE_CONFIGS = ("/etc/default/irqbalance", "/etc/sysconfig/irqbalance")
_HP_DIR = re.compile(r"^hugepages-(\d+)kB$")


def cmdline(root: Root) -> str:
    return root.read_value("/proc/cmdline") or ""


GRUB_DEFAULTS = "/etc/default/grub"
GRUB_DROPINS = "/etc/default/grub.d"  # grub-mkconfig sources its *.cfg after GRUB_DEFAULTS
_GRUB_VARS = ("GRUB_CMDLINE_LINUX", "GRUB_CMDLINE_LINUX_DEFAULT")


def boot_cmdline(root: Root) -> dict[str, str]:
    """The kernel parameters each GRUB defaults file adds at the next boot, by path."""
    paths = [GRUB_DEFAULTS]
    paths += [f"{GRUB_DROPINS}/{n}" for n in root.listdir(GRUB_DROPINS) if n.endswith(".cfg")]
    out: dict[str, str] = {}
    for path in paths:
        text = root.read(path)
        values = [env_var(text, var) for var in _GRUB_VARS]
        joined = " ".join(v for v in values if v)
        if joined:
            out[path] = joined
    return out


def thp(root: Root) -> dict[str, str | None]:
    return {k: selected(root.read(f"{THP}/{k}")) for k in ("enabled", "defrag")}


def hugepages(root: Root, nodes: list[int]) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = {}
    for n in nodes:
        base = f"/sys/devices/system/node/node{n}/hugepages"
        sizes: dict[str, int] = {}
        for d in root.listdir(base):
            m = _HP_DIR.match(d)
            if m:
                sizes[m.group(1)] = int(root.read_value(f"{base}/{d}/nr_hugepages") or 0)
        out[n] = sizes
    return out


def iommu(root: Root, gpu_bdfs: list[str]) -> dict[str, str | int | bool | None]:
    """IOMMU presence and the default domain type of the first GPU's group (identity == pt)."""
    groups = root.listdir("/sys/kernel/iommu_groups")
    gpu_type = None
    for bdf in gpu_bdfs:
        gpu_type = root.read_value(f"/sys/bus/pci/devices/{bdf}/iommu_group/type")
        if gpu_type:
            break
    return {
        "present": bool(root.listdir("/sys/class/iommu")) or bool(groups),
        "groups": len(groups),
        "gpu_domain_type": gpu_type,
        "passthrough": gpu_type == "identity" if gpu_type else None,
    }


def irqs(root: Root) -> list[Irq]:
    out: list[Irq] = []
    for name in root.listdir("/proc/irq"):
        if name.isdigit():
            out.append(
                Irq(
                    number=int(name),
                    affinity=root.read_value(f"/proc/irq/{name}/smp_affinity_list"),
                    actions=root.read_value(f"/sys/kernel/irq/{name}/actions"),
                )
            )
    return sorted(out, key=lambda i: i.number)


def irqbalance_config(root: Root) -> str:
    """The distribution's irqbalance environment file (Debian first, then RHEL)."""
    for path in IRQBALANCE_CONFIGS:
        if root.exists(path):
            return path
    return IRQBALANCE_CONFIGS[0]


def env_var(text: str | None, var: str) -> str | None:
    """Value of ``VAR=...`` in a shell environment file, quotes removed; None when unset. The
    last assignment wins, as when a shell sources the file."""
    found = None
    for line in (text or "").splitlines():
        m = re.match(rf"^\s*{re.escape(var)}=(.*)$", line)
        if m:
            found = m.group(1).strip().strip("\"'")
    return found


def irqbalance(root: Root) -> dict[str, str | bool | None]:
    running = False
    for pid in root.listdir("/proc"):
        if pid.isdigit() and root.read_value(f"/proc/{pid}/comm") == "irqbalance":
            running = True
            break
    path = irqbalance_config(root)
    return {
        "running": running,
        "config": path,
        "banned_cpulist": env_var(root.read(path), "IRQBALANCE_BANNED_CPULIST"),
    }


def cpufreq(root: Root) -> dict[str, str | None]:
    base = "/sys/devices/system/cpu"
    return {
        "driver": root.read_value(f"{base}/cpu0/cpufreq/scaling_driver"),
        "governor_cpu0": root.read_value(f"{base}/cpu0/cpufreq/scaling_governor"),
        "energy_perf_bias_cpu0": root.read_value(f"{base}/cpu0/power/energy_perf_bias"),
        "min_perf_pct": root.read_value(f"{base}/intel_pstate/min_perf_pct"),
    }
