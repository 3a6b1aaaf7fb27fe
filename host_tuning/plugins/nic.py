"""Serving-NIC link settings (MTU, admin state) through netlink with pyroute2.

Only NICs the profile names are touched: anything else may be the management interface. On a
fixture root (no network namespace named) the same settings go through the interface's sysfs
attributes under the root, so tests never reach the host's own links.
"""

from __future__ import annotations

import os

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from host_tuning.cores import CorePlan, PlanError
from host_tuning.facts.model import Facts
from host_tuning.items import Advice, Item
from host_tuning.plugins.base import Context, Plugin
from host_tuning.profile import Profile
from host_tuning.rootfs import Root

IFF_UP = 0x1
NETNS_DIR = "/run/netns"


def spec(netns: str | None, ifname: str, attr: str) -> str:
    return f"{netns or ''}|{ifname}|{attr}"


def parse_spec(target: str) -> tuple[str | None, str, str]:
    netns, ifname, attr = target.split("|")
    return netns or None, ifname, attr


class Link:
    """One interface's MTU and admin state, via netlink or via sysfs under a fixture root."""

    def __init__(self, root: Root, netns: str | None, ifname: str) -> None:
        self.root, self.netns, self.ifname = root, netns, ifname
        self.netlink = netns is not None or root.is_host

    def _ipr(self) -> IPRoute:
        return IPRoute(netns=self.netns) if self.netns else IPRoute()

    def _refused(self, exc: NetlinkError, what: str) -> OSError:
        """The kernel's netlink refusal as the OSError a sysfs write gives: one failed setting."""
        where = f" in netns {self.netns}" if self.netns else ""
        return OSError(exc.code, f"{what} of {self.ifname}{where}: {os.strerror(exc.code)}")

    def _index(self, ipr: IPRoute) -> int | None:
        found = ipr.link_lookup(ifname=self.ifname)
        return int(found[0]) if found else None

    def get(self, attr: str) -> str | None:
        if not self.netlink:
            base = f"/sys/class/net/{self.ifname}"
            if attr == "mtu":
                return self.root.read_value(f"{base}/mtu")
            flags = self.root.read_value(f"{base}/flags")
            return None if flags is None else ("up" if int(flags, 16) & IFF_UP else "down")
        if self.netns and not os.path.exists(f"{NETNS_DIR}/{self.netns}"):
            return None  # never let pyroute2 create a namespace as a side effect
        with self._ipr() as ipr:
            idx = self._index(ipr)
            if idx is None:
                return None
            try:
                link = ipr.link("get", index=idx)[0]
            except NetlinkError as exc:
                raise self._refused(exc, "reading link") from exc
            if attr == "mtu":
                return str(link.get("IFLA_MTU"))
            return "up" if int(link["flags"]) & IFF_UP else "down"

    def set(self, attr: str, value: str) -> None:
        if not self.netlink:
            base = f"/sys/class/net/{self.ifname}"
            if attr == "mtu":
                self.root.write(f"{base}/mtu", value + "\n")
            else:
                flags = int(self.root.read_value(f"{base}/flags") or "0", 16)
                flags = flags | IFF_UP if value == "up" else flags & ~IFF_UP
                self.root.write(f"{base}/flags", f"{flags:#06x}\n")
            return
        with self._ipr() as ipr:
            idx = self._index(ipr)
            if idx is None:
                raise FileNotFoundError(f"no interface {self.ifname} in netns {self.netns}")
            try:
                if attr == "mtu":
                    ipr.link("set", index=idx, mtu=int(value))
                else:
                    ipr.link("set", index=idx, state=value)
            except NetlinkError as exc:
                raise self._refused(exc, f"setting {attr} {value}") from exc


class Nic(Plugin):
    name = "nic"

    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        items: list[Item] = []
        advice: list[Advice] = []
        known = {n.name: n for n in facts.nics}
        for name in profile.nics:
            nic = known.get(name)
            if nic is None and profile.netns is None:
                # A typo here would leave the serving NIC untuned while apply reports success.
                raise PlanError(
                    f"[serve] nics: no NIC {name!r} on this host; NICs found: "
                    f"{', '.join(sorted(known)) or 'none'}"
                )
            if nic is not None and nic.numa_node >= 0 and nic.numa_node != cores.node:
                advice.append(
                    Advice(
                        "nic",
                        f"{name} is on node {nic.numa_node}, the GPU on node {cores.node}: "
                        "pick a NIC on the GPU's node",
                        "cross-node NIC traffic crosses the socket interconnect",
                    )
                )
            if profile.mtu is not None:
                items.append(
                    Item(
                        self.name,
                        f"nic {name} mtu",
                        spec(profile.netns, name, "mtu"),
                        str(profile.mtu),
                        f"MTU {profile.mtu}: fewer packets and interrupts per response",
                    )
                )
            if profile.link_up:
                items.append(
                    Item(
                        self.name,
                        f"nic {name} link",
                        spec(profile.netns, name, "state"),
                        "up",
                        "the serving link is administratively up",
                    )
                )
            if profile.rx_ring or profile.tx_ring:
                rx = f" rx {profile.rx_ring}" if profile.rx_ring else ""
                tx = f" tx {profile.tx_ring}" if profile.tx_ring else ""
                advice.append(
                    Advice(
                        "nic",
                        f"ethtool -G {name}{rx}{tx}",
                        "ring size trades buffering against per-packet latency (set at boot)",
                    )
                )
        return items, advice

    def _link(self, ctx: Context, target: str) -> tuple[Link, str]:
        netns, ifname, attr = parse_spec(target)
        return Link(ctx.root, netns, ifname), attr

    def snapshot(self, ctx: Context, item: Item) -> str | None:
        return self.current(ctx, item)

    def current(self, ctx: Context, item: Item) -> str | None:
        link, attr = self._link(ctx, item.target)
        return link.get(attr)

    def set(self, ctx: Context, item: Item) -> list[str]:
        link, attr = self._link(ctx, item.target)
        link.set(attr, item.desired)
        return []

    def restore(self, ctx: Context, target: str, snapshot: str | None) -> None:
        if snapshot is not None:
            link, attr = self._link(ctx, target)
            link.set(attr, snapshot)
