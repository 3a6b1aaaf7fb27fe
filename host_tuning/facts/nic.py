"""Network interfaces: driver, PCI function, NUMA node, MSI vectors and RDMA device from sysfs;
MTU and operational state from netlink (pyroute2) on the running host.

sysfs carries everything a root prefix can emulate; netlink is the kernel's own answer for link
state, so it wins when the root is the host itself.
"""

from __future__ import annotations

import re

from pyroute2 import IPRoute

from host_tuning import cpulist
from host_tuning.facts.model import Nic
from host_tuning.rootfs import Root

NET = "/sys/class/net"
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$", re.IGNORECASE)


def _rdma_device(root: Root, dev: str) -> str | None:
    names = root.listdir(f"{dev}/infiniband")
    return names[0] if names else None


def netlink_links(netns: str | None = None) -> dict[str, tuple[int, str]]:
    """Interface name -> (MTU, operstate in sysfs spelling) as netlink reports them."""
    out: dict[str, tuple[int, str]] = {}
    with IPRoute(netns=netns) if netns else IPRoute() as ipr:
        for link in ipr.get_links():
            name = link.get("IFLA_IFNAME")
            if name:
                oper = str(link.get("IFLA_OPERSTATE") or "unknown").lower()
                out[str(name)] = (int(link.get("IFLA_MTU") or 0), oper)
    return out


def nics(root: Root, all_cpus: list[int]) -> list[Nic]:
    live = netlink_links() if root.is_host else {}
    out: list[Nic] = []
    for name in root.listdir(NET):
        if name == "lo":
            continue
        base = f"{NET}/{name}"
        dev = f"{base}/device"
        has_dev = root.exists(dev)
        leaf = root.realpath(dev).rsplit("/", 1)[-1] if has_dev else ""
        # virtio and other bus devices are not PCI functions themselves; only BDFs join to GPUs.
        pci = leaf if _BDF.match(leaf) else None
        driver = root.realpath(f"{dev}/driver").rsplit("/", 1)[-1] if has_dev else None
        node_text = root.read_value(f"{dev}/numa_node") if has_dev else None
        node = int(node_text) if node_text not in (None, "") else -1
        local_text = root.read_value(f"{dev}/local_cpulist") if has_dev else None
        # numa_node can be -1 on single-socket or badly described platforms: fall back to the
        # device's local CPU list, and to every CPU when even that is absent.
        local = sorted(cpulist.parse(local_text)) if local_text else list(all_cpus)
        irqs = tuple(sorted(int(x) for x in root.listdir(f"{dev}/msi_irqs") if x.isdigit()))
        mtu_text = root.read_value(f"{base}/mtu")
        operstate = root.read_value(f"{base}/operstate")
        if name in live:
            mtu_text, operstate = str(live[name][0]), live[name][1]
        out.append(
            Nic(
                name=name,
                driver=driver,
                pci=pci,
                numa_node=node,
                local_cpus=tuple(local),
                mtu=int(mtu_text) if mtu_text else None,
                operstate=operstate,
                irqs=irqs,
                rdma=_rdma_device(root, dev) if has_dev else None,
            )
        )
    return out
