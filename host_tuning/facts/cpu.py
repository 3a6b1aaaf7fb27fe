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
    return _listed(root, ("online",))


def present(root: Root) -> frozenset[int]:
    """Every CPU the machine has, online or not (``present``, else ``possible``, else online)."""
    return _listed(root, ("present", "possible", "online"))


def _listed(root: Root, files: tuple[str, ...]) -> frozenset[int]:
    for name in files:
        text = root.read_value(f"{SYS_CPU}/{name}")
        if text:
            return cpulist.parse(text)
    return frozenset(
        int(m.group(1)) for n in root.listdir(SYS_CPU) if (m := _CPU_DIR.match(n)) is not None
    )


def _node_link(root: Root, cid: int) -> int | None:
    """The ``cpuN/nodeM`` link, kept for an offline CPU when the node's cpulist drops it."""
    for name in root.listdir(f"{SYS_CPU}/cpu{cid}"):
        m = _NODE_DIR.match(name)
        if m:
            return int(m.group(1))
    return None


def cpus(root: Root) -> list[Cpu]:
    """Every present CPU. The kernel removes an offline CPU's ``topology`` directory, so its core
    is taken from an online sibling whose ``thread_siblings_list`` still names it (x86 clears it
    there too: the core is then unknown, -1)."""
    node_of = {c: n for n, cs in nodes(root).items() for c in cs}
    up = online(root)
    known: dict[int, Cpu] = {}
    for cid in sorted(up | present(root)):
        topo = f"{SYS_CPU}/cpu{cid}/topology"
        sib_text = root.read_value(f"{topo}/thread_siblings_list")
        if sib_text is None and cid not in up:
            continue  # offline without topology: placed below
        core = int(root.read_value(f"{topo}/core_id") or cid)
        package = int(root.read_value(f"{topo}/physical_package_id") or 0)
        siblings = tuple(sorted(cpulist.parse(sib_text))) if sib_text else (cid,)
        node = node_of.get(cid, _node_link(root, cid) or 0)
        known[cid] = Cpu(cid, core, package, node, siblings, cid in up)
    out: list[Cpu] = []
    for cid in sorted(up | present(root)):
        if cid in known:
            out.append(known[cid])
            continue
        sib = next((c for c in known.values() if cid in c.siblings), None)
        link = _node_link(root, cid)
        if sib is not None:
            node = sib.node if link is None else link
            out.append(Cpu(cid, sib.core, sib.package, node, sib.siblings, False))
        else:
            out.append(Cpu(cid, -1, -1, 0 if link is None else link, (), False))
    return out
