"""PCIe topology: GPU↔NIC distance from sysfs device paths and ACS state of the bridges between.

NVML's common-ancestor call only works GPU↔GPU, so distance is derived from where the two devices
sit in ``/sys/devices/pciDDDD:BB/...``. ACS control is read from the bridge's config space, the same
register ``setpci ECAP_ACS+0x6.w`` writes.
"""

from __future__ import annotations

import re
import struct

from host_tuning.facts.model import Bridge, PciPath
from host_tuning.rootfs import Root

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$", re.IGNORECASE)
ACS_CAP_ID = 0x000D
ACS_CTL_OFFSET = 6
# ACS control bits that send peer-to-peer traffic up to the root complex.
ACS_REDIRECT_BITS = {"RR": 1 << 2, "CR": 1 << 3, "UF": 1 << 4, "EC": 1 << 5, "DT": 1 << 6}


def device_chain(root: Root, bdf: str) -> list[str]:
    """Path components from the host bridge (``pci0000:17``) down to the device."""
    real = root.realpath(f"/sys/bus/pci/devices/{bdf}")
    parts = [p for p in real.split("/") if p]
    for i, p in enumerate(parts):
        if p.startswith("pci") and ":" in p:
            return parts[i:]
    return []


def node_of(root: Root, bdf: str) -> int:
    text = root.read_value(f"/sys/bus/pci/devices/{bdf}/numa_node")
    return int(text) if text not in (None, "") else -1


def acs_capability(config: bytes) -> int | None:
    """Offset of the ACS extended capability, walking the list from 0x100; None if absent."""
    offset, seen = 0x100, 0
    while offset and offset + 4 <= len(config) and seen < 64:
        (header,) = struct.unpack_from("<I", config, offset)
        if header in (0, 0xFFFFFFFF):
            return None
        if header & 0xFFFF == ACS_CAP_ID:
            return offset
        offset = (header >> 20) & 0xFFC
        seen += 1
    return None


def acs_ctl(root: Root, bdf: str) -> int | None:
    config = root.read_bytes(f"/sys/bus/pci/devices/{bdf}/config")
    if config is None:
        return None
    cap = acs_capability(config)
    if cap is None or cap + ACS_CTL_OFFSET + 2 > len(config):
        return None
    (ctl,) = struct.unpack_from("<H", config, cap + ACS_CTL_OFFSET)
    return int(ctl)


def classify(a: list[str], b: list[str], same_node: bool) -> tuple[str, list[str]]:
    """nvidia-smi-style distance and the bridges the P2P path crosses.

    PIX: at most one bridge below the common switch port; PXB: several bridges, still below the
    host bridge; PHB: only the host bridge is shared; NODE / SYS: different host bridges on the same
    / a different NUMA node (traffic crosses the CPU interconnect).
    """
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    if common == 0:
        return ("NODE" if same_node else "SYS"), []
    # Bridges on the path: the shared one (if a bridge, not the host bridge) and those below it.
    bridges = [p for p in a[common - 1 : -1] + b[common:-1] if _BDF.match(p)]
    bridges = list(dict.fromkeys(bridges))
    if common == 1:
        return "PHB", bridges
    below = max(len(a) - common - 1, len(b) - common - 1)
    return ("PIX" if below <= 1 else "PXB"), bridges


def path(root: Root, gpu_bdf: str, nic_bdf: str) -> PciPath:
    a, b = device_chain(root, gpu_bdf), device_chain(root, nic_bdf)
    same_node = node_of(root, gpu_bdf) == node_of(root, nic_bdf)
    distance, bridges = classify(a, b, same_node)
    return PciPath(gpu_bdf, nic_bdf, distance, tuple(Bridge(x, acs_ctl(root, x)) for x in bridges))
