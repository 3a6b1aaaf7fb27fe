"""CPU topology from sysfs: which threads share a core, and which node each core is on."""

from __future__ import annotations

import re

from host_tuning import cpulist
from host_tuning.facts.model import Cpu
from host_tuning.rootfs import Root

_CPU_DIR = re.compile(r"^cpu(\d+)$")
_NODE_DIR = re.compile(r"^node(\d+)$")
SYS_CPU = "/sys/devices/system/cpu"
SYS_NODE = "/sys/devices/system/node"


def nodes(root: Root) -> dict[int, list[int]]:
    """NUMA node -> CPUs; a machine without NUMA sysfs is one node holding every CPU."""
    out: dict[int, list[int]] = {}
    for name in root.listdir(SYS_NODE):
        m = _NODE_DIR.match(name)
        if m:
            text = root.read_value(f"{SYS_NODE}/{name}/cpulist") or ""
            out[int(m.group(1))] = sorted(cpulist.parse(text))
    return out


def online(root: Root) -> frozenset[int]:
    text = root.read_value(f"{SYS_CPU}/online")
    if text is not None:
        return cpulist.parse(text)
    return frozenset(
        int(m.group(1)) for n in root.listdir(SYS_CPU) if (m := _CPU_DIR.match(n)) is not None
    )


def cpus(root: Root) -> list[Cpu]:
    node_of = {c: n for n, cs in nodes(root).items() for c in cs}
    out: list[Cpu] = []
    for cid in sorted(online(root)):
        topo = f"{SYS_CPU}/cpu{cid}/topology"
        core = int(root.read_value(f"{topo}/core_id") or cid)
        package = int(root.read_value(f"{topo}/physical_package_id") or 0)
        sib_text = root.read_value(f"{topo}/thread_siblings_list")
        siblings = tuple(sorted(cpulist.parse(sib_text))) if sib_text else (cid,)
        out.append(Cpu(cid, core, package, node_of.get(cid, 0), siblings))
    return out
