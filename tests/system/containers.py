"""Booted Debian containers for the system tests: systemd as PID 1 under systemd-nspawn, each in a network
namespace, driven by ansible-playbook over community.docker.nsenter.

The Debian root (debootstrap) and the dependency wheels are cached in /var/cache/appliance-ci
(APPLIANCE_CI_CACHE, build-rootfs.sh and build-wheelhouse.sh); each container boots a fresh copy of
the root. Waits are bounded polls on state, never sleeps as assertions.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support import until

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
ANSIBLE_BIN = REPO / ".venv-ansible" / "bin"
HERE = Path(__file__).resolve().parent


def run(
    argv: list[str],
    timeout: float = 120,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, cwd=cwd, env=env
    )


def root_source() -> Path:
    """The cached Debian root (built on first use)."""
    built = run([str(HERE / "build-rootfs.sh")], timeout=900)
    assert built.returncode == 0, built.stderr
    return Path(built.stdout.strip())


def wheelhouse(dest: Path) -> Path:
    """A wheelhouse with a fresh wheel of this package (the dependencies are cached)."""
    built = run([str(HERE / "build-wheelhouse.sh"), str(dest)], timeout=900)
    assert built.returncode == 0, built.stderr
    return dest


@dataclass
class Machine:
    name: str
    workdir: Path
    netns: str
    nspawn: subprocess.Popen[bytes]
    leader: int

    def sh(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Runs a command inside the container (all its namespaces)."""
        return run(["nsenter", "-t", str(self.leader), "-a", *argv], timeout=timeout)

    def show(self, unit: str, prop: str) -> str:
        return self.sh("systemctl", "show", "-p", prop, "--value", unit).stdout.strip()

    def is_active(self, unit: str) -> str:
        return self.sh("systemctl", "is-active", unit).stdout.strip()

    def journal(self, unit: str, since: str = "") -> str:
        argv = ["journalctl", "--no-pager", "-o", "cat", "-u", unit]
        if since:
            argv += ["--since", since]
        return self.sh(*argv).stdout

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float) -> None:
        """Polls `predicate()` until true, at most `timeout` seconds; fails naming `what`."""
        until(predicate, f"timed out waiting for {what}", timeout, 0.5)

    def host_vars(self, **extra: object) -> dict[str, object]:
        """This container's inventory entry: reached with nsenter, wheels at /srv/wheelhouse."""
        host: dict[str, object] = {
            "ansible_connection": "community.docker.nsenter",
            "ansible_nsenter_pid": self.leader,
            # nsenter already runs as root inside the container (no sudo there).
            "ansible_become": False,
            "appliance_wheelhouse": {"dir": "/srv/wheelhouse"},
        }
        host.update(extra)
        return {k: v for k, v in host.items() if v is not None}

    def inventory(self, group: str = "cpu", **extra: object) -> Path:
        return write_inventory(self.workdir, {self.name: self.host_vars(**extra)}, group)

    def playbook(
        self, inventory: Path, timeout: float = 600, check: bool = False, play: str = "site.yml"
    ) -> subprocess.CompletedProcess[str]:
        return playbook(self.workdir, inventory, timeout, check, play)


def write_inventory(workdir: Path, hosts: dict[str, dict[str, object]], group: str = "cpu") -> Path:
    """An inventory with these hosts in `group` (cpu or gpu)."""
    path = workdir / f"inventory-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps({"all": {"children": {group: {"hosts": hosts}}}}))
    return path


def playbook(
    workdir: Path,
    inventory: Path,
    timeout: float = 600,
    check: bool = False,
    play: str = "site.yml",
) -> subprocess.CompletedProcess[str]:
    """ansible-playbook PLAY; its output is kept next to the inventory (APPLIANCE_E2E_KEEP)."""
    # A clean environment: nsenter passes ours into the container (PIP_* settings of this host
    # would point pip inside at paths that do not exist there).
    env = {
        "PATH": f"{ANSIBLE_BIN}:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(workdir),
        "LC_ALL": "C.UTF-8",
        "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
        "ANSIBLE_LOCAL_TEMP": str(workdir / "ansible-tmp"),
        "ANSIBLE_NOCOLOR": "1",
    }
    result = run(
        [
            str(ANSIBLE_BIN / "ansible-playbook"),
            "-i",
            str(inventory),
            play,
            *(["--check"] if check else []),
        ],
        timeout=timeout,
        cwd=ANSIBLE,
        env=env,
    )
    log = workdir / f"{inventory.stem}-{Path(play).stem}{'-check' if check else ''}.log"
    log.write_text(result.stdout + result.stderr)
    return result


def recap(output: str, host: str) -> dict[str, int]:
    m = re.search(rf"^{re.escape(host)}\s*:\s*(ok=.*)", output, re.M)
    assert m, output[-3000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}


def changed_tasks(output: str) -> list[str]:
    """The names of the tasks that reported a change."""
    changed: list[str] = []
    task = ""
    for line in output.splitlines():
        m = re.match(r"^(?:TASK|RUNNING HANDLER) \[(.*?)\]", line)
        if m:
            task = m.group(1)
        elif line.startswith("changed:") and task not in changed:
            changed.append(task)
    return changed


def boot(
    name: str, workdir: Path, root: Path, netns: str, binds: list[str], timeout: float = 120
) -> Machine:
    """Boots `root` (a copy of its own) in network namespace `netns` (which must exist); returns
    once systemd says the system is running. `binds`: systemd-nspawn --bind-ro= arguments."""
    log = (workdir / f"nspawn-{name}.log").open("wb")
    nspawn = subprocess.Popen(
        [
            "systemd-nspawn",
            "--quiet",
            "--keep-unit",
            "--register=no",
            f"--directory={root}",
            f"--machine={name}",
            "--boot",
            "--console=passive",
            f"--network-namespace-path=/run/netns/{netns}",
            *[f"--bind-ro={b}" for b in binds],
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:

        def container_init() -> int:
            assert nspawn.poll() is None, (workdir / f"nspawn-{name}.log").read_text()
            return _container_init(nspawn.pid)

        leader = until(container_init, "systemd-nspawn started no container", 60.0, 0.2)
        m = Machine(name, workdir, netns, nspawn, leader)

        # Until PID 1 has its private bus socket, systemctl cannot connect; entered before nspawn
        # has exec'd systemd, it answers "offline": poll, bounded.
        def system_state() -> subprocess.CompletedProcess[str] | None:
            run = m.sh("systemctl", "is-system-running", "--wait", timeout=timeout)
            if run.stdout.strip() not in ("", "offline"):
                return run
            assert nspawn.poll() is None, (workdir / f"nspawn-{name}.log").read_text()
            return None

        booted = until(system_state, f"container {name} stayed offline", timeout, 0.2)
        state = booted.stdout.strip()
        assert state in ("running", "degraded"), (
            f"container {name} state {state!r}: {booted.stderr.strip()}"
        )
    except BaseException:
        stop(nspawn)
        raise
    return m


def _container_init(nspawn_pid: int) -> int:
    """The container's PID 1 among nspawn's children, 0 while there is none yet. nspawn first
    forks a helper that starts the container's init and exits; entering that helper's namespaces
    would fail once it is gone, so only a child that is PID 1 of its own PID namespace counts."""
    for child in run(["pgrep", "-P", str(nspawn_pid)]).stdout.split():
        try:
            status = Path(f"/proc/{child}/status").read_text()
        except OSError:
            continue
        nspid = re.search(r"^NSpid:\s*(.*)$", status, re.M)
        if nspid and len(nspid.group(1).split()) > 1 and nspid.group(1).split()[-1] == "1":
            return int(child)
    return 0


def copy_root(source: Path, dest: Path) -> Path:
    copied = run(["cp", "-a", "--reflink=auto", str(source), str(dest)], timeout=300)
    assert copied.returncode == 0, copied.stderr
    return dest


def stop(nspawn: subprocess.Popen[bytes]) -> None:
    if nspawn.poll() is not None:
        return
    nspawn.send_signal(signal.SIGTERM)  # nspawn asks the container's systemd to power off
    try:
        nspawn.wait(timeout=60)
    except subprocess.TimeoutExpired:
        nspawn.kill()
        nspawn.wait(timeout=30)


def say(line: str) -> None:
    print(f"\n{line}", file=sys.stderr)
