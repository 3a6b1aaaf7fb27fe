"""GPUs through NVML (the only ``pynvml`` caller), with a sysfs fallback when NVML is absent.

NVML answers with an 8-digit PCI domain and sysfs uses 4; both are kept so the rest of the package
can join GPUs to sysfs paths. The NUMA node comes from sysfs (NVML has no node query that works on
every driver branch); local CPUs from ``nvmlDeviceGetCpuAffinityWithinScope(..., NODE)``.
"""

from __future__ import annotations

import pynvml

from host_tuning import cpulist
from host_tuning.facts.model import Gpu
from host_tuning.rootfs import Root

NVIDIA_VENDOR = "0x10de"
_DISPLAY_3D_CLASSES = ("0x0300", "0x0302")


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """``00000000:18:00.0`` -> ``0000:18:00.0`` (sysfs keeps a 4-digit domain)."""
    dom, rest = nvml_bus_id.lower().split(":", 1)
    return f"{int(dom, 16):04x}:{rest}"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def from_nvml(root: Root, cpu_count: int) -> list[Gpu]:
    words = max(1, (cpu_count + 63) // 64)
    pynvml.nvmlInit()
    try:
        out: list[Gpu] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            nvml_bus = _text(pynvml.nvmlDeviceGetPciInfo(h).busId)
            bdf = sysfs_bus_id(nvml_bus)
            node_text = root.read_value(f"/sys/bus/pci/devices/{bdf}/numa_node")
            aff = pynvml.nvmlDeviceGetCpuAffinityWithinScope(
                h, words, pynvml.NVML_AFFINITY_SCOPE_NODE
            )
            out.append(
                Gpu(
                    index=i,
                    name=_text(pynvml.nvmlDeviceGetName(h)),
                    bus_id=bdf,
                    nvml_bus_id=nvml_bus,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                    numa_node=int(node_text) if node_text else -1,
                    local_cpus=tuple(sorted(cpulist.from_words(list(aff)))),
                    source="nvml",
                )
            )
        return out
    finally:
        pynvml.nvmlShutdown()


def from_sysfs(root: Root) -> list[Gpu]:
    """NVIDIA display/3D controllers in PCI order; index follows NVML's default PCI-bus ordering."""
    out: list[Gpu] = []
    for bdf in root.listdir("/sys/bus/pci/devices"):
        base = f"/sys/bus/pci/devices/{bdf}"
        if root.read_value(f"{base}/vendor") != NVIDIA_VENDOR:
            continue
        if not (root.read_value(f"{base}/class") or "").startswith(_DISPLAY_3D_CLASSES):
            continue
        node_text = root.read_value(f"{base}/numa_node")
        local = root.read_value(f"{base}/local_cpulist") or ""
        dom, rest = bdf.split(":", 1)
        out.append(
            Gpu(
                index=len(out),
                name="NVIDIA GPU",
                bus_id=bdf,
                nvml_bus_id=f"{int(dom, 16):08x}:{rest}".upper(),
                uuid="",
                numa_node=int(node_text) if node_text else -1,
                local_cpus=tuple(sorted(cpulist.parse(local))),
                source="sysfs",
            )
        )
    return out


def gpus(root: Root, cpu_count: int, use_nvml: bool = True) -> tuple[list[Gpu], str | None]:
    """GPUs, and why NVML was not used (None when it was)."""
    if use_nvml:
        try:
            return from_nvml(root, cpu_count), None
        except pynvml.NVMLError as exc:
            return from_sysfs(root), f"NVML unavailable: {exc}"
    return from_sysfs(root), "NVML disabled (--no-nvml)"
