"""The library check appliance-triton.service runs inside Triton's root before Triton starts: with
a stand-in `ldd` on PATH (the real one reads the root's binaries, which CI does not have), every
outcome ends in one journal line that says what is wrong, or in silence and exit 0."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "ansible/roles/triton/files/appliance-triton-check-libs"
OBJECTS = [
    "/opt/tritonserver/bin/tritonserver",
    "/opt/tritonserver/backends/tensorrtllm/libtriton_tensorrtllm.so",
]

RESOLVED = """/opt/tritonserver/backends/tensorrtllm/libtriton_tensorrtllm.so:
\tlibtensorrt_llm.so => /usr/local/lib/python3.12/dist-packages/tensorrt_llm/libs/libtensorrt_llm.so
\tlibnvinfer.so.10 => /usr/local/tensorrt/lib/libnvinfer.so.10 (0x00007f)
\tlibcuda.so.1 => /usr/lib/x86_64-linux-gnu/libcuda.so.1 (0x00007f)
"""
MISSING = """/opt/tritonserver/backends/tensorrtllm/libtriton_tensorrtllm.so:
\tlibnvinfer.so.10 => not found
\tlibnvinfer_plugin.so.10 => not found
\tlibcuda.so.1 => /usr/lib/x86_64-linux-gnu/libcuda.so.1 (0x00007f)
"""
NO_TENSORRT = """/opt/tritonserver/bin/tritonserver:
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)
"""


def _run(tmp_path: Path, ldd_output: str, ldd_status: int = 0) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "out").write_text(ldd_output)
    ldd = bin_dir / "ldd"
    ldd.write_text(f"#!/bin/sh\ncat {bin_dir / 'out'}\nexit {ldd_status}\n")
    ldd.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
    }
    return subprocess.run(
        ["/bin/sh", str(CHECK), *OBJECTS],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_every_library_resolves(tmp_path: Path) -> None:
    result = _run(tmp_path, RESOLVED)
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.parametrize(
    ("output", "status", "words"),
    [
        (
            MISSING,
            0,
            "shared libraries not found in the Triton root: libnvinfer.so.10 "
            "libnvinfer_plugin.so.10 (LD_LIBRARY_PATH=/usr/local/nvidia/lib64; the image "
            "environment is /etc/appliance/triton-image.env)",
        ),
        (NO_TENSORRT, 0, "do not link TensorRT (libnvinfer)"),
        (
            "ldd: /opt/tritonserver/bin/tritonserver: No such file or directory\n",
            1,
            "cannot inspect",
        ),
    ],
)
def test_a_missing_library_fails_with_one_line(
    tmp_path: Path, output: str, status: int, words: str
) -> None:
    result = _run(tmp_path, output, status)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("appliance-triton: "), result.stderr
    assert words in lines[0], lines[0]
