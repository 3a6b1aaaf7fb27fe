"""The operator's profile (TOML): which GPU and NIC serve, and how hard to tune.

Parsing is strict — an unknown key is an error — because a misspelt opt-out silently tuning a
production host is worse than a refused run.
"""

from __future__ import annotations

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


def from_dict(data: dict[str, Any]) -> Profile:
    kwargs: dict[str, Any] = {}
    for section, body in data.items():
        if section == "sysctl":
            if not isinstance(body, dict):
                raise ProfileError("[sysctl] must be a table of key = value")
            kwargs["sysctl"] = {str(k): str(v) for k, v in body.items()}
            continue
        if section not in _SECTIONS or not isinstance(body, dict):
            raise ProfileError(f"unknown profile section [{section}]")
        for key, value in body.items():
            if key not in _SECTIONS[section]:
                raise ProfileError(f"unknown key {key!r} in [{section}]")
            name: str = _RENAMED.get((section, str(key)), str(key))
            if isinstance(value, list):
                value = tuple(str(v) for v in value)
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
    for key in p.sysctl:
        if key.startswith("kernel.sched_"):
            # Moved to debugfs in 5.13 and renamed/removed in 6.6; tuned dropped them too.
            raise ProfileError(f"{key}: kernel.sched_* sysctls are refused")
    for token in p.extra_cmdline:
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
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: {exc}") from exc
    return from_dict(data)
