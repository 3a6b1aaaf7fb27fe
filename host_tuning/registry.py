"""The plugins, in apply order (revert runs the reverse)."""

from __future__ import annotations

from host_tuning.plugins.base import Plugin
from host_tuning.plugins.cmdline import Cmdline
from host_tuning.plugins.cpu import Cpu, PmQos
from host_tuning.plugins.gpudirect import GpuDirect
from host_tuning.plugins.hugepages import HugePages
from host_tuning.plugins.irq import Irq
from host_tuning.plugins.irqbalance import Irqbalance
from host_tuning.plugins.nic import Nic
from host_tuning.plugins.partition import SystemdAffinity, Workqueue
from host_tuning.plugins.sysctl import Sysctl
from host_tuning.plugins.thp import Thp

PLUGINS: tuple[Plugin, ...] = (
    Cpu(),
    PmQos(),
    Sysctl(),
    Thp(),
    HugePages(),
    Irqbalance(),
    Irq(),
    Workqueue(),
    SystemdAffinity(),
    Nic(),
    GpuDirect(),
    Cmdline(),
)
BY_NAME: dict[str, Plugin] = {p.name: p for p in PLUGINS}
