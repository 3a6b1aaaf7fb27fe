"""The operator's profile (TOML): which GPU and NIC serve, and how hard to tune.

Parsing is strict — an unknown key is an error — because a misspelt opt-out silently tuning a
production host is worse than a refused run. Every refusal names the file, the line and the key
(appliance.tomlcheck, as the gateway's configuration and the engine build spec).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import tomlcheck
from appliance.tomlcheck import Fail, Table
from host_tuning.holdlatency import LATENCY_MAX_US

IRREVERSIBLE = ("idle=poll", "intel_idle.max_cstate=0", "processor.max_cstate=0")
HUGEPAGE_SIZES_KB = {"2M": 2048, "1G": 1048576}
EPB_NAMES = ("performance", "balance-performance", "normal", "balance-power", "power")
MAX_CPUS = 8192
RING_MAX = 65536
# The most memory reserved as huge pages on one node: 64 TiB, all that x86-64 addresses with
# 4-level page tables. The count's bound depends on the page size.
HUGEPAGES_MAX_BYTES = 64 << 40


class ProfileError(tomlcheck.TomlError):
    """The profile is malformed or asks for something refused."""


@dataclass(frozen=True)
class Profile:
    # [serve]
    gpu: int | str = 0
    nics: tuple[str, ...] = ()
    netns: str | None = None  # NIC settings inside this network namespace (containers, tests)
    # [cpu]
    housekeeping_cores: int = 2
    nic_irq_cores: int = 2
    gateway_cores: int = 2
    serving_smt: bool = False  # False: sibling threads are isolated but left idle
    governor: str = "performance"
    energy_perf_bias: str = "performance"
    pm_qos_latency_us: int = 1
    # [memory]
    hugepage_size: str = "1G"
    hugepages: int = 0
    thp: str = "never"
    # [nic]
    mtu: int | None = None
    link_up: bool = True
    rx_ring: int | None = None
    tx_ring: int | None = None
    skip_first_mlx5_vector: bool = True
    # [kernel]
    isolate: bool = True
    iommu_pt: bool = True
    extra_cmdline: tuple[str, ...] = ()
    irreversible: tuple[str, ...] = ()
    allow_irreversible: bool = False
    # [gpudirect]
    gpudirect: str = "dmabuf"  # dmabuf | peermem | none
    disable_acs: bool = True
    # [sysctl] extra or overriding sysctls
    sysctl: dict[str, str] = field(default_factory=dict)

    @property
    def hugepage_kb(self) -> int:
        return HUGEPAGE_SIZES_KB[self.hugepage_size]


_SECTIONS: dict[str, tuple[str, ...]] = {
    "serve": ("gpu", "nics", "netns"),
    "cpu": (
        "housekeeping_cores",
        "nic_irq_cores",
        "gateway_cores",
        "serving_smt",
        "governor",
        "energy_perf_bias",
        "pm_qos_latency_us",
    ),
    "memory": ("hugepage_size", "hugepages", "thp"),
    "nic": ("mtu", "link_up", "rx_ring", "tx_ring", "skip_first_mlx5_vector"),
    "kernel": ("isolate", "iommu_pt", "extra_cmdline", "irreversible", "allow_irreversible"),
    "gpudirect": ("method", "disable_acs"),
}
_RENAMED: dict[tuple[str, str], str] = {("gpudirect", "method"): "gpudirect"}

# Profile field -> accepted TOML type. ``list`` means a list of strings. bool is checked apart
# from int (TOML ``true`` must not pass as 1, nor ``"no"`` as a true flag).
_TYPES: dict[str, type | tuple[type, ...]] = {
    "gpu": (int, str),
    "nics": list,
    "netns": str,
    "housekeeping_cores": int,
    "nic_irq_cores": int,
    "gateway_cores": int,
    "serving_smt": bool,
    "governor": str,
    "energy_perf_bias": (str, int),
    "pm_qos_latency_us": int,
    "hugepage_size": str,
    "hugepages": int,
    "thp": str,
    "mtu": int,
    "link_up": bool,
    "rx_ring": int,
    "tx_ring": int,
    "skip_first_mlx5_vector": bool,
    "isolate": bool,
    "iommu_pt": bool,
    "extra_cmdline": list,
    "irreversible": list,
    "allow_irreversible": bool,
    "gpudirect": str,
    "disable_acs": bool,
}
# A Linux interface / namespace name (dev_valid_name); '|' separates fields of a NIC target.
_IFNAME = re.compile(r"^(?!\.\.?$)[^\s/:|]{1,15}$")
_NETNS = re.compile(r"^(?!\.\.?$)[^\s/|]{1,255}$")
# One kernel parameter as it goes into the GRUB drop-in's double-quoted shell string.
_CMDLINE_TOKEN = re.compile(r"^[^\s\"'`$\\]+$")
_SYSCTL_KEY = re.compile(r"^[A-Za-z0-9_-]+([./][A-Za-z0-9_:-]+)+$")
# Numeric settings -> (lowest, highest, what the range is). CPU counts stop at the kernel's
# largest NR_CPUS (8192); pm_qos takes the s32 range hold-latency writes, from 1 because 0 in the
# per-CPU attribute means "no constraint"; ring sizes stop at 65536 descriptors, above what NIC
# drivers take (mlx5: 8192).
_BOUNDS: dict[str, tuple[int, int, str]] = {
    "cpu.housekeeping_cores": (1, MAX_CPUS, "physical cores; the OS needs one"),
    "cpu.nic_irq_cores": (0, MAX_CPUS, "physical cores"),
    "cpu.gateway_cores": (0, MAX_CPUS, "physical cores"),
    "cpu.pm_qos_latency_us": (1, LATENCY_MAX_US, "microseconds; use idle=poll for polling"),
    "nic.mtu": (68, 65535, "bytes"),
    "nic.rx_ring": (1, RING_MAX, "descriptors"),
    "nic.tx_ring": (1, RING_MAX, "descriptors"),
}


class _Table(Table):
    """A profile table; refusals are ProfileError (exit 2)."""

    error = ProfileError


# Refusals of a value built in code (no file to name).
_REFUSE = tomlcheck.refusal(ProfileError)


def _typed(t: _Table, key: str, expected: type | tuple[type, ...]) -> Any:
    if expected is list:
        return t.str_list(key)
    kinds = expected if isinstance(expected, tuple) else (expected,)
    value = t.data[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(
            {int: "an integer", str: "a string", bool: "true/false"}[k] for k in kinds
        )
        t.fail(key, f"must be {names}, got {value!r}")
    return value


def sysctl_path(key: str) -> str:
    """``/proc/sys`` path of a sysctl; like sysctl(8), a name with '/' is already a path (that
    spelling keeps dots inside interface names such as ``net/ipv4/conf/eth0.100/rp_filter``)."""
    return "/proc/sys/" + (key if "/" in key else key.replace(".", "/"))


def is_sched_sysctl(key: str) -> bool:
    """``kernel.sched_*`` in the dotted or the slash spelling."""
    parts = re.split(r"[./]", key, maxsplit=2)
    return len(parts) > 1 and parts[0] == "kernel" and parts[1].startswith("sched_")


def parse(text: str, source: Path = Path("<profile>")) -> Profile:
    """A validated profile from TOML text; refusals name `source`, the line and the key."""
    return _parse(text, tomlcheck.loads(text, source, ProfileError), source)


def _parse(text: str, data: dict[str, Any], source: Path) -> Profile:
    top = _Table(source, text, "", data, {*_SECTIONS, "sysctl"})
    tables: dict[str, _Table] = {}
    kwargs: dict[str, Any] = {}
    for section, keys in _SECTIONS.items():
        t = tables[section] = top.sub(section, set(keys))
        for key in t.data:
            name: str = _RENAMED.get((section, key), key)
            value = _typed(t, key, _TYPES[name])
            if name == "energy_perf_bias":
                # A number is planned as the kernel reads it back ("04" shows as 4).
                value = str(value)
                value = str(int(value)) if re.fullmatch(r"[0-9]{1,2}", value) else value
            kwargs[name] = value
    s = tables["sysctl"] = top.sub("sysctl", set(top.get("sysctl", dict, {})))
    sysctl: dict[str, str] = {}
    spelt: dict[str, str] = {}  # /proc/sys path -> the key naming it
    for k, v in s.data.items():
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            s.fail(k, f"value must be an integer or a string, got {v!r}")
        if not _SYSCTL_KEY.match(k) or ".." in k:
            s.fail(k, "not a sysctl name (e.g. net.core.somaxconn)")
        if (other := spelt.setdefault(sysctl_path(k), k)) != k:
            s.fail(k, f"the same sysctl as {other}: keep one of them")
        sysctl[k] = str(v)
    kwargs["sysctl"] = sysctl
    profile = Profile(**kwargs)

    validate(profile, tomlcheck.refusal_in(tables))
    return profile


def validate(p: Profile, fail: Fail = _REFUSE) -> None:
    """Refuse values the plugins cannot apply; `fail` names the key (and its line)."""
    if p.hugepage_size not in HUGEPAGE_SIZES_KB:
        fail(
            "memory.hugepage_size",
            f"must be one of {', '.join(HUGEPAGE_SIZES_KB)}, got {p.hugepage_size!r}",
        )
    if p.thp not in ("never", "madvise", "always"):
        fail("memory.thp", f"must be never, madvise or always, got {p.thp!r}")
    if p.gpudirect not in ("dmabuf", "peermem", "none"):
        fail("gpudirect.method", f"must be dmabuf, peermem or none, got {p.gpudirect!r}")
    hugepages_max = HUGEPAGES_MAX_BYTES // (p.hugepage_kb * 1024)
    bounds = {
        **_BOUNDS,
        "memory.hugepages": (0, hugepages_max, f"{p.hugepage_size} pages, 64 TiB in all"),
    }
    for key, (low, high, what) in bounds.items():
        value = getattr(p, key.split(".")[1])
        if value is not None and not low <= value <= high:
            fail(key, f"must be between {low} and {high} ({what}), got {value}")
    if p.energy_perf_bias not in EPB_NAMES and not (
        re.fullmatch(r"[0-9]{1,2}", p.energy_perf_bias) and int(p.energy_perf_bias) <= 15
    ):
        fail(
            "cpu.energy_perf_bias",
            f"must be one of {', '.join(EPB_NAMES)} or 0..15, got {p.energy_perf_bias!r}",
        )
    for nic in p.nics:
        if not _IFNAME.match(nic):
            fail("serve.nics", f"{nic!r} is not an interface name")
    if p.netns is not None and not _NETNS.match(p.netns):
        fail("serve.netns", f"{p.netns!r} is not a network namespace name")
    for key in p.sysctl:
        if is_sched_sysctl(key):
            # Moved to debugfs in 5.13 and renamed/removed in 6.6; tuned dropped them too.
            fail(f"sysctl.{key}", "kernel.sched_* sysctls are refused")
    for token in p.extra_cmdline:
        if not _CMDLINE_TOKEN.match(token):
            fail(
                "kernel.extra_cmdline",
                f"{token!r}: one kernel parameter per entry, without "
                "spaces, quotes, '$', '`' or backslashes",
            )
        if token in IRREVERSIBLE or token.startswith(("idle=", "intel_idle.max_cstate=")):
            fail("kernel.extra_cmdline", f"{token}: put irreversible settings in irreversible")
    for token in p.irreversible:
        if token not in IRREVERSIBLE:
            fail(
                "kernel.irreversible",
                f"{token}: not a known irreversible setting ({', '.join(IRREVERSIBLE)})",
            )
    if p.irreversible and not p.allow_irreversible:
        fail(
            "kernel.irreversible",
            f"refusing irreversible settings {list(p.irreversible)}: they cost power and heat "
            "and are not undone by revert; set [kernel] allow_irreversible = true to opt in",
        )


def load(path: str | Path) -> Profile:
    """Read and validate a profile file; every failure is a one-line :class:`ProfileError`."""
    text, data = tomlcheck.read(Path(path), "profile", ProfileError)
    return _parse(text, data, Path(path))
