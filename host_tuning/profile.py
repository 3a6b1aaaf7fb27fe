"""The operator's profile (TOML): which GPU and NIC serve, and how hard to tune.

Parsing is strict — an unknown key is an error — because a misspelt opt-out silently tuning a
production host is worse than a refused run.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IRREVERSIBLE = ("idle=poll", "intel_idle.max_cstate=0", "processor.max_cstate=0")
HUGEPAGE_SIZES_KB = {"2M": 2048, "1G": 1048576}
EPB_NAMES = ("performance", "balance-performance", "normal", "balance-power", "power")


class ProfileError(ValueError):
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


def _typed(where: str, value: Any, expected: type | tuple[type, ...]) -> Any:
    kinds = expected if isinstance(expected, tuple) else (expected,)
    if expected is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ProfileError(f"{where} must be a list of strings, got {value!r}")
        return tuple(value)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(
            {int: "an integer", str: "a string", bool: "true/false"}[k] for k in kinds
        )
        raise ProfileError(f"{where} must be {names}, got {value!r}")
    return value


def sysctl_key(key: str) -> str:
    """Check a sysctl name in either spelling (``kernel.foo`` or ``kernel/foo``) and answer it."""
    if not _SYSCTL_KEY.match(key) or ".." in key:
        raise ProfileError(f"[sysctl] {key!r} is not a sysctl name (e.g. net.core.somaxconn)")
    return key


def is_sched_sysctl(key: str) -> bool:
    """``kernel.sched_*`` in the dotted or the slash spelling."""
    parts = re.split(r"[./]", key, maxsplit=2)
    return len(parts) > 1 and parts[0] == "kernel" and parts[1].startswith("sched_")


def from_dict(data: dict[str, Any]) -> Profile:
    kwargs: dict[str, Any] = {}
    for section, body in data.items():
        if section == "sysctl":
            if not isinstance(body, dict):
                raise ProfileError("[sysctl] must be a table of key = value")
            sysctl: dict[str, str] = {}
            for k, v in body.items():
                if isinstance(v, bool) or not isinstance(v, (int, str)):
                    raise ProfileError(f"[sysctl] {k}: value must be an integer or a string")
                sysctl[sysctl_key(str(k))] = str(v)
            kwargs["sysctl"] = sysctl
            continue
        if section not in _SECTIONS or not isinstance(body, dict):
            raise ProfileError(f"unknown profile section [{section}]")
        for key, value in body.items():
            if key not in _SECTIONS[section]:
                raise ProfileError(f"unknown key {key!r} in [{section}]")
            name: str = _RENAMED.get((section, str(key)), str(key))
            value = _typed(f"[{section}] {key}", value, _TYPES[name])
            if name == "energy_perf_bias":
                value = str(value)
            kwargs[name] = value
    profile = Profile(**kwargs)
    validate(profile)
    return profile


def validate(p: Profile) -> None:
    if p.hugepage_size not in HUGEPAGE_SIZES_KB:
        raise ProfileError(f"hugepage_size must be one of {sorted(HUGEPAGE_SIZES_KB)}")
    if p.thp not in ("never", "madvise", "always"):
        raise ProfileError("thp must be never, madvise or always")
    if p.gpudirect not in ("dmabuf", "peermem", "none"):
        raise ProfileError("[gpudirect] method must be dmabuf, peermem or none")
    for name in ("housekeeping_cores", "nic_irq_cores", "gateway_cores", "hugepages"):
        if not isinstance(getattr(p, name), int) or getattr(p, name) < 0:
            raise ProfileError(f"{name} must be a non-negative integer")
    if not isinstance(p.pm_qos_latency_us, int) or p.pm_qos_latency_us < 1:
        # 0 in the per-CPU attribute means "no constraint", the opposite of what it looks like.
        raise ProfileError("pm_qos_latency_us must be at least 1 (use idle=poll for polling)")
    if p.energy_perf_bias not in EPB_NAMES and not (
        p.energy_perf_bias.isdigit() and int(p.energy_perf_bias) <= 15
    ):
        raise ProfileError(f"energy_perf_bias must be one of {EPB_NAMES} or 0..15")
    if p.housekeeping_cores < 1:
        raise ProfileError("housekeeping_cores must be at least 1 (the OS needs a core)")
    if p.mtu is not None and not 68 <= p.mtu <= 65535:
        raise ProfileError("mtu must be between 68 and 65535")
    for ring in ("rx_ring", "tx_ring"):
        if getattr(p, ring) is not None and getattr(p, ring) < 1:
            raise ProfileError(f"{ring} must be a positive integer")
    for nic in p.nics:
        if not _IFNAME.match(nic):
            raise ProfileError(f"[serve] nics: {nic!r} is not an interface name")
    if p.netns is not None and not _NETNS.match(p.netns):
        raise ProfileError(f"[serve] netns: {p.netns!r} is not a network namespace name")
    for key in p.sysctl:
        if is_sched_sysctl(key):
            # Moved to debugfs in 5.13 and renamed/removed in 6.6; tuned dropped them too.
            raise ProfileError(f"{key}: kernel.sched_* sysctls are refused")
    for token in p.extra_cmdline:
        if not _CMDLINE_TOKEN.match(token):
            raise ProfileError(
                f"[kernel] extra_cmdline: {token!r}: one kernel parameter per entry, without "
                "spaces, quotes, '$', '`' or backslashes"
            )
        if token in IRREVERSIBLE or token.startswith(("idle=", "intel_idle.max_cstate=")):
            raise ProfileError(f"{token}: put irreversible settings in [kernel] irreversible")
    for token in p.irreversible:
        if token not in IRREVERSIBLE:
            raise ProfileError(f"{token}: not a known irreversible setting {IRREVERSIBLE}")
    if p.irreversible and not p.allow_irreversible:
        raise ProfileError(
            f"refusing irreversible settings {list(p.irreversible)}: they cost power and heat "
            "and are not undone by revert; set [kernel] allow_irreversible = true to opt in"
        )


def load(path: str | Path) -> Profile:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: {exc}") from exc
    return from_dict(data)
