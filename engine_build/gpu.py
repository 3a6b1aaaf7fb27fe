"""GPU memory size: from NVML on the GPU host, or from ``--gpu-memory`` when planning elsewhere.

pynvml is imported lazily so planning on a laptop or CI never needs the NVIDIA driver.
"""

from __future__ import annotations

from collections.abc import Sequence

from appliance import tomlcheck
from engine_build.errors import BuildError, SpecError

# The largest --gpu-memory taken: one GPU's memory, with room for GPUs to come.
GPU_MEMORY_MAX = 4 << 40


def parse_size(text: str) -> int:
    """``--gpu-memory``: ``80GiB``, ``81559MiB``, ``80GB``; a bare number is refused (80 bytes?)."""
    size = tomlcheck.parse_size(text)
    if size is None:
        raise SpecError(f"--gpu-memory {text!r}: expected {tomlcheck.SIZE_FORM}")
    if not 0 < size <= GPU_MEMORY_MAX:
        raise SpecError(f"--gpu-memory {text!r}: must be greater than 0 and at most 4TiB")
    return size


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


def nvml_compute_capability(gpu_ids: Sequence[int]) -> tuple[int, int]:
    """Lowest compute capability among ``gpu_ids``: every rank runs the same engine."""
    try:
        import pynvml
    except ImportError as err:  # pragma: no cover - nvidia-ml-py is a dependency
        raise BuildError(
            "nvidia-ml-py is not installed; pass --gpu-memory and --compute-capability"
        ) from err
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise BuildError(
            f"cannot query GPUs through NVML ({err}); pass --gpu-memory and --compute-capability"
        ) from err
    try:
        count = pynvml.nvmlDeviceGetCount()
        found = []
        for i in gpu_ids:
            if i >= count:
                raise BuildError(f"parallel.gpu_ids has GPU {i} but this host has {count} GPUs")
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            found.append((int(major), int(minor)))
        return min(found)
    except pynvml.NVMLError as err:
        raise BuildError(
            f"NVML query failed ({err}); pass --gpu-memory and --compute-capability"
        ) from err
    finally:
        pynvml.nvmlShutdown()
