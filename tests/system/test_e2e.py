"""End to end: the playbook provisions a booted Debian bookworm (systemd as PID 1 under systemd-nspawn, in a
network namespace this test creates) with the CPU profile, and the appliance answers a streamed Generate.

Steps, in order (each test is one step; they share one container):
  bad input   -> a missing and a contradictory variable fail in the play's first task, naming the variable
  first run   -> ansible-playbook site.yml succeeds; appliance.target and its services are active
  generate    -> a streamed Generate through the gateway in the container returns tokens
  guided      -> an answer under a JSON Schema parses and validates; a guide the engine's compile (a
                 child process under the engine's unit sandbox) refuses is INVALID_ARGUMENT, and the
                 engine stays up (no restart)
  semantic    -> a question, then its paraphrase answered by the semantic tier (Redis as the role's
                 ACL user, the embedder exported on the controller and copied by the role)
  access log  -> every request's access line reaches the journal past journald's rate limit
  second run  -> changed=0
  bad units   -> a missing config file / program fails the unit with a journal line naming it
  watchdog    -> SIGSTOP to the gateway: killed by the watchdog, restarted by systemd, answers again
  stop        -> `systemctl stop appliance.target` drains and stops every service cleanly
  GPU roles   -> the same host as a GPU host, with stand-ins for only what needs hardware (nvidia-smi,
                 nvidia-persistenced, the NGC Triton root, TensorRT-LLM; tests/system/gpu_stubs.py):
                 nvidia_prereqs, triton and engine_build in check mode, for real, again (changed=0),
                 in check mode again (changed=0); a driver below the image's floor and an empty
                 required variable fail with their messages

The Debian root (debootstrap, ~1-2 min) and the dependency wheels are cached in /var/cache/appliance-ci
(APPLIANCE_CI_CACHE); each run boots a fresh copy and installs a fresh wheel of this package. Nothing inside
the container reaches a network: the wheelhouse is bind-mounted read-only and every package the roles
need is in the root. Waits are bounded polls on state (is-active, NRestarts), never sleeps as assertions.
Needs root, systemd-nspawn, debootstrap, nsenter and .venv-ansible (make ansible-venv); tests/prereqs.py
stops the run naming what is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.system import containers, gpu_stubs
from tests.system.containers import REPO, Machine

pytestmark = pytest.mark.timeout(900)


UNITS = ["redis-server.service", "appliance-engine.service", "appliance-gateway.service"]
HOST = "appliance-ci"
_run = containers.run


def _recap(output: str) -> dict[str, int]:
    return containers.recap(output, HOST)


def _tasks(output: str) -> list[str]:
    return re.findall(r"^TASK \[(.*?)\]", output, re.M)


@pytest.fixture(scope="module")
def machine() -> Iterator[Machine]:
    started = time.monotonic()
    root_src = containers.root_source()
    workdir = Path(tempfile.mkdtemp(prefix="appliance-e2e-", dir="/var/tmp"))
    netns = f"appliance-e2e-{os.getpid()}"
    m: Machine | None = None
    try:
        wheels = containers.wheelhouse(workdir / "wheels")
        root = containers.copy_root(root_src, workdir / "root")
        assert _run(["ip", "netns", "add", netns]).returncode == 0
        assert _run(["ip", "-n", netns, "link", "set", "lo", "up"]).returncode == 0
        m = containers.boot(HOST, workdir, root, netns, [f"{wheels}:/srv/wheelhouse"])
        print(f"\ncontainer booted in {time.monotonic() - started:.0f} s", file=sys.stderr)
        yield m
    finally:
        if m is not None:
            containers.stop(m.nspawn)
        _run(["ip", "netns", "delete", netns])
        if os.environ.get("APPLIANCE_E2E_KEEP"):
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def inventory(machine: Machine, embedder_dir: Path) -> Callable[..., Path]:
    """The CPU profile's inventory with the semantic tier on (the `appliance semantic-setup`
    directory this test session exported, on the controller)."""

    def write(**extra: object) -> Path:
        return machine.inventory("cpu", appliance_semantic_embedder_src=str(embedder_dir), **extra)

    return write


# The inventory check (on the controller), then the provisioning play's check of every role's variables.
FIRST_TASKS = [
    "Fail when no host is in group gpu or cpu",
    "Validate the variables of every role this host runs",
]


def test_missing_variable_fails_first_task(machine: Machine) -> None:
    result = machine.playbook(machine.inventory(appliance_wheelhouse=None), timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert _tasks(out) == FIRST_TASKS, out
    assert "missing required arguments: appliance_wheelhouse" in out


def test_contradictory_variable_fails_first_task(machine: Machine) -> None:
    both = {"dir": "/srv/wheelhouse", "src": "/tmp/wheels"}
    result = machine.playbook(machine.inventory(appliance_wheelhouse=both), timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert _tasks(out) == FIRST_TASKS, out
    assert "mutually exclusive: dir|src found in appliance_wheelhouse" in out


def test_first_run_provisions_the_appliance(
    machine: Machine, inventory: Callable[..., Path]
) -> None:
    t0 = time.monotonic()
    result = machine.playbook(inventory())
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:] + machine.journal("appliance-engine.service")[-3000:]
    recap = _recap(out)
    assert recap["failed"] == 0 and recap["changed"] > 0
    print(f"\nfirst playbook run: {time.monotonic() - t0:.0f} s, {recap}", file=sys.stderr)
    assert machine.is_active("appliance.target") == "active"
    for unit in UNITS:
        assert machine.is_active(unit) == "active", machine.journal(unit)[-2000:]
    # The GPU-only units are installed but not started in the CPU profile.
    assert machine.is_active("appliance-triton.service") == "inactive"
    # The units' Documentation= targets are installed.
    docs = machine.sh("ls", "/usr/share/doc/llm-appliance").stdout.split()
    assert {"OPERATIONS.md", "HOST_TUNING.md"} <= set(docs), docs


def _client(machine: Machine, module: str, *args: str, timeout: float) -> dict[str, Any]:
    """Runs a client module of tests/system in the container's network namespace; its JSON line.
    A failure shows the client's stderr and the gateway's journal."""
    result = _run(
        ["ip", "netns", "exec", machine.netns, sys.executable, "-m", module, *args],
        timeout=timeout,
        cwd=REPO,
    )
    assert result.returncode == 0, (
        result.stderr[-3000:] + machine.journal("appliance-gateway.service")[-3000:]
    )
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


def _generate(machine: Machine) -> dict[str, Any]:
    return _client(machine, "tests.system.stream_generate", "127.0.0.1:50051", timeout=90)


def test_streamed_generate_returns_tokens(machine: Machine) -> None:
    answer = _generate(machine)
    assert answer["tokens"] == 16, answer
    assert int(answer["messages"]) > 1, answer  # streamed, not one message
    assert answer["finish_reason"] == "FINISH_REASON_LENGTH", answer
    assert answer["text"]
    # It went over the engine's stream socket: its listener and the gateway's stream kept open
    # there (the hardened gateway reaches the engine's runtime directory).
    unix = machine.sh("cat", "/proc/net/unix").stdout.splitlines()
    named = [line for line in unix if line.endswith(" /run/appliance-engine/streams.sock")]
    assert len(named) == 2, unix


def test_a_guided_answer_validates_and_a_bad_guide_leaves_the_engine_up(machine: Machine) -> None:
    """The tiny model's repository has guided decoding on (the role's default): the engine
    compiles every new guide first in a forkserver child under its unit's sandbox (seccomp
    filter, private /tmp, read-only system, resource limits), then in itself."""
    engine = "appliance-engine.service"
    info = "/var/lib/appliance/models/repo/tensorrt_llm/tokenizer/xgrammar_tokenizer_info.json"
    assert machine.sh("test", "-f", info).returncode == 0, "the repository has guided decoding off"
    restarts, pid = machine.show(engine, "NRestarts"), machine.show(engine, "MainPID")
    answer = _client(machine, "tests.system.guided_generate", "127.0.0.1:50051", timeout=300)
    assert answer["finish_reason"] == "FINISH_REASON_STOP", answer
    jsonschema.validate(json.loads(answer["text"]), answer["schema"])
    refused = answer["refused"]
    assert refused["code"] == "INVALID_ARGUMENT", refused
    # The gateway names where the refusal came from.
    assert refused["details"].startswith("inference server: the EBNF grammar cannot be compiled: ")
    assert 'Rule "undefined" is not defined' in refused["details"], refused
    assert machine.is_active(engine) == "active", machine.journal(engine)[-3000:]
    assert (machine.show(engine, "NRestarts"), machine.show(engine, "MainPID")) == (restarts, pid)


# What the probe's unit takes from the engine's: every [Service] setting but how it starts, stops
# and is supervised, and its runtime directory (removed when the probe stops: the engine's socket).
NOT_SANDBOX = {
    "Type", "NotifyAccess", "ExecStartPre", "ExecStart", "WatchdogSec", "Restart", "RestartSec",
    "TimeoutStartSec", "TimeoutStopSec", "RuntimeDirectory", "RuntimeDirectoryMode",
}  # fmt: skip
PROBE = "appliance-guide-probe.service"


def _sandbox_of(unit_text: str) -> list[str]:
    """The [Service] lines of `systemctl cat` output (the unit and its drop-ins) that sandbox it."""
    kept, section = [], ""
    for line in unit_text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            kept += [line] if line.split("=", 1)[0] not in NOT_SANDBOX else []
    return kept


def test_the_guide_compile_keeps_its_limits_in_the_engine_units_sandbox(machine: Machine) -> None:
    """The compile's child lowers its own memory and CPU limits (setrlimit) and is killed at its
    deadline; a sandbox that refused the limit would leave it unbounded without a word. The
    installed venv's compile path, run in a unit with the engine unit's sandbox settings."""
    engine = machine.sh("systemctl", "cat", "appliance-engine.service")
    assert engine.returncode == 0, engine.stderr
    sandbox = _sandbox_of(engine.stdout)
    assert "SystemCallFilter=@system-service" in sandbox and "PrivateTmp=yes" in sandbox, sandbox
    root = machine.workdir / "root"
    script = "usr/local/lib/appliance-guide-probe.py"
    unit = f"etc/systemd/system/{PROBE}"
    shutil.copyfile(REPO / "tests/system/guide_compile_probe.py", root / script)
    start = f"ExecStart=/opt/appliance/venv/bin/python /{script} /var/lib/appliance/models"
    (root / unit).write_text("\n".join(["[Service]", "Type=oneshot", *sandbox, start, ""]))
    try:
        assert machine.sh("systemctl", "daemon-reload").returncode == 0
        ran = machine.sh("systemctl", "start", PROBE, timeout=300)
        journal = machine.journal(PROBE)
        assert ran.returncode == 0, journal[-3000:]
        seen = json.loads([line for line in journal.splitlines() if line.startswith("{")][-1])
    finally:
        (root / unit).unlink()
        (root / script).unlink()
        machine.sh("systemctl", "daemon-reload")
    assert seen["memory"].startswith("the JSON Schema cannot be compiled within 1 MiB"), seen
    assert seen["deadline"].startswith("the JSON Schema cannot be compiled within 0.5 s"), seen
    assert seen["after"] == "compiled" and seen["children"] == [], seen


def test_a_paraphrase_is_answered_by_the_semantic_tier(machine: Machine) -> None:
    probe = "tests.system.semantic_probe"
    answer = _client(machine, probe, "127.0.0.1:50051", "127.0.0.1:9464", timeout=240)
    assert answer["question"] == "CACHE_TIER_MISS", answer
    assert answer["paraphrase"] == "CACHE_TIER_SEMANTIC", answer
    assert answer["same_text"] and answer["similarity"] > 0.8, answer
    seen = answer["metrics"]
    assert seen["appliance_semantic_follower_errors_total"] == 0, seen
    assert seen["appliance_semantic_store_failures_total"] == 0, seen


def test_every_access_line_reaches_the_journal(machine: Machine) -> None:
    """journald drops a unit's lines past its rate limit (by default 10,000 in 30 s): at a few
    hundred requests a second, access lines would be lost. The gateway's unit lifts the limit;
    shown with journald's own limit lowered to 5 lines (journald raises it with the free disk
    space, about 4 x for 10 GB) and a run of 60 requests."""
    dropin = "/etc/systemd/journald.conf.d/appliance-test-burst.conf"
    written = machine.sh(
        "sh",
        "-c",
        f"mkdir -p {dropin.rsplit('/', 1)[0]} && "
        f"printf '[Journal]\\nRateLimitIntervalSec=30s\\nRateLimitBurst=5\\n' > {dropin}",
    )
    assert written.returncode == 0, written.stderr
    unit = "appliance-gateway.service"
    try:
        assert machine.sh("systemctl", "restart", "systemd-journald.service").returncode == 0
        before = machine.journal(unit).count("front_end=")
        options = ["--address", "127.0.0.1:50051", "--model", "tiny-llama", "--requests", "60"]
        options += ["--warmup", "0", "--prompt-tokens", "8", "--output-tokens", "1"]
        bench = _run(
            [
                "ip",
                "netns",
                "exec",
                machine.netns,
                sys.executable,
                "-m",
                "appliance",
                "bench",
                *options,
            ],
            timeout=240,
            cwd=REPO,
        )
        assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]

        def logged() -> int:
            return machine.journal(unit).count("front_end=") - before

        # The bench's own first request (its preflight) is logged too.
        machine.wait_for("61 access lines", lambda: logged() >= 61, 30)
    finally:
        machine.sh("rm", "-f", dropin)
        machine.sh("systemctl", "restart", "systemd-journald.service")


def test_second_run_changes_nothing(machine: Machine, inventory: Callable[..., Path]) -> None:
    t0 = time.monotonic()
    result = machine.playbook(inventory())
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    recap = _recap(out)
    assert recap["changed"] == 0, containers.changed_tasks(out)
    print(f"\nsecond playbook run: {time.monotonic() - t0:.0f} s, {recap}", file=sys.stderr)


def test_check_mode_changes_nothing(machine: Machine, inventory: Callable[..., Path]) -> None:
    result = machine.playbook(inventory(), check=True)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    recap = _recap(out)
    assert recap["changed"] == 0, containers.changed_tasks(out)


def test_missing_config_is_named_in_the_journal(machine: Machine) -> None:
    config = "/etc/appliance/gateway.toml"
    assert machine.sh("mv", config, config + ".away").returncode == 0
    try:
        failed = machine.sh("systemctl", "restart", "appliance-gateway.service", timeout=60)
        assert failed.returncode != 0
        journal = machine.journal("appliance-gateway.service")
        assert f"appliance serve: {config}: cannot read configuration" in journal, journal[-2000:]
    finally:
        machine.sh("mv", config + ".away", config)


def test_missing_engine_env_is_named_in_the_journal(machine: Machine) -> None:
    env = "/etc/appliance/engine.env"
    assert machine.sh("mv", env, env + ".away").returncode == 0
    try:
        failed = machine.sh("systemctl", "restart", "appliance-engine.service", timeout=60)
        assert failed.returncode != 0
        journal = machine.journal("appliance-engine.service")
        assert f"appliance-engine: {env} is missing" in journal, journal[-2000:]
    finally:
        machine.sh("mv", env + ".away", env)


def test_missing_program_is_named_in_the_journal(machine: Machine) -> None:
    program = "/opt/appliance/venv/bin/appliance"
    assert machine.sh("mv", program, program + ".away").returncode == 0
    try:
        failed = machine.sh("systemctl", "restart", "appliance-gateway.service", timeout=60)
        assert failed.returncode != 0
        journal = machine.journal("appliance-gateway.service")
        assert f"Failed to locate executable {program}" in journal, journal[-2000:]
    finally:
        machine.sh("mv", program + ".away", program)
    # Back to a serving appliance for the next steps (Type=notify: returns once READY=1).
    for unit in ("appliance-engine.service", "appliance-gateway.service"):
        machine.sh("systemctl", "reset-failed", unit)
    started = machine.sh("systemctl", "start", "appliance.target", timeout=300)
    assert started.returncode == 0, started.stderr
    for unit in UNITS:
        assert machine.is_active(unit) == "active", machine.journal(unit)[-2000:]


def test_watchdog_restarts_a_stopped_gateway(machine: Machine) -> None:
    unit = "appliance-gateway.service"
    pid = machine.show(unit, "MainPID")
    restarts = int(machine.show(unit, "NRestarts"))
    assert pid not in ("", "0")
    assert machine.sh("kill", "-STOP", pid).returncode == 0

    def restarted() -> bool:
        return (
            int(machine.show(unit, "NRestarts") or 0) > restarts
            and machine.is_active(unit) == "active"
            and machine.show(unit, "MainPID") not in ("", "0", pid)
        )

    # WatchdogSec=10s, then SIGABRT, RestartSec=1s and a start-up with a warm-up request.
    machine.wait_for("the watchdog to kill and systemd to restart the gateway", restarted, 120)
    journal = machine.journal(unit)
    assert "Watchdog timeout" in journal, journal[-2000:]
    answer = _generate(machine)
    assert answer["tokens"] == 16, answer


def test_stop_target_drains_and_stops_cleanly(machine: Machine) -> None:
    stopped = machine.sh("systemctl", "stop", "appliance.target", timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    # `systemctl stop` returns once the target's own job is done; the services it consists of (PartOf=)
    # are stopped by jobs of the same transaction that may still be draining.
    for unit in ["appliance.target", *UNITS]:

        def inactive(u: str = unit) -> bool:
            return machine.is_active(u) == "inactive"

        machine.wait_for(f"{unit} to stop", inactive, 60)
    for unit in UNITS:
        assert machine.show(unit, "Result") == "success", machine.journal(unit)[-2000:]
    journal = machine.journal("appliance-gateway.service")
    assert "draining for up to" in journal, journal[-2000:]


# --- the GPU roles, with stand-ins for what needs hardware ----------------------------------------

GPU_ROLES = ("nvidia_prereqs", "triton", "engine_build")


@pytest.fixture(scope="module")
def gpu(machine: Machine) -> gpu_stubs.GpuArtifacts:
    """The stand-ins, put into the container once its CPU-profile steps are done."""
    version = machine.sh(
        "python3", "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"
    )
    assert version.returncode == 0, version.stderr
    venv = machine.sh("python3", "-m", "venv", "--without-pip", gpu_stubs.TRTLLM_VENV)
    assert venv.returncode == 0, venv.stderr
    gpu_stubs.install_in_root(machine.workdir / "root", version.stdout.strip())
    assert machine.sh("systemctl", "daemon-reload").returncode == 0
    return gpu_stubs.controller_artifacts(machine.workdir / "gpu")


def _gpu_inventory(machine: Machine, gpu: gpu_stubs.GpuArtifacts, **extra: object) -> Path:
    variables: dict[str, object] = {
        # Triton cannot start without a GPU; the GPU roles install and configure, nothing starts.
        "appliance_start": False,
        "host_tuning_enabled": False,
        "triton_archive_src": str(gpu.archive),
        "triton_archive_sha256": gpu.archive_sha256,
        "triton_image_config_src": str(gpu.image_config),
        "engine_build_spec_src": str(gpu.spec),
        "engine_build_gpu_memory": "80GiB",
    }
    return machine.inventory("gpu", **{**variables, **extra})


def _role_tasks(output: str, role: str) -> list[str]:
    return [t for t in _tasks(output) if t.startswith(f"{role} : ")]


def test_gpu_roles_in_check_mode_on_a_new_gpu_host(
    machine: Machine, gpu: gpu_stubs.GpuArtifacts
) -> None:
    result = machine.playbook(_gpu_inventory(machine, gpu), check=True)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert _recap(out)["failed"] == 0
    for role in GPU_ROLES:
        assert _role_tasks(out, role), f"{role} did not run"
    assert "nvidia_prereqs : Check the NVIDIA driver runs the pinned Triton image" in out
    # Check mode changed nothing on the host.
    assert machine.sh("test", "-e", "/opt/triton-rootfs").returncode != 0
    assert machine.sh("test", "-e", "/etc/appliance/engine-build.toml").returncode != 0


def test_gpu_roles_provision_with_stubbed_hardware(
    machine: Machine, gpu: gpu_stubs.GpuArtifacts
) -> None:
    result = machine.playbook(_gpu_inventory(machine, gpu), timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    recap = _recap(out)
    assert recap["failed"] == 0 and recap["changed"] > 0
    changed = containers.changed_tasks(out)
    assert "nvidia_prereqs : Restart nvidia-persistenced" in changed, changed
    # triton and engine_build both notify "Restart triton"; Ansible runs the one handler once.
    assert any(task.endswith(" : Restart triton") for task in changed), changed
    # nvidia_prereqs: persistence mode on through the drop-in, the daemon running.
    assert machine.is_active("nvidia-persistenced.service") == "active"
    assert "--persistence-mode" in machine.show("nvidia-persistenced.service", "ExecStart")
    # triton: root unpacked, the image's own environment, the library check in the root.
    env = machine.sh("cat", "/etc/appliance/triton-image.env").stdout
    assert gpu_stubs.IMAGE_MARKER in env and gpu_stubs.IMAGE_LD_LIBRARY_PATH in env, env
    check = "/opt/triton-rootfs/usr/local/libexec/appliance-triton-check-libs"
    assert machine.sh("test", "-x", check).returncode == 0
    assert machine.show("appliance-triton.service", "UnitFileState") == "enabled"
    assert "/etc/appliance/triton-image.env" in machine.show(
        "appliance-triton.service", "EnvironmentFiles"
    )
    # engine_build: built by the stand-in TensorRT-LLM, laid out, verified against the root.
    config = machine.sh("cat", "/var/lib/appliance/models/repo/tensorrt_llm/config.pbtxt").stdout
    assert 'key: "guided_decoding_backend"' in config, config
    verify = machine.sh(
        "/opt/appliance/venv/bin/engine-build",
        "verify",
        "/var/lib/appliance/models/repo",
        "--triton-root",
        "/opt/triton-rootfs",
    )
    assert verify.returncode == 0, verify.stderr


def test_gpu_second_run_changes_nothing(machine: Machine, gpu: gpu_stubs.GpuArtifacts) -> None:
    result = machine.playbook(_gpu_inventory(machine, gpu))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert _recap(out)["changed"] == 0, containers.changed_tasks(out)


def test_gpu_check_mode_after_provisioning_changes_nothing(
    machine: Machine, gpu: gpu_stubs.GpuArtifacts
) -> None:
    result = machine.playbook(_gpu_inventory(machine, gpu), check=True)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert _recap(out)["changed"] == 0, containers.changed_tasks(out)


def test_a_driver_below_the_image_floor_fails_naming_the_image(
    machine: Machine, gpu: gpu_stubs.GpuArtifacts
) -> None:
    root = machine.workdir / "root"
    gpu_stubs.set_driver(root, "570.172.08")
    try:
        result = machine.playbook(_gpu_inventory(machine, gpu))
    finally:
        gpu_stubs.set_driver(root, gpu_stubs.GOOD_DRIVER)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert (
        "NVIDIA driver 570.172.08 is older than 580.65.06, the floor of "
        "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3 (CUDA 13.0)"
    ) in out, out[-3000:]
    assert (
        _tasks(out)[-1] == "nvidia_prereqs : Check the NVIDIA driver runs the pinned Triton image"
    )


def test_an_archive_other_than_the_pinned_one_is_refused_before_the_copy(
    machine: Machine, gpu: gpu_stubs.GpuArtifacts
) -> None:
    wrong = "f" * 64
    result = machine.playbook(_gpu_inventory(machine, gpu, triton_archive_sha256=wrong))
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"has sha256 {gpu.archive_sha256}, not triton_archive_sha256 {wrong}" in out, out[-3000:]
    assert _tasks(out)[-1] == "triton : Check the Triton archive is the pinned one"


def test_an_empty_required_gpu_variable_fails_the_first_task(
    machine: Machine, gpu: gpu_stubs.GpuArtifacts
) -> None:
    result = machine.playbook(_gpu_inventory(machine, gpu, triton_archive_sha256=""), timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert _tasks(out) == FIRST_TASKS, out
    assert "value of triton_archive_sha256 must be one of: a non-empty value" in out


# --- host_tuning and its drift check under the container's systemd -----------------------------

TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
VERIFY = "appliance-host-verify.service"
# The smallest plan (1 housekeeping core, 1 Triton core): fits a 2-CPU CI host.
CONTAINER_PROFILE = """\
[serve]
gpu = 0

[cpu]
housekeeping_cores = 1
nic_irq_cores = 0
gateway_cores = 0

[gpudirect]
method = "none"
"""
APPLY_FAILED = "host_tuning : Fail when a setting did not take"


@pytest.fixture(scope="module")
def tuning(machine: Machine, gpu: gpu_stubs.GpuArtifacts) -> Path:
    """A GPU host whose host-tune sees a GPU; the inventory with host_tuning on."""
    gpu_stubs.show_gpu_in_sysfs(machine)
    profile = machine.workdir / "host-tune-profile.toml"
    profile.write_text(CONTAINER_PROFILE)
    return _gpu_inventory(
        machine, gpu, host_tuning_enabled=True, host_tuning_profile_src=str(profile)
    )


def test_host_tuning_in_a_container_fails_naming_what_it_cannot_set(
    machine: Machine, tuning: Path
) -> None:
    # nspawn mounts /proc/sys, /proc/irq and /sys read-only: apply writes the files under /etc and
    # is refused every kernel setting. The host is not tuned, so the play fails, in one message.
    result = machine.playbook(tuning)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert _tasks(out)[-1] == APPLY_FAILED, out[-4000:]
    assert "setting(s) failed: " in out and "sysctl vm.swappiness" in out, out[-3000:]
    assert "Read-only file system" in out and "host_tuning_enabled false" in out, out[-3000:]
    # What apply could write, it wrote: the kernel command line for the next boot.
    grub = machine.sh("grep", "-rh", "isolcpus", "/etc/default/grub.d").stdout
    assert "isolcpus=" in grub, grub
    # The drift check was set up before apply: the host reports its state from now on.
    marker = machine.sh("cat", f"{TEXTFILE_DIR}/appliance-host-tune-expected.prom").stdout
    assert "appliance_host_tune_expected 1" in marker, marker
    assert machine.show("appliance-host-verify.timer", "UnitFileState") == "enabled"
    assert machine.is_active("appliance-host-verify.timer") == "active"
    timers = machine.sh("systemctl", "list-timers", "--all", "--no-pager").stdout
    scheduled = [line for line in timers.splitlines() if "appliance-host-verify.timer" in line]
    assert scheduled and not scheduled[0].startswith("-"), timers  # NEXT is set
    assert machine.show(VERIFY, "ReadWritePaths") == TEXTFILE_DIR
    assert machine.show(VERIFY, "ProtectSystem") == "strict"
    # Again: nothing changes, and the same task says the same thing.
    again = machine.playbook(tuning)
    out = again.stdout + again.stderr
    assert again.returncode != 0 and _tasks(out)[-1] == APPLY_FAILED, out[-4000:]
    assert _recap(out)["changed"] == 0, containers.changed_tasks(out)


def test_host_tuning_check_mode_runs_the_whole_role(machine: Machine, tuning: Path) -> None:
    # apply --dry-run reports would-change, no failure: check mode goes through the role, and
    # would change only the tasks after the one the real runs stopped at.
    result = machine.playbook(tuning, check=True)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert APPLY_FAILED not in containers.changed_tasks(out)
    assert [t for t in containers.changed_tasks(out) if t.startswith("host_tuning")] == [
        "host_tuning : Create the drop-in directories",
        "host_tuning : Write the CPUAffinity drop-ins",
        "host_tuning : List the ACS bridges for appliance-acs.service",
    ]


def _textfile(machine: Machine, path: str) -> dict[str, float]:
    read = machine.sh("cat", path)
    assert read.returncode == 0, read.stderr
    return {
        name: float(value)
        for name, value in re.findall(r"^(\S+) (\S+)$", read.stdout, re.M)
        if not name.startswith("#")
    }


def test_drift_check_writes_the_textfile_from_its_sandbox(machine: Machine, tuning: Path) -> None:
    started = time.time()
    machine.sh("systemctl", "reset-failed", VERIFY)
    ran = machine.sh("systemctl", "start", VERIFY, timeout=150)
    # The kernel settings apply was refused are drift: exit 1 fails the unit, by design.
    assert ran.returncode != 0
    assert machine.show(VERIFY, "ExecMainStatus") == "1", machine.journal(VERIFY)[-3000:]
    assert "setting(s) drifted" in machine.journal(VERIFY)
    path = f"{TEXTFILE_DIR}/appliance-host-tune.prom"
    seen = _textfile(machine, path)
    assert seen["appliance_host_tune_verify_exit_code"] == 1, seen
    assert seen["appliance_host_tune_verify_timestamp_seconds"] >= started - 1, seen
    assert seen['appliance_host_tune_settings{plugin="sysctl",status="drift"}'] > 0, seen
    assert seen['appliance_host_tune_settings{plugin="irqbalance",status="ok"}'] == 1, seen
    mode = machine.sh("stat", "-c", "%a", path).stdout.strip()
    assert mode == "644", mode  # node_exporter's user reads it


def test_drift_check_may_write_nowhere_else(machine: Machine, tuning: Path) -> None:
    elsewhere = "/var/lib/appliance-probe"
    dropin = f"/run/systemd/system/{VERIFY}.d/zz-elsewhere.conf"  # after textfile.conf
    assert machine.sh("mkdir", "-p", elsewhere, os.path.dirname(dropin)).returncode == 0
    text = f"[Service]\nEnvironment=HOST_TUNE_TEXTFILE={elsewhere}/appliance-host-tune.prom\n"
    write = machine.sh("sh", "-c", f"printf '{text}' > {dropin} && systemctl daemon-reload")
    assert write.returncode == 0, write.stderr
    try:
        machine.sh("systemctl", "reset-failed", VERIFY)
        ran = machine.sh("systemctl", "start", VERIFY, timeout=150)
        assert ran.returncode != 0
        journal = machine.journal(VERIFY)
        assert "Read-only file system" in journal, journal[-3000:]
        assert machine.sh("ls", "-A", elsewhere).stdout == ""
    finally:
        machine.sh("rm", "-f", dropin)
        machine.sh("systemctl", "daemon-reload")
        machine.sh("systemctl", "reset-failed", VERIFY)
