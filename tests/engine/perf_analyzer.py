"""NVIDIA's perf_analyzer, unmodified, put together in a throwaway directory.

The binary ships in the ``tritonclient`` 2.51.0 manylinux wheel (later wheels drop it or need a
newer glibc; the ``perf-analyzer`` name on PyPI is an empty placeholder). It links
``libcudart.so.12``, taken from the ``nvidia-cuda-runtime-cu12`` wheel (no GPU is used for gRPC
without CUDA shared memory), and Debian's ``libb64.so.0d`` (package libb64-0d, in
.ci/debian-packages, checked by tests/prereqs.py). pip's own download cache makes a second
set-up cheap; a set-up that cannot get the wheels fails the test, it never skips it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

TRITONCLIENT = "tritonclient==2.51.0"
CUDA_RUNTIME = "nvidia-cuda-runtime-cu12==12.3.101"
_BINARY = "tritonclient-2.51.0.data/data/bin/perf_analyzer"
_CUDART = "nvidia/cuda_runtime/lib/libcudart.so.12"


@dataclass(frozen=True)
class PerfAnalyzer:
    binary: Path
    lib_dir: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "LD_LIBRARY_PATH": str(self.lib_dir)}


def install(dest: Path) -> PerfAnalyzer:
    """Downloads the two wheels into ``dest`` and extracts the binary and libcudart."""
    wheels = dest / "wheels"
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        "manylinux1_x86_64",
        "--python-version",
        "3.11",
        "--dest",
        str(wheels),
        TRITONCLIENT,
        CUDA_RUNTIME,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"cannot download {TRITONCLIENT} and {CUDA_RUNTIME} for perf_analyzer: "
            + (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        )
    (wheel,) = wheels.glob("tritonclient-2.51.0-*.whl")
    (runtime,) = wheels.glob("nvidia_cuda_runtime_cu12-*.whl")
    with zipfile.ZipFile(wheel) as z:
        binary = Path(z.extract(_BINARY, dest))
    binary.chmod(0o755)
    with zipfile.ZipFile(runtime) as z:
        lib = Path(z.extract(_CUDART, dest))
    return PerfAnalyzer(binary, lib.parent)
