"""Kernel CPU-list and CPU-mask notation.

The kernel speaks two notations (``0-3,8`` lists and comma-grouped hex masks); every reader and writer
in the package goes through here so that comparisons are made on sets, never on strings the kernel
may have re-formatted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: The kernel's largest NR_CPUS: a CPU number at or above it is a typo, never expanded.
MAX_CPUS = 8192
# One part of a list: N, START-END, or the group form START-END:USED/GROUP (kernel-parameters
# "cpu lists": 100-2000:2/25 is 100,101,125,126,...). The kernel takes no other form.
_PART = re.compile(r"(\d+)(?:-(\d+)(?::(\d+)/(\d+))?)?", re.ASCII)


def parse(text: str) -> frozenset[int]:
    """Parse ``"0-3,8,10-11"`` (sysfs/procfs/kernel command line list form); an empty string is
    the empty set. ValueError for what the kernel would refuse, and for CPUs at or beyond
    ``MAX_CPUS``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        m = _PART.fullmatch(part)
        if m is None:
            raise ValueError(f"bad CPU list part {part!r}")
        lo = int(m.group(1))
        hi = lo if m.group(2) is None else int(m.group(2))
        used, group = (1, 1) if m.group(3) is None else (int(m.group(3)), int(m.group(4)))
        if hi < lo or group == 0 or used > group:
            raise ValueError(f"bad CPU range {part!r}")
        if hi >= MAX_CPUS:
            raise ValueError(f"CPU {hi} in {part!r} is beyond the kernel's {MAX_CPUS} CPUs")
        cpus.update(c for c in range(lo, hi + 1) if (c - lo) % group < used)
    return frozenset(cpus)


def format(cpus: Iterable[int]) -> str:
    """Format a set as the kernel's canonical list form (``0-3,8``)."""
    ordered = sorted(set(cpus))
    out: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def parse_mask(text: str) -> frozenset[int]:
    """Parse a comma-grouped hex mask (``ffffffff,00000000``) as /proc/irq/*/smp_affinity shows."""
    value = int(text.strip().replace(",", "") or "0", 16)
    return frozenset(i for i in range(value.bit_length()) if value >> i & 1)


def from_words(words: Iterable[int], bits: int = 64) -> frozenset[int]:
    """Turn an NVML affinity array (CPU bitmap in 64-bit words, word 0 lowest) into a set."""
    cpus: set[int] = set()
    for w, word in enumerate(words):
        for b in range(bits):
            if int(word) >> b & 1:
                cpus.add(w * bits + b)
    return frozenset(cpus)


def format_mask(cpus: Iterable[int], ncpus: int) -> str:
    """Format as the kernel's comma-grouped 32-bit hex mask sized for ``ncpus`` CPUs."""
    value = 0
    for c in cpus:
        value |= 1 << c
    words = max(1, (max(ncpus, value.bit_length()) + 31) // 32)
    return ",".join(f"{(value >> (32 * w)) & 0xFFFFFFFF:08x}" for w in reversed(range(words)))
