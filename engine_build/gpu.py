"""GPU memory size: from NVML on the GPU host, or from ``--gpu-memory`` when planning elsewhere.

pynvml is imported lazily so planning on a laptop or CI never needs the NVIDIA driver.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from engine_build.errors import BuildError

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(text: str) -> int:
    """Parse ``80GiB``, ``81559MiB``, ``80GB`` or a plain byte count."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", text, re.IGNORECASE)
    if m is None or m.group(2).lower() not in _UNITS:
        raise BuildError(f"--gpu-memory {text!r}: expected a size such as 80GiB, 81559MiB or bytes")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise BuildError(f"--gpu-memory {text!r} must be positive")
    return value


def nvml_total_memory(gpu_ids: Sequence[int]) -> int:
    """Smallest total memory among ``gpu_ids``: every rank must fit on its own GPU."""
    try:
        import pynvml
    except ImportError as err:  # pragma: no cover - nvidia-ml-py is a dependency
        raise BuildError("nvidia-ml-py is not installed; pass --gpu-memory") from err
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise BuildError(f"cannot query GPUs through NVML ({err}); pass --gpu-memory") from err
    try:
        count = pynvml.nvmlDeviceGetCount()
        sizes = []
        for i in gpu_ids:
            if i >= count:
                raise BuildError(f"parallel.gpu_ids has GPU {i} but this host has {count} GPUs")
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            sizes.append(int(pynvml.nvmlDeviceGetMemoryInfo(handle).total))
        return min(sizes)
    except pynvml.NVMLError as err:
        raise BuildError(f"NVML query failed ({err}); pass --gpu-memory") from err
    finally:
        pynvml.nvmlShutdown()
