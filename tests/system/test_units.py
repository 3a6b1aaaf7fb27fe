"""The systemd units: `systemd-analyze verify` on each (unknown keys are errors), and the gateway's
hardening score by `systemd-analyze security --offline=yes`.

The units are verified inside a scratch root holding this host's own units plus stubs of the programs the
roles install (/opt/appliance/venv/bin/..., Triton's root) and of the NVIDIA driver's units, so a missing
program or an unknown dependency of ours is an error and nothing on this host is needed beyond systemd.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "systemd"
ANALYZE = shutil.which("systemd-analyze")
HOST_UNITS = Path("/usr/lib/systemd/system")


UNIT_FILES = sorted(p.name for p in UNITS.iterdir() if p.is_file())
# Units that the NVIDIA driver packages provide on GPU hosts.
DRIVER_UNITS = ["nvidia-persistenced.service", "nvidia-fabricmanager.service"]
# The Debian package's unit the drop-in extends.
REDIS_UNIT = "redis-server.service"


def _exec_paths(unit: Path) -> set[str]:
    paths: set[str] = set()
    for line in unit.read_text().splitlines():
        m = re.match(r"^Exec\w*=\s*[-+@!:]*(/\S+)", line)
        if m:
            paths.add(m.group(1))
    return paths


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("unit-root")
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree(HOST_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    system = root / "etc/systemd/system"
    system.mkdir(parents=True)
    for name in UNIT_FILES:
        shutil.copy(UNITS / name, system / name)
    shutil.copytree(UNITS / "redis-server.service.d", system / "redis-server.service.d")
    lib = root / "usr/lib/systemd/system"
    for name in DRIVER_UNITS:
        (lib / name).write_text(
            f"[Unit]\nDescription=stub of {name}\n[Service]\nExecStart=/bin/true\n"
        )
    if not (lib / REDIS_UNIT).exists():
        (lib / REDIS_UNIT).write_text(
            "[Unit]\nDescription=stub\n[Service]\nExecStart=/usr/bin/redis-server\n"
        )
    programs = {"/bin/true", "/bin/sh", "/usr/bin/redis-server"}
    for name in UNIT_FILES:
        programs |= _exec_paths(UNITS / name)
    programs |= _exec_paths(UNITS / "redis-server.service.d/appliance.conf")
    for program in programs:
        stub = root / program.lstrip("/")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
    # Triton runs inside the exported image root (RootDirectory=): its programs are looked up there.
    triton_root = root / "opt/triton-rootfs"
    for program in (
        "/opt/tritonserver/bin/tritonserver",
        "/usr/bin/curl",
        "/bin/sh",
        "/usr/local/libexec/appliance-triton-check-libs",
    ):
        stub = triton_root / program.lstrip("/")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
    return root


def _verify(root: Path, *units: str) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run(
        [ANALYZE, "verify", f"--root={root}", "--recursive-errors=yes", "--man=no", *units],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_every_unit_is_in_the_directory() -> None:
    assert set(UNIT_FILES) == {
        "appliance.target",
        "appliance-gateway.service",
        "appliance-engine.service",
        "appliance-triton.service",
        "appliance-host-tune.service",
        "appliance-host-verify.service",
        "appliance-host-verify.timer",
        "appliance-hold-latency.service",
        "appliance-acs.service",
    }


@pytest.mark.parametrize("unit", [*UNIT_FILES, REDIS_UNIT])
def test_verify(root: Path, unit: str) -> None:
    result = _verify(root, unit)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr


def test_verify_rejects_an_unknown_key(root: Path) -> None:
    bad = root / "etc/systemd/system/appliance-bad.service"
    bad.write_text(
        (UNITS / "appliance-gateway.service").read_text() + "\n[Service]\nWatchdogSecs=5\n"
    )
    try:
        result = _verify(root, "appliance-bad.service")
    finally:
        bad.unlink()
    assert result.returncode != 0
    assert "WatchdogSecs" in result.stderr


def test_host_verify_reads_only_and_writes_only_the_textfile_directory() -> None:
    """The drift check runs every few minutes: it can change no kernel setting and no file but
    its own, and its timer starts it after boot and again and again."""
    text = (UNITS / "appliance-host-verify.service").read_text()
    assert re.search(r"^ProtectKernelTunables=yes$", text, re.M)
    assert re.search(r"^ProtectSystem=strict$", text, re.M)
    (writable,) = re.findall(r"^ReadWritePaths=(.*)$", text, re.M)
    (textfile,) = re.findall(r"^Environment=HOST_TUNE_TEXTFILE=(.*)$", text, re.M)
    assert str(Path(textfile).parent) == writable
    assert "host-tune verify " in text and "--textfile ${HOST_TUNE_TEXTFILE}" in text
    assert not re.search(r"^(StateDirectory|RemainAfterExit)=", text, re.M)
    # The host_tuning role's drop-in sets both lines to its variable, whose default is the unit's.
    defaults = (REPO / "ansible/roles/host_tuning/defaults/main.yml").read_text()
    assert f"\nhost_tuning_textfile_dir: {writable}\n" in defaults
    timer = (UNITS / "appliance-host-verify.timer").read_text()
    assert re.search(r"^OnBootSec=", timer, re.M) and re.search(r"^OnUnitActiveSec=", timer, re.M)


def test_host_verify_drop_in_of_the_role_verifies_and_moves_the_writable_path(root: Path) -> None:
    """The host_tuning role's textfile.conf, rendered for another directory, is a valid drop-in
    that empties the unit's ReadWritePaths= before naming that directory."""
    tasks = (REPO / "ansible/roles/host_tuning/tasks/main.yml").read_text()
    (block,) = re.findall(
        r"^    content: \|\n((?:      .*\n)+)    dest: \S+/appliance-host-verify\.service\.d/textfile\.conf$",
        tasks,
        re.M,
    )
    template = "".join(line[6:] + "\n" for line in block.splitlines())
    text = jinja2.Template(template, keep_trailing_newline=True).render(
        host_tuning_textfile_dir="/srv/node-exporter"
    )
    assert "ReadWritePaths=\nReadWritePaths=/srv/node-exporter\n" in text
    assert "HOST_TUNE_TEXTFILE=/srv/node-exporter/appliance-host-tune.prom\n" in text
    target = root / "etc/systemd/system/appliance-host-verify.service.d"
    target.mkdir()
    (target / "textfile.conf").write_text(text)
    try:
        result = _verify(root, "appliance-host-verify.service")
    finally:
        shutil.rmtree(target)
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr


def test_gateway_is_notify_with_watchdog() -> None:
    text = (UNITS / "appliance-gateway.service").read_text()
    assert "\nType=notify\n" in text
    assert re.search(r"^WatchdogSec=\d+s$", text, re.M)
    assert re.search(r"^Restart=on-failure$", text, re.M)


def _oom_score_adjust(text: str) -> int:
    found = re.findall(r"^OOMScoreAdjust=(-?\d+)$", text, re.M)
    return int(found[-1]) if found else 0


def test_the_gateway_is_what_the_kernel_kills_when_memory_runs_out() -> None:
    """An OOM kill costs the gateway seconds (Restart=on-failure), the engine minutes of reloading
    weights and Redis the shared cache: only the gateway volunteers, and fully (1000 puts its score
    above any process that does not)."""
    gateway = (UNITS / "appliance-gateway.service").read_text()
    assert _oom_score_adjust(gateway) == 1000
    assert re.search(r"^Restart=on-failure$", gateway, re.M)
    for name in ("appliance-engine.service", "appliance-triton.service"):
        assert _oom_score_adjust((UNITS / name).read_text()) <= 0, name
    for drop_in in (UNITS / "redis-server.service.d").iterdir():
        assert _oom_score_adjust(drop_in.read_text()) <= 0, drop_in


def test_gateway_memory_drop_in_of_the_role_verifies_above_the_gateways_own_bounds(
    root: Path,
) -> None:
    """The role's opt-in cap (appliance_gateway_memory_max_mib) renders a drop-in systemd takes,
    and its floor holds the caches' default byte bounds with room for the process itself."""
    from appliance.config import CacheConfig, SemanticConfig

    role = REPO / "ansible/roles/appliance"
    assert "\nappliance_gateway_memory_max_mib: 0\n" in (role / "defaults/main.yml").read_text()
    assert "appliance_gateway_memory_max_mib:" in (role / "meta/argument_specs.yml").read_text()
    tasks = (role / "tasks/main.yml").read_text()
    (floor,) = re.findall(r"appliance_gateway_memory_max_mib \| int >= (\d+)$", tasks, re.M)
    caches = (CacheConfig.l1_max_bytes + SemanticConfig.max_bytes) // 2**20
    assert int(floor) >= caches + 1024, (floor, caches)
    template = jinja2.Template((role / "templates/gateway-memory.conf.j2").read_text())
    text = template.render(appliance_gateway_memory_max_mib=int(floor), ansible_managed="test")
    assert re.search(rf"^MemoryMax={floor}M$", text, re.M), text
    target = root / "etc/systemd/system/appliance-gateway.service.d"
    target.mkdir()
    (target / "memory.conf").write_text(text)
    try:
        result = _verify(root, "appliance-gateway.service")
    finally:
        shutil.rmtree(target)
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr


def test_triton_unit_gpu_access() -> None:
    text = (UNITS / "appliance-triton.service").read_text()
    assert "\nType=exec\n" in text
    assert "ExecStartPost=" in text and "/v2/health/ready" in text
    assert "LimitMEMLOCK=infinity" in text
    assert "nvidia-persistenced.service" in text
    assert "DeviceAllow=/dev/nvidiactl rw" in text
    assert not re.search(r"^PrivateDevices=", text, re.M)
    assert not re.search(r"^MemoryDenyWriteExecute=", text, re.M)


def test_triton_listens_on_loopback_only() -> None:
    """Triton binds gRPC (and HTTP) to 0.0.0.0 unless told otherwise, and its metrics to the HTTP
    address: without these flags every host that reaches the port runs inference with no API key,
    rate limit or token bound. The gateway on the same host is its only client."""
    text = (UNITS / "appliance-triton.service").read_text()
    (start,) = re.findall(r"^ExecStart=(.*)$", text, re.M)
    flags = dict(re.findall(r"--([a-z-]+)=(\S+)", start))
    assert flags.get("grpc-address") == "127.0.0.1", start
    assert flags.get("http-address") == "127.0.0.1", start
    # Its metrics' address is the triton role's triton_metrics_address (a remote Prometheus
    # scrapes the host's address), loopback unless set.
    assert flags.get("metrics-address") == "${TRITON_METRICS_ADDRESS}", start
    assert re.search(r"^Environment=TRITON_METRICS_ADDRESS=127\.0\.0\.1$", text, re.M), text
    env = (REPO / "ansible/roles/triton/templates/triton.env.j2").read_text()
    assert "\nTRITON_METRICS_ADDRESS={{ triton_metrics_address }}\n" in env
    defaults = (REPO / "ansible/roles/triton/defaults/main.yml").read_text()
    assert "\ntriton_metrics_address: 127.0.0.1\n" in defaults


def test_the_engine_server_serves_its_metrics_on_loopback_by_default() -> None:
    """The inference server's own page (nv_inference_*, nv_gpu_* on a GPU) is what Prometheus
    scrapes beside the gateway's: the engine server serves it where ENGINE_METRICS says, on
    loopback and Triton's metrics port unless engine.env says otherwise."""
    text = (UNITS / "appliance-engine.service").read_text()
    (start,) = re.findall(r"^ExecStart=(.*)$", text, re.M)
    assert " --metrics ${ENGINE_METRICS} " in start, start
    assert re.search(r"^Environment=.*\bENGINE_METRICS=127\.0\.0\.1:8002\b", text, re.M), text
    env = (REPO / "ansible/roles/appliance/templates/engine.env.j2").read_text()
    assert "\nENGINE_METRICS={{ appliance_backend_metrics }}\n" in env


def _exposure(root: Path, unit: str, threshold: float | None) -> tuple[int, float, str]:
    assert ANALYZE is not None
    argv = [ANALYZE, "security", "--offline=yes", f"--root={root}", "--no-pager"]
    if threshold is not None:
        argv.append(f"--threshold={threshold:g}")
    result = subprocess.run([*argv, unit], capture_output=True, text=True, timeout=120, check=False)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout + result.stderr)
    assert m, result.stdout + result.stderr
    return result.returncode, float(m.group(1)), result.stdout


def test_gateway_hardening(root: Path) -> None:
    # --threshold is on the internal 0..100 scale (13 = 1.3); systemd-analyze fails above it.
    rc, exposure, report = _exposure(root, "appliance-gateway.service", 13)
    assert rc == 0, report
    assert exposure <= 1.3


# The exposure each unit reaches (systemd-analyze's 0..10 scale), with what it keeps for
# the hardware it drives (docs/OPERATIONS.md "Hardening"); before hardening: triton 3.4, host-tune 9.5,
# ACS 9.5, hold-latency 5.9. host-verify reads what host-tune writes: below host-tune's.
EXPOSURE_LIMITS = {
    "appliance-triton.service": 3.1,
    "appliance-host-tune.service": 4.7,
    "appliance-host-verify.service": 2.6,
    "appliance-acs.service": 1.4,
    "appliance-hold-latency.service": 0.9,
}


@pytest.mark.parametrize(("unit", "limit"), sorted(EXPOSURE_LIMITS.items()))
def test_privileged_units_hardening(root: Path, unit: str, limit: float) -> None:
    rc, exposure, report = _exposure(root, unit, limit * 10)
    assert rc == 0 and exposure <= limit, report


def test_engine_hardening(root: Path) -> None:
    # CPU engine server: torch may JIT, so no MemoryDenyWriteExecute; still well hardened.
    _, exposure, report = _exposure(root, "appliance-engine.service", None)
    assert exposure <= 1.7, report


def test_engine_gpu_drop_in_verifies_and_keeps_an_allow_list(root: Path) -> None:
    """The engine server on a GPU: the role's drop-in opens the NVIDIA devices, and only them."""
    drop_in = UNITS / "appliance-engine.service.d/gpu.conf"
    text = drop_in.read_text()
    assert "DevicePolicy=closed" in text and "DeviceAllow=/dev/nvidiactl rw" in text
    assert re.search(r"^PrivateDevices=no$", text, re.M)
    unit = (UNITS / "appliance-engine.service").read_text()
    for var in (
        "DEVICE",
        "DTYPE",
        "WEIGHTS",
        "WEIGHT_GROUP",
        "FP8_SCALING",
        "CUDA_GRAPH",
        "KERNELS",
    ):
        assert f"${{ENGINE_{var}}}" in unit and f"ENGINE_{var}=" in unit  # used, with a default
    assert "ENGINE_DEVICE=cpu" in unit
    target = root / "etc/systemd/system/appliance-engine.service.d"
    target.mkdir()
    shutil.copy(drop_in, target / "gpu.conf")
    try:
        result = _verify(root, "appliance-engine.service")
        _, exposure, report = _exposure(root, "appliance-engine.service", None)
    finally:
        shutil.rmtree(target)
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr
    assert exposure <= EXPOSURE_LIMITS["appliance-triton.service"], report


def test_documentation_points_at_docs_the_role_installs() -> None:
    """`systemctl help UNIT` opens Documentation=: each must be a doc the appliance role installs."""
    tasks = (REPO / "ansible/roles/appliance/tasks/main.yml").read_text()
    task = tasks[tasks.index("- name: Install the operator documentation") :]
    task = task[: task.index("\n- name:")]
    assert "dest: /usr/share/doc/llm-appliance/ " in task
    installed = set(re.findall(r"^\s+- (\S+\.md)$", task, re.M))
    for name in UNIT_FILES:
        docs = re.findall(r"^Documentation=(.*)$", (UNITS / name).read_text(), re.M)
        assert docs, f"{name}: no Documentation="
        for url in " ".join(docs).split():
            doc = url.removeprefix("file:///usr/share/doc/llm-appliance/")
            assert doc != url, f"{name}: {url} is not under /usr/share/doc/llm-appliance/"
            assert doc in installed and (REPO / "docs" / doc).is_file(), f"{name}: {url}"
