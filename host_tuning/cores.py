"""Pure choice of CPU roles on the GPU's NUMA node.

Whole physical cores are handed out (SMT siblings share caches and execution ports, so a noisy
sibling is latency on the serving thread). Order: housekeeping first (they include CPU 0, where the
kernel's own timers and non-movable IRQs land), then NIC-interrupt cores, then serving cores.
"""

from __future__ import annotations

from dataclasses import dataclass

from host_tuning import cpulist
from host_tuning.facts.model import Facts, Gpu
from host_tuning.profile import Profile


class PlanError(ValueError):
    """The host cannot satisfy the profile."""


@dataclass(frozen=True)
class CorePlan:
    node: int
    gpu: str
    housekeeping: tuple[int, ...]
    nic_irq: tuple[int, ...]
    gateway: tuple[int, ...]
    triton: tuple[int, ...]
    isolated: tuple[int, ...]
    reasons: dict[str, str]
    offline: tuple[int, ...] = ()  # CPUs offline at plan time (placed by their core all the same)

    @property
    def serving(self) -> tuple[int, ...]:
        return tuple(sorted(self.gateway + self.triton))


def gpu_node(facts: Facts, gpu: Gpu) -> int:
    """The GPU's node; when sysfs says -1, the node holding its NVML-local CPUs, else node 0."""
    if gpu.numa_node >= 0:
        return gpu.numa_node
    if gpu.local_cpus:
        return facts.cpu(gpu.local_cpus[0]).node
    return min(facts.nodes) if facts.nodes else 0


def physical_cores(facts: Facts, cpus: set[int]) -> list[tuple[int, ...]]:
    """Physical cores (as sorted thread tuples) among ``cpus``, ordered by lowest thread id."""
    groups: dict[tuple[int, int], set[int]] = {}
    for c in facts.cpus:
        if c.id in cpus and c.siblings:  # an offline CPU of unknown core belongs to none
            groups.setdefault((c.package, c.core), set()).add(c.id)
    return sorted((tuple(sorted(g)) for g in groups.values()), key=lambda t: t[0])


def choose(facts: Facts, profile: Profile) -> CorePlan:
    try:
        gpu = facts.gpu(profile.gpu)
    except KeyError as exc:
        found = ", ".join(f"{g.index}={g.bus_id}" for g in facts.gpus) or "none"
        why = f" ({facts.gpu_error})" if facts.gpu_error else ""
        raise PlanError(f"{exc.args[0]}; GPUs found: {found}{why}") from exc
    node = gpu_node(facts, gpu)
    node_cpus = set(facts.nodes.get(node, [c.id for c in facts.cpus]))
    offline = {c.id for c in facts.cpus if not c.online}
    if gpu.local_cpus:
        # NVML and local_cpulist list online CPUs only: offline ones stay with their node.
        node_cpus &= set(gpu.local_cpus) | offline
    cores = physical_cores(facts, node_cpus)
    unplaced = tuple(sorted(c.id for c in facts.cpus if c.id in node_cpus and not c.siblings))
    nic_cores_wanted = profile.nic_irq_cores if profile.nics else 0
    need = profile.housekeeping_cores + nic_cores_wanted + profile.gateway_cores + 1
    if len(cores) < need:
        raise PlanError(
            f"node {node} has {len(cores)} physical cores; the profile needs {need} "
            f"({profile.housekeeping_cores} housekeeping + {nic_cores_wanted} NIC IRQ + "
            f"{profile.gateway_cores} gateway + at least 1 Triton)"
        )
    hk_end = profile.housekeeping_cores
    nic_end = hk_end + nic_cores_wanted
    hk_cores, nic_cores, serve_cores = cores[:hk_end], cores[hk_end:nic_end], cores[nic_end:]

    def primary(core: tuple[int, ...]) -> tuple[int, ...]:
        """The core's first online thread (its first thread when all are offline)."""
        return next(((t,) for t in core if t not in offline), core[:1])

    def threads(group: list[tuple[int, ...]], primary_only: bool) -> tuple[int, ...]:
        return tuple(sorted(t for core in group for t in (primary(core) if primary_only else core)))

    serve_primary = not profile.serving_smt
    gw_cores, tr_cores = serve_cores[: profile.gateway_cores], serve_cores[profile.gateway_cores :]
    # An offline CPU whose core sysfs no longer tells may be a serving thread's sibling: isolated
    # (idle when it returns), never housekeeping.
    isolated = tuple(sorted(threads(serve_cores, False) + unplaced)) if profile.isolate else ()
    nic_irq = threads(nic_cores, False)
    # Everything that is not isolated and takes no NIC interrupts is housekeeping, other nodes
    # included: the OS, irqbalance and unnamed devices keep all of it.
    housekeeping = tuple(
        sorted(c.id for c in facts.cpus if c.id not in set(isolated) | set(nic_irq))
    )
    smt = any(len(c) > 1 for c in cores)
    sib = "sibling threads isolated but left idle" if serve_primary and smt else "all threads"
    reasons = {
        "node": f"GPU {gpu.index} ({gpu.bus_id}) is on NUMA node {node}; serving stays local",
        "housekeeping": f"first {len(hk_cores)} physical core(s) of node {node} "
        f"({cpulist.format(threads(hk_cores, False))}) plus every other node keep the OS",
        "nic_irq": f"{len(nic_cores)} physical core(s) next to the serving cores take NIC "
        "interrupts so packets are handled on the GPU's node without disturbing serving",
        "gateway": f"{len(gw_cores)} core(s) for the gateway's event loop, {sib}",
        "triton": f"{len(tr_cores)} core(s) for Triton/TensorRT-LLM host threads, {sib}",
        "isolated": "serving cores (both SMT threads) leave the scheduler, timer tick and RCU"
        if profile.isolate
        else "isolation disabled by profile",
    }
    if offline:
        reasons["offline"] = offline_reason(sorted(offline), unplaced)
    return CorePlan(
        node=node,
        gpu=gpu.bus_id,
        housekeeping=housekeeping,
        nic_irq=nic_irq,
        gateway=threads(gw_cores, serve_primary),
        triton=threads(tr_cores, serve_primary),
        isolated=isolated,
        reasons=reasons,
        offline=tuple(sorted(offline)),
    )


def offline_reason(offline: list[int], unplaced: tuple[int, ...]) -> str:
    """Plan and verify say which CPUs were offline and how the split counted them."""
    placed = [c for c in offline if c not in unplaced]
    parts = []
    if placed:
        parts.append(
            f"cpu{cpulist.format(placed)} offline at plan time: counted with its core, as when "
            "online (its sibling's thread_siblings_list names it)"
        )
    if unplaced:
        parts.append(
            f"cpu{cpulist.format(unplaced)} offline at plan time, core unknown (the kernel drops "
            "an offline CPU's topology and its sibling's list no longer names it): isolated, never "
            "housekeeping; bring it online (echo 1 > /sys/devices/system/cpu/cpuN/online) and "
            "plan again for an exact split"
        )
    return "; ".join(parts)


def cpu_affinity_dropin(cpus: tuple[int, ...], unit_comment: str = "") -> str:
    """Text of a systemd ``[Service]`` drop-in pinning a unit to ``cpus`` (for later units)."""
    lines = ["# Written by host-tune plan" + (f" for {unit_comment}" if unit_comment else "")]
    lines += ["[Service]", f"CPUAffinity={cpulist.format(cpus).replace(',', ' ')}", ""]
    return "\n".join(lines)
