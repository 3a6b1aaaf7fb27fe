"""The facts the planner consumes, as plain data (JSON-serialisable via ``dataclasses.asdict``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Cpu:
    id: int
    core: int  # physical core id within the package
    package: int
    node: int
    siblings: tuple[int, ...]  # SMT threads sharing the core, including this one
    # An offline CPU has no topology in sysfs: core, package and siblings then come from a sibling
    # whose thread_siblings_list still names it; when none does, core is -1 (unknown).
    online: bool = True


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    bus_id: str  # sysfs form, 4-digit domain: 0000:18:00.0
    nvml_bus_id: str  # NVML form, 8-digit domain: 00000000:18:00.0
    uuid: str
    numa_node: int
    local_cpus: tuple[int, ...]
    source: str  # "nvml" or "sysfs" (NVML unavailable)


@dataclass(frozen=True)
class Nic:
    name: str
    driver: str | None
    pci: str | None  # None for virtual interfaces
    numa_node: int
    local_cpus: tuple[int, ...]
    mtu: int | None
    operstate: str | None
    irqs: tuple[int, ...]
    rdma: str | None


@dataclass(frozen=True)
class Bridge:
    bdf: str
    acs_ctl: int | None  # None when the bridge has no ACS capability (or config is unreadable)


@dataclass(frozen=True)
class PciPath:
    gpu: str
    nic: str
    distance: str  # PIX / PXB / PHB / NODE / SYS, nvidia-smi topo's vocabulary
    bridges: tuple[Bridge, ...]


@dataclass(frozen=True)
class Irq:
    number: int
    affinity: str | None  # raw smp_affinity_list
    actions: str | None  # handler names from /sys/kernel/irq/N/actions


@dataclass
class Facts:
    root: str
    cpus: list[Cpu] = field(default_factory=list)
    nodes: dict[int, list[int]] = field(default_factory=dict)
    gpus: list[Gpu] = field(default_factory=list)
    gpu_error: str | None = None
    nics: list[Nic] = field(default_factory=list)
    pci_paths: list[PciPath] = field(default_factory=list)
    irqs: list[Irq] = field(default_factory=list)
    iommu: dict[str, str | int | bool | None] = field(default_factory=dict)
    cmdline: str = ""
    #: Kernel parameters each GRUB defaults file adds, by path (host-tune's own drop-in included).
    boot_cmdline: dict[str, str] = field(default_factory=dict)
    thp: dict[str, str | None] = field(default_factory=dict)
    hugepages: dict[int, dict[str, int]] = field(default_factory=dict)  # node -> size kB -> count
    irqbalance: dict[str, str | bool | None] = field(default_factory=dict)
    cpufreq: dict[str, str | None] = field(default_factory=dict)

    def cpu(self, cpu_id: int) -> Cpu:
        for c in self.cpus:
            if c.id == cpu_id:
                return c
        raise KeyError(cpu_id)

    def gpu(self, ref: int | str) -> Gpu:
        """Find a GPU by NVML index or by bus id in either domain width."""
        for g in self.gpus:
            if isinstance(ref, int) and g.index == ref:
                return g
            if isinstance(ref, str) and ref.lower() in (g.bus_id.lower(), g.nvml_bus_id.lower()):
                return g
        raise KeyError(f"no GPU {ref!r} in facts")

    def nic(self, name: str) -> Nic:
        for n in self.nics:
            if n.name == name:
                return n
        raise KeyError(f"no NIC {name!r} in facts")
