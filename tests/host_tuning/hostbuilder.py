"""Fixture builder: writes sysfs/procfs/etc trees for realistic machines, plus a fake NVML.

The trees are generated from a topology description (sockets, cores, PCIe switches, devices) so
that a test can state what the machine is, not copy a dump. Conventions follow the kernel: Intel
CPU numbering (all first threads, then all siblings), relative symlinks for /sys/bus and
/sys/class, 4 KiB config space with an extended-capability chain holding ACS, managed IRQs listed
in ``.fixture-kernel`` so writes to them fail with EIO as the kernel's do.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from host_tuning import cpulist
from host_tuning.rootfs import KERNEL_MARKER

ACS_CTL_DEFAULT = 0x001D  # SV | RR | CR | UF, as firmware commonly leaves switch ports


def config_space(acs_ctl: int | None) -> bytes:
    """4 KiB config space: AER at 0x100, then ACS at 0x148 when the port has it."""
    buf = bytearray(4096)
    struct.pack_into("<HH", buf, 0, 0x15B3, 0x1021)
    nxt = 0x148 if acs_ctl is not None else 0
    struct.pack_into("<I", buf, 0x100, 0x0001 | (1 << 16) | (nxt << 20))
    if acs_ctl is not None:
        struct.pack_into("<I", buf, 0x148, 0x000D | (1 << 16))
        struct.pack_into("<HH", buf, 0x14C, 0x005F, acs_ctl)
    return bytes(buf)


@dataclass
class FakeGpu:
    bus_id: str  # NVML form, 8-digit domain, upper case as NVML prints it
    name: str
    uuid: str
    cpus: frozenset[int]


@dataclass
class FakeNvml:
    """Stands in for the NVML library at the ``pynvml`` call boundary and nowhere else."""

    gpus: list[FakeGpu] = field(default_factory=list)
    missing: bool = False
    calls: list[str] = field(default_factory=list)

    def install(self, monkeypatch: Any) -> None:
        def init() -> None:
            self.calls.append("nvmlInit")
            if self.missing:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

        def pci_info(h: int) -> Any:
            info = pynvml.nvmlPciInfo_t()
            info.busId = self.gpus[h].bus_id.encode()
            return info

        def affinity(h: int, words: int, scope: int) -> list[int]:
            assert scope == pynvml.NVML_AFFINITY_SCOPE_NODE
            out = [0] * words
            for c in self.gpus[h].cpus:
                out[c // 64] |= 1 << (c % 64)
            return out

        fns = {
            "nvmlInit": init,
            "nvmlShutdown": lambda: self.calls.append("nvmlShutdown"),
            "nvmlDeviceGetCount": lambda: len(self.gpus),
            "nvmlDeviceGetHandleByIndex": lambda i: i,
            "nvmlDeviceGetPciInfo": pci_info,
            "nvmlDeviceGetName": lambda h: self.gpus[h].name,
            "nvmlDeviceGetUUID": lambda h: self.gpus[h].uuid,
            "nvmlDeviceGetCpuAffinityWithinScope": affinity,
        }
        for name, fn in fns.items():
            monkeypatch.setattr(pynvml, name, fn)


@dataclass
class Machine:
    root: Path
    nvml: FakeNvml
    gpus: list[str]  # sysfs bus ids
    rdma_nics: list[str]
    management_nic: str
    managed_irqs: list[int]
    nodes: dict[int, list[int]]


class Builder:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.next_irq = 24
        self.eio: list[str] = []
        self.nvml = FakeNvml()
        self.nodes: dict[int, list[int]] = {}
        self.iommu_group = 0

    # -- low level -------------------------------------------------------------------------
    def write(self, rel: str, text: str | bytes) -> None:
        p = self.root / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            p.write_bytes(text)
        else:
            p.write_text(text)

    def link(self, rel: str, target_rel: str) -> None:
        p = self.root / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        target = self.root / target_rel.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        p.symlink_to(os.path.relpath(target, p.parent))

    def irq(self, actions: str, affinity: str, managed: bool = False) -> int:
        n = self.next_irq
        self.next_irq += 1
        self.write(f"/proc/irq/{n}/smp_affinity_list", affinity + "\n")
        self.write(f"/sys/kernel/irq/{n}/actions", actions + "\n")
        if managed:
            self.eio.append(f"proc/irq/{n}/smp_affinity_list")
        return n

    # -- CPUs and memory -------------------------------------------------------------------
    def cpus(self, sockets: int, cores: int, threads: int, epb: bool = True) -> None:
        total = sockets * cores * threads
        base = "/sys/devices/system/cpu"
        for kind in ("online", "present", "possible"):
            self.write(f"{base}/{kind}", f"0-{total - 1}\n")
        self.write(f"{base}/intel_pstate/min_perf_pct", "32\n")
        for cid in range(total):
            rest = cid % (sockets * cores)
            package, core = divmod(rest, cores)
            sibs = [t * sockets * cores + package * cores + core for t in range(threads)]
            self.nodes.setdefault(package, []).append(cid)
            d = f"{base}/cpu{cid}"
            self.write(f"{d}/topology/core_id", f"{core}\n")
            self.write(f"{d}/topology/physical_package_id", f"{package}\n")
            self.write(f"{d}/topology/thread_siblings_list", cpulist.format(sibs) + "\n")
            self.write(f"{d}/cpufreq/scaling_governor", "powersave\n")
            self.write(f"{d}/cpufreq/scaling_driver", "intel_pstate\n")
            self.write(f"{d}/cpufreq/scaling_available_governors", "performance powersave\n")
            if epb:
                self.write(f"{d}/power/energy_perf_bias", "6\n")
            self.write(f"{d}/power/pm_qos_resume_latency_us", "0\n")
        for node, ids in self.nodes.items():
            nd = f"/sys/devices/system/node/node{node}"
            self.write(f"{nd}/cpulist", cpulist.format(ids) + "\n")
            for kb in (2048, 1048576):
                self.write(f"{nd}/hugepages/hugepages-{kb}kB/nr_hugepages", "0\n")
                self.write(f"{nd}/hugepages/hugepages-{kb}kB/free_hugepages", "0\n")
        self.write(
            "/proc/irq/default_smp_affinity", cpulist.format_mask(range(total), total) + "\n"
        )
        timer = self.irq("timer", cpulist.format(range(total)))  # not movable: EIO too
        self.eio.append(f"proc/irq/{timer}/smp_affinity_list")

    # -- PCIe ------------------------------------------------------------------------------
    def host_bridge(self, domain_bus: str) -> str:
        return f"/sys/devices/pci{domain_bus}"

    def pci(
        self,
        parent: str,
        bdf: str,
        node: int,
        *,
        vendor: str = "0x8086",
        cls: str = "0x060400",
        driver: str | None = "pcieport",
        acs: int | None = None,
        iommu: bool = True,
    ) -> str:
        d = f"{parent}/{bdf}"
        self.write(f"{d}/vendor", vendor + "\n")
        self.write(f"{d}/class", cls + "\n")
        self.write(f"{d}/numa_node", f"{node}\n")
        local = self.nodes.get(node) or [c for cs in self.nodes.values() for c in cs]
        self.write(f"{d}/local_cpulist", cpulist.format(local) + "\n")
        self.write(f"{d}/config", config_space(acs))
        if driver:
            self.link(f"{d}/driver", f"/sys/bus/pci/drivers/{driver}")
        self.link(f"/sys/bus/pci/devices/{bdf}", d)
        if iommu:
            g = self.iommu_group
            self.iommu_group += 1
            self.write(f"/sys/kernel/iommu_groups/{g}/type", "DMA-FQ\n")
            self.link(f"{d}/iommu_group", f"/sys/kernel/iommu_groups/{g}")
        return d

    def msi(self, dev: str, irqs: list[int]) -> None:
        for n in irqs:
            self.write(f"{dev}/msi_irqs/{n}", "msix\n")

    def gpu(self, parent: str, bdf: str, node: int, name: str, index: int) -> None:
        self.pci(parent, bdf, node, vendor="0x10de", cls="0x030200", driver="nvidia")
        dom, rest = bdf.split(":", 1)
        cpus = frozenset(self.nodes.get(node) or [c for cs in self.nodes.values() for c in cs])
        uuid = f"GPU-{index:08x}-1b2c-3d4e-5f60-{int(rest[:2], 16):012x}"
        self.nvml.gpus.append(FakeGpu(f"{int(dom, 16):08X}:{rest.upper()}", name, uuid, cpus))

    def nic(
        self,
        parent: str,
        bdf: str,
        node: int,
        ifname: str,
        driver: str,
        queues: int,
        rdma: str | None,
        mtu: int = 1500,
    ) -> list[int]:
        dev = self.pci(parent, bdf, node, vendor="0x15b3", cls="0x020000", driver=driver)
        local = cpulist.format(self.nodes.get(node) or [0])
        irqs = [self.irq(f"{driver}_async@pci:{bdf}", local)]
        irqs += [self.irq(f"{driver}_comp{q}@pci:{bdf}", local) for q in range(queues)]
        self.msi(dev, irqs)
        if rdma:
            (self.root / dev.lstrip("/") / "infiniband" / rdma).mkdir(parents=True)
        net = f"/sys/class/net/{ifname}"
        self.write(f"{net}/mtu", f"{mtu}\n")
        self.write(f"{net}/operstate", "up\n")
        self.write(f"{net}/flags", "0x1003\n")
        self.link(f"{net}/device", dev)
        return irqs

    def nvme(self, parent: str, bdf: str, node: int, queues: int, index: int = 0) -> list[int]:
        dev = self.pci(parent, bdf, node, vendor="0x144d", cls="0x010802", driver="nvme")
        everything = cpulist.format(c for cs in self.nodes.values() for c in cs)
        admin = self.irq(f"nvme{index}q0", everything)
        io = [self.irq(f"nvme{index}q{q + 1}", str(q), managed=True) for q in range(queues)]
        self.msi(dev, [admin, *io])
        return io

    # -- kernel state ----------------------------------------------------------------------
    def kernel(self, cmdline: str, irqbalance_running: bool = True) -> None:
        self.write("/proc/cmdline", cmdline + "\n")
        self.write("/proc/sys/kernel/random/boot_id", "6d5f3a0e-8c1b-4e7a-9f2d-1a2b3c4d5e6f\n")
        thp = "/sys/kernel/mm/transparent_hugepage"
        self.write(f"{thp}/enabled", "always [madvise] never\n")
        self.write(f"{thp}/defrag", "always defer defer+madvise [madvise] never\n")
        sysctls = {
            "vm/swappiness": "60",
            "vm/stat_interval": "1",
            "net/core/busy_read": "0",
            "net/core/busy_poll": "0",
            "net/ipv4/tcp_fastopen": "1",
            "kernel/numa_balancing": "1",
            "kernel/nmi_watchdog": "1",
            "kernel/timer_migration": "1",
            "net/ipv4/tcp_rmem": "4096\t131072\t6291456",
        }
        for k, v in sysctls.items():
            self.write(f"/proc/sys/{k}", v + "\n")
        (self.root / "sys/class/iommu/dmar0").mkdir(parents=True, exist_ok=True)
        self.write(
            "/etc/default/irqbalance",
            "# irqbalance configuration (Debian)\n#IRQBALANCE_BANNED_CPULIST=\n"
            "#IRQBALANCE_ONESHOT=\n",
        )
        if irqbalance_running:
            self.write("/proc/1234/comm", "irqbalance\n")
        self.write("/proc/1/comm", "systemd\n")
        everything = cpulist.format(c for cs in self.nodes.values() for c in cs)
        self.write("/proc/1/status", f"Name:\tsystemd\nCpus_allowed_list:\t{everything}\n")
        ncpus = sum(len(cs) for cs in self.nodes.values())
        all_mask = cpulist.format_mask(range(ncpus), ncpus)
        self.write("/sys/devices/virtual/workqueue/cpumask", all_mask + "\n")
        self.write("/sys/bus/workqueue/devices/writeback/cpumask", all_mask + "\n")
        self.write("/dev/cpu_dma_latency", "")

    def finish(self) -> None:
        self.write(KERNEL_MARKER, "\n".join(self.eio) + "\n")


def hgx(root: Path) -> Machine:
    """Two sockets x 48 cores x 2 threads; per socket four PCIe switches, each with one H100 and
    one ConnectX-7; two NVMe drives with managed queues; an X710 management port."""
    b = Builder(root)
    b.cpus(sockets=2, cores=48, threads=2)
    gpus, nics = [], []
    bases = [0x15, 0x29, 0x3D, 0x51, 0x95, 0xA9, 0xBD, 0xD1]
    for i, bus in enumerate(bases):
        node = 0 if i < 4 else 1
        hb = b.host_bridge(f"0000:{bus:02x}")
        rp = b.pci(hb, f"0000:{bus:02x}:01.0", node, acs=ACS_CTL_DEFAULT)
        up = b.pci(rp, f"0000:{bus + 1:02x}:00.0", node, acs=None)
        dn_gpu = b.pci(up, f"0000:{bus + 2:02x}:00.0", node, acs=ACS_CTL_DEFAULT)
        dn_nic = b.pci(up, f"0000:{bus + 2:02x}:01.0", node, acs=ACS_CTL_DEFAULT)
        gbdf = f"0000:{bus + 3:02x}:00.0"
        b.gpu(dn_gpu, gbdf, node, "NVIDIA H100 80GB HBM3", i)
        gpus.append(gbdf)
        name = f"ibp{bus + 4}s0"
        b.nic(dn_nic, f"0000:{bus + 4:02x}:00.0", node, name, "mlx5_core", 8, f"mlx5_{i}")
        nics.append(name)
    mgmt_hb = b.host_bridge("0000:00")
    mgmt_rp = b.pci(mgmt_hb, "0000:00:1c.0", 0)
    mgmt = b.pci(mgmt_rp, "0000:01:00.0", 0, vendor="0x8086", cls="0x020000", driver="i40e")
    mgmt_irqs = [b.irq(f"i40e-eno1-TxRx-{q}", "0-191") for q in range(4)]
    b.msi(mgmt, mgmt_irqs)
    b.write("/sys/class/net/eno1/mtu", "1500\n")
    b.write("/sys/class/net/eno1/operstate", "up\n")
    b.write("/sys/class/net/eno1/flags", "0x1003\n")
    b.link("/sys/class/net/eno1/device", mgmt)
    managed: list[int] = []
    nvme_hb = b.host_bridge("0000:64")
    for j, bus in enumerate((0x65, 0x66)):
        rp = b.pci(nvme_hb, f"0000:64:0{j + 1}.0", 0)
        managed += b.nvme(rp, f"0000:{bus:02x}:00.0", 0, 8, j)
    b.kernel("BOOT_IMAGE=/vmlinuz-6.8.0-45-generic root=UUID=0b9c ro quiet splash")
    b.finish()
    return Machine(root, b.nvml, gpus, nics, "eno1", managed, b.nodes)


def workstation(root: Path) -> Machine:
    """One socket x 8 cores x 2 threads, one L40S and one ConnectX-6 Dx on different root
    ports, numa_node -1 everywhere (as many single-socket boards report), no energy_perf_bias."""
    b = Builder(root)
    b.cpus(sockets=1, cores=8, threads=2, epb=False)
    hb = b.host_bridge("0000:00")
    rp_gpu = b.pci(hb, "0000:00:01.0", -1, acs=None)
    b.gpu(rp_gpu, "0000:01:00.0", -1, "NVIDIA L40S", 0)
    rp_nic = b.pci(hb, "0000:00:1c.0", -1, acs=ACS_CTL_DEFAULT)
    b.nic(rp_nic, "0000:02:00.0", -1, "enp2s0f0np0", "mlx5_core", 4, "mlx5_0")
    rp_mgmt = b.pci(hb, "0000:00:1c.4", -1)
    mgmt = b.pci(rp_mgmt, "0000:03:00.0", -1, vendor="0x8086", cls="0x020000", driver="igb")
    irqs = [b.irq("enp3s0-TxRx-0", "0-15")]
    b.msi(mgmt, irqs)
    b.write("/sys/class/net/enp3s0/mtu", "1500\n")
    b.write("/sys/class/net/enp3s0/operstate", "up\n")
    b.write("/sys/class/net/enp3s0/flags", "0x1003\n")
    b.link("/sys/class/net/enp3s0/device", mgmt)
    rp_nvme = b.pci(hb, "0000:00:1d.0", -1)
    managed = b.nvme(rp_nvme, "0000:04:00.0", -1, 4)
    # Single-socket boards often report numa_node -1 but keep node0 in sysfs.
    b.kernel("BOOT_IMAGE=/boot/vmlinuz-6.1.0-26-amd64 root=/dev/nvme0n1p2 ro quiet", False)
    b.finish()
    return Machine(root, b.nvml, ["0000:01:00.0"], ["enp2s0f0np0"], "enp3s0", managed, b.nodes)
