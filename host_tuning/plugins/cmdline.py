"""Kernel command line through one GRUB drop-in, reported "reboot required" until in effect.

One item per parameter (keyed by name) so each has its own reason and revert can unwind them one
by one; all live in a single file under /etc/default/grub.d/, which grub-mkconfig sources.
"""

from __future__ import annotations

import re
import shlex

from host_tuning import cpulist
from host_tuning.cores import CorePlan, PlanError
from host_tuning.facts.model import Facts
from host_tuning.facts.system import boot_cmdline
from host_tuning.items import Advice, Conflict, Item
from host_tuning.plugins.base import Context, FilePlugin
from host_tuning.profile import Profile

DROPIN = "/etc/default/grub.d/99-host-tune.cfg"
HEADER = "# Written by host-tune; `host-tune revert` removes it. Run update-grub after changes.\n"
_LINE = re.compile(r'^GRUB_CMDLINE_LINUX_DEFAULT="\$\{GRUB_CMDLINE_LINUX_DEFAULT\} ?(.*)"$', re.M)


def param(token: str) -> str:
    return token.split("=", 1)[0]


def tokens_of(text: str | None) -> list[str]:
    m = _LINE.search(text or "")
    if m is None:
        return []
    try:
        return shlex.split(m.group(1))
    except ValueError:  # a hand edit left a quote open: read it word by word, as written
        return m.group(1).split()


def render(tokens: list[str]) -> str:
    return (
        HEADER
        + f'GRUB_CMDLINE_LINUX_DEFAULT="${{GRUB_CMDLINE_LINUX_DEFAULT}} {" ".join(tokens)}"\n'
    )


#: Parameters host-tune derives from the core split; never taken from extra_cmdline.
SPLIT_PARAMS = ("isolcpus", "nohz_full", "rcu_nocbs", "irqaffinity")


def planned_tokens(facts: Facts, profile: Profile, cores: CorePlan) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = [
        ("skew_tick=1", "tuned network-latency: offset per-CPU ticks to avoid lock contention"),
        ("tsc=reliable", "tuned network-latency: no clocksource watchdog on the TSC"),
        (
            "rcupdate.rcu_normal_after_boot=1",
            "tuned network-latency: no expedited RCU IPIs after boot",
        ),
    ]
    if profile.isolate and cores.isolated:
        iso = cpulist.format(cores.isolated)
        hk = cpulist.format(cores.housekeeping)
        out += [
            (f"nohz_full={iso}", "tuned cpu-partitioning: no scheduler tick on serving cores"),
            (f"rcu_nocbs={iso}", "tuned cpu-partitioning: RCU callbacks run on housekeeping"),
            (
                # No `domain`: it would take the serving cores out of load balancing, so each
                # gateway/Triton thread would stay on the core it first ran on. Other work is kept
                # off by affinity instead (the workqueue and systemd plugins), as tuned does.
                f"isolcpus=managed_irq,{iso}",
                "tuned cpu-partitioning: managed IRQs (NVMe queues) avoid serving cores from "
                "boot; the scheduler still balances the serving threads across them",
            ),
            (f"irqaffinity={hk}", "IRQs start on housekeeping cores from boot"),
            (
                "rcutree.nohz_full_patience_delay=1000",
                "tuned cpu-partitioning: RCU waits up to 1 s before interrupting a nohz_full "
                "core busy in the kernel (Linux >= 6.11; older kernels ignore it)",
            ),
            (
                "nosoftlockup",
                "tuned cpu-partitioning: no soft-lockup watchdog timer firing on serving cores",
            ),
        ]
    if profile.iommu_pt:
        out.append(("iommu=pt", "GPUDirect RDMA needs IOMMU off or pass-through"))
    if profile.hugepages > 0:
        size = profile.hugepage_size
        out += [
            (f"default_hugepagesz={size}", f"mmap(MAP_HUGETLB) gets {size} pages by default"),
            (f"hugepagesz={size}", f"enable the {size} pool (count is set per node at runtime)"),
        ]
    for token in profile.extra_cmdline:
        if param(token) in SPLIT_PARAMS and not (profile.isolate and cores.isolated):
            # Behind a plan that isolates none, these would split the cores where neither the
            # plan nor the conflict check (which trusts host-tune's own drop-in) can see it.
            raise PlanError(
                f"[kernel] extra_cmdline {token}: host-tune sets {param(token)} from the plan's "
                "core split; set [kernel] isolate = true instead"
            )
        out.append((token, "set by profile [kernel] extra_cmdline"))
    for token in profile.irreversible:
        out.append((token, "opted in by profile: polling idle costs power and heat; not reverted"))
    seen: set[str] = set()
    for token, _ in out:
        if param(token) in seen:
            # One item per parameter: a second value would fight the first in the drop-in.
            raise PlanError(
                f"kernel parameter {param(token)} is planned twice ({token}); host-tune already "
                "sets it from the profile, so drop it from [kernel] extra_cmdline"
            )
        seen.add(param(token))
    return out


#: Parameters that carry the plan's core split; a second value of either fights the plan.
ISOLATION_PARAMS = ("isolcpus", "nohz_full")


def _cpus(token: str) -> frozenset[int] | None:
    """The CPUs of ``isolcpus=[flags,]LIST`` / ``nohz_full=LIST``; None when unreadable."""
    value = token.split("=", 1)[1] if "=" in token else ""
    # isolcpus flags (domain, nohz, managed_irq) are words; CPU list parts start with a digit.
    parts = [p for p in value.split(",") if p and not p[0].isalpha()]
    try:
        return cpulist.parse(",".join(parts))
    except ValueError:
        return None


def _conflict_text(token: str, source: str, found: frozenset[int] | None, wanted: str) -> str:
    name = param(token)
    head = f"{token} in {source} is not host-tune's"
    if found is None:
        return f"{head} and is no CPU list; the plan's {name} is {wanted or 'unset'}: fix it there"
    if not wanted:
        return (
            f"{head}: it isolates CPUs {cpulist.format(found)}, but the plan isolates none "
            "([kernel] isolate = false) and runs work there: remove it there or set isolate = true"
        )
    planned = cpulist.parse(wanted)
    diff = []
    if found - planned:
        diff.append(f"CPUs {cpulist.format(found - planned)} are not planned isolated")
    if planned - found:
        diff.append(f"CPUs {cpulist.format(planned - found)} are missing")
    return (
        f"{head}: the plan wants {name} on {wanted} ({', '.join(diff)}); remove it there, "
        f"host-tune sets {name} itself"
    )


def conflicts(facts: Facts, profile: Profile, cores: CorePlan) -> list[Conflict]:
    """Hand-set ``isolcpus`` / ``nohz_full`` (the running kernel's or the bootloader's) that
    disagree with the plan's isolated cores.

    host-tune's drop-in appends to GRUB_CMDLINE_LINUX_DEFAULT, so where it sets a parameter the
    running kernel's last occurrence (or one equal to the drop-in's) is host-tune's own: a value
    from an earlier plan is a pending reboot, reported by the cmdline item, not a conflict. A
    running value also set in a bootloader file is reported once, with the file to fix.
    """
    wanted_cpus = cores.isolated if profile.isolate else ()
    wanted = cpulist.format(wanted_cpus)
    ours = {param(t): t for t in (facts.boot_cmdline.get(DROPIN) or "").split()}
    running = facts.cmdline.split()
    out: list[Conflict] = []
    for name in ISOLATION_PARAMS:
        found = [
            (path, t)
            for path, text in sorted(facts.boot_cmdline.items())
            if path != DROPIN
            for t in text.split()
            if param(t) == name
        ]
        live = [t for t in running if param(t) == name]
        if name in ours and live:
            live.remove(ours[name] if ours[name] in live else live[-1])
        configured = {t for _, t in found}
        found += [("/proc/cmdline", t) for t in live if t not in configured]
        for source, token in found:
            cpus = _cpus(token)
            if cpus == frozenset(wanted_cpus):
                continue
            text = _conflict_text(token, source, cpus, wanted)
            shown = cpulist.format(cpus) if cpus is not None else ""
            out.append(Conflict(name, source, token, shown, wanted, text))
    return out


class Cmdline(FilePlugin):
    name = "cmdline"
    owns_files = True

    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        items = [
            Item(self.name, f"cmdline {param(t)}", DROPIN, t, why)
            for t, why in planned_tokens(facts, profile, cores)
        ]
        advice = [
            Advice(
                "cmdline",
                "after apply: update-grub (Debian/Ubuntu) or grub2-mkconfig / grubby (RHEL), "
                "then reboot; verify reports 'reboot required' until /proc/cmdline matches",
                "kernel parameters only take effect at boot",
            )
        ]
        if "pcie_aspm=off" in profile.extra_cmdline:
            advice.append(
                Advice(
                    "cmdline",
                    "pcie_aspm=off does not disable ASPM: it leaves the firmware's link settings "
                    "alone; disable ASPM in firmware (or use pcie_aspm.policy=performance)",
                    "ASPM L1 exits add microseconds to PCIe transactions",
                )
            )
        return items, advice

    def current(self, ctx: Context, item: Item) -> str | None:
        name = param(item.desired)
        for t in tokens_of(ctx.root.read(item.target)):
            if param(t) == name:
                return t
        return None

    def set(self, ctx: Context, item: Item) -> list[str]:
        tokens = tokens_of(ctx.root.read(item.target))
        name = param(item.desired)
        if any(param(t) == name for t in tokens):
            tokens = [item.desired if param(t) == name else t for t in tokens]
        else:
            tokens.append(item.desired)
        return ctx.root.create(item.target, render(tokens))

    def pending(self, ctx: Context, item: Item) -> str | None:
        running = (ctx.root.read_value("/proc/cmdline") or "").split()
        if item.desired in running:
            return None
        return f"reboot required: {item.desired} not in /proc/cmdline"

    def restored_pending(self, ctx: Context, key: str, target: str) -> str | None:
        """The running kernel keeps the parameter as it booted with it until the next boot."""
        name = key.split(" ", 1)[1]  # the item key is "cmdline NAME"
        running = {t for t in (ctx.root.read_value("/proc/cmdline") or "").split()}
        at_boot = {t for text in boot_cmdline(ctx.root).values() for t in text.split()}
        now = sorted(t for t in running if param(t) == name)
        if now == sorted(t for t in at_boot if param(t) == name):
            return None
        return (
            f"reboot required: the running kernel keeps {' '.join(now) or 'no ' + name} until "
            "update-grub (or grub2-mkconfig) and a reboot"
        )
