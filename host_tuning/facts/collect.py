"""Gather every fact through one root prefix."""

from __future__ import annotations

from host_tuning.facts import cpu, gpu, nic, pci, system
from host_tuning.facts.model import Facts
from host_tuning.rootfs import Root


def collect(root: Root, use_nvml: bool = True) -> Facts:
    cpus = cpu.cpus(root)
    nodes = cpu.nodes(root) or {0: []}
    for c in cpus:  # a node's cpulist holds only its online CPUs
        if c.id not in nodes.setdefault(c.node, []):
            nodes[c.node] = sorted([*nodes[c.node], c.id])
    gpus, gpu_error = gpu.gpus(root, len(cpus), use_nvml)
    nics = nic.nics(root, [c.id for c in cpus if c.online])
    paths = [
        pci.path(root, g.bus_id, n.pci) for g in gpus for n in nics if n.pci and n.rdma is not None
    ]
    return Facts(
        root=str(root.base),
        cpus=cpus,
        nodes=nodes,
        gpus=gpus,
        gpu_error=gpu_error,
        nics=nics,
        pci_paths=paths,
        irqs=system.irqs(root),
        iommu=system.iommu(root, [g.bus_id for g in gpus]),
        cmdline=system.cmdline(root),
        boot_cmdline=system.boot_cmdline(root),
        thp=system.thp(root),
        hugepages=system.hugepages(root, sorted(nodes)),
        irqbalance=system.irqbalance(root),
        cpufreq=system.cpufreq(root),
    )
