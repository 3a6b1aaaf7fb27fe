"""Stand-ins for what a GPU host has and CI does not, so the GPU roles (nvidia_prereqs, triton,
engine_build) run for real in the booted container: the driver's `nvidia-smi` and
nvidia-persistenced, the exported NGC Triton root (a tar holding only what the role reads: the
tritonserver path, the backend's shared object and the tensorrt_llm dist-info) with the image's
docker-inspect record, a model checkpoint, and TensorRT-LLM (a virtual environment whose package
metadata says 1.2.1 and whose quantize.py / trtllm-build are the engine_build tests' stand-ins).
Everything else — tasks, templates, handlers, systemd, engine-build — is the real thing.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from host_tuning.facts.gpu import NVIDIA_VENDOR
from tests.engine_build.conftest import DATA, FAKE, HERE, make_checkpoint, write_spec
from tests.system.containers import Machine

DRIVER_FILE = "/etc/nvidia-stub/driver-version"
GOOD_DRIVER = "580.95.05"
TRTLLM_VENV = "/opt/trtllm-stub"
CHECKPOINT = "/srv/models/llama-8b"
# A marker the image's own record carries and the recorded environment does not.
IMAGE_MARKER = "TRITON_SERVER_VERSION=2.64.0"
IMAGE_LD_LIBRARY_PATH = "LD_LIBRARY_PATH=/usr/local/tensorrt/lib:/usr/local/nvidia/lib64"

NVIDIA_SMI = f"""#!/bin/sh
# Stand-in for the driver's nvidia-smi: the driver version comes from {DRIVER_FILE}.
case "$*" in
  *--query-gpu=driver_version*) cat {DRIVER_FILE} ;;
  *) echo "NVIDIA-SMI stand-in" ;;
esac
"""
PERSISTENCED_UNIT = """[Unit]
Description=NVIDIA Persistence Daemon (stand-in)

[Service]
Type=simple
ExecStart=/usr/bin/nvidia-persistenced --user nvidia-persistenced --no-persistence-mode
ExecStopPost=/bin/true

[Install]
WantedBy=multi-user.target
"""


@dataclass(frozen=True)
class GpuArtifacts:
    """Files on the controller the GPU inventory points at."""

    archive: Path
    archive_sha256: str
    image_config: Path
    spec: Path


def _write(root: Path, path: str, text: str, mode: int = 0o644) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    target.chmod(mode)


def set_driver(root: Path, version: str) -> None:
    _write(root, DRIVER_FILE, version + "\n")


def install_in_root(root: Path, python_minor: str) -> None:
    """Driver stand-ins, the checkpoint and the TensorRT-LLM stand-in, written into the
    container's root directory (its Python is `python_minor`, e.g. "3.11"; the virtual
    environment itself is created inside the container beforehand)."""
    _write(root, "/usr/bin/nvidia-smi", NVIDIA_SMI, 0o755)
    _write(root, "/usr/bin/nvidia-persistenced", "#!/bin/sh\nexec sleep infinity\n", 0o755)
    _write(root, "/usr/lib/systemd/system/nvidia-persistenced.service", PERSISTENCED_UNIT)
    set_driver(root, GOOD_DRIVER)
    make_checkpoint(root / CHECKPOINT.lstrip("/"))
    venv = root / TRTLLM_VENV.lstrip("/")
    dist = venv / "lib" / f"python{python_minor}" / "site-packages" / "tensorrt_llm-1.2.1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: 1.2.1\n")
    support = venv / "fake_support"
    (support / "data").mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "recorded_cli.py", support / "recorded_cli.py")
    shutil.copy(DATA / "trtllm_1_2_cli.json", support / "data" / "trtllm_1_2_cli.json")
    examples = venv / "examples" / "quantization"
    examples.mkdir(parents=True, exist_ok=True)
    shutil.copy(FAKE / "quantize.py", examples / "quantize.py")
    _write(
        root,
        f"{TRTLLM_VENV}/bin/trtllm-build",
        f"#!{TRTLLM_VENV}/bin/python\n" + (FAKE / "trtllm_build.py").read_text(),
        0o755,
    )


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def controller_artifacts(dest: Path) -> GpuArtifacts:
    """The exported-root archive, its docker-inspect record and the build spec."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / "triton-trtllm-1.2.1.tar"
    with tarfile.open(archive, "w") as tar:
        _tar_member(
            tar,
            "opt/tritonserver/bin/tritonserver",
            b"#!/bin/sh\necho 'tritonserver stand-in: no GPU' >&2\nexit 1\n",
            0o755,
        )
        _tar_member(tar, "opt/tritonserver/backends/tensorrtllm/libtriton_tensorrtllm.so", b"")
        _tar_member(
            tar,
            "usr/local/lib/python3.12/dist-packages/tensorrt_llm-1.2.1.dist-info/METADATA",
            b"Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: 1.2.1\n",
        )
    image_config = dest / "image-inspect.json"
    image_config.write_text(
        json.dumps(
            [
                {
                    "RepoTags": ["nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"],
                    "Config": {
                        "Env": [
                            "PATH=/opt/tritonserver/bin:/usr/local/sbin:/usr/local/bin:/usr/bin:/bin",
                            IMAGE_LD_LIBRARY_PATH,
                            "TRT_ROOT=/usr/local/tensorrt",
                            IMAGE_MARKER,
                        ]
                    },
                }
            ]
        )
    )
    spec = write_spec(
        dest / "llama-8b.toml",
        {
            "model": {"hf_model_dir": CHECKPOINT, "work_dir": "/var/lib/appliance/build/llama-8b"},
            "limits": {"max_input_len": 2048, "max_seq_len": 4096, "max_num_tokens": 2048},
            "trtllm": {
                "venv": TRTLLM_VENV,
                "quantize_script": f"{TRTLLM_VENV}/examples/quantization/quantize.py",
            },
        },
    )
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    return GpuArtifacts(archive, digest, image_config, spec)


# The stand-in GPU's PCI address: a bus no VM or CI host uses.
SYSFS_GPU = "0000:ff:00.0"
_SYSFS_GPU_SCRIPT = f"""set -e
d=/run/gpu-stub/pci-devices
mkdir -p "$d"
for e in /sys/bus/pci/devices/*; do ln -s "$(readlink -f "$e")" "$d/${{e##*/}}"; done
g="$d/{SYSFS_GPU}"
mkdir "$g"
echo {NVIDIA_VENDOR} > "$g/vendor"
echo 0x030200 > "$g/class"
echo 0 > "$g/numa_node"
cat /sys/devices/system/cpu/online > "$g/local_cpulist"
mount --bind "$d" /sys/bus/pci/devices
"""


def show_gpu_in_sysfs(machine: Machine) -> None:
    """host-tune finds GPUs through NVML, else in sysfs (host_tuning.facts.gpu): a 3D controller
    of NVIDIA's vendor id on node 0, local to every online CPU, is bound over the container's
    /sys/bus/pci/devices (the real devices stay, as links). Services see it: they share the
    container's mount namespace."""
    done = machine.sh("sh", "-c", _SYSFS_GPU_SCRIPT)
    assert done.returncode == 0, done.stderr
