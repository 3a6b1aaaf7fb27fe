"""apply and revert cut short (SIGTERM, SIGHUP) or run twice at once: nothing applied goes unrecorded.

A FIFO in place of a sysctl stops apply at a known point: opening the FIFO for writing returns
only once apply has opened it to read, so the signal lands while apply is mid-way, by event.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from host_tuning.cli import _stoppable, main
from host_tuning.rootfs import Root
from host_tuning.state import (
    JOURNAL,
    STATE_FILE,
    Entry,
    State,
    StateError,
    load,
    locked,
    record,
    save,
)
from tests.host_tuning.hostbuilder import Machine
from tests.host_tuning.test_apply import snapshot

PROFILE = '[memory]\nhugepages = 4\nhugepage_size = "2M"\n'
GOVERNOR = "sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"
SWAPPINESS = "proc/sys/vm/swappiness"


def _apply_stopped_at_swappiness(box: Machine, prof: Path, sig: signal.Signals) -> tuple[int, str]:
    """Run apply in a child, stop it with ``sig`` while it reads vm.swappiness; rc and stderr."""
    fifo = box.root / SWAPPINESS
    original = fifo.read_text()
    fifo.unlink()
    os.mkfifo(fifo)
    code = "import sys; from host_tuning.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["apply", "--root", str(box.root), "--profile", str(prof)]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stderr=subprocess.PIPE, text=True)
    try:
        fd = os.open(fifo, os.O_WRONLY)  # returns once apply has opened it: apply is mid-way
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        os.close(fd)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    fifo.unlink()
    fifo.write_text(original)
    return proc.returncode, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_apply_stopped_by_a_signal_saves_what_it_changed(
    box: Machine, write_profile: Callable[[str], Path], sig: signal.Signals
) -> None:
    before = snapshot(box.root)
    prof = write_profile(PROFILE)
    code, err = _apply_stopped_at_swappiness(box, prof, sig)
    assert code == 1
    assert err.count("\n") == 1 and sig.name in err and "revert" in err
    assert (box.root / GOVERNOR).read_text() == "performance\n"  # changed before the signal
    state = json.loads((box.root / STATE_FILE.lstrip("/")).read_text())
    assert "cpu0 governor" in {e["key"] for e in state["entries"]}
    assert main(["revert", "--root", str(box.root)]) == 0
    assert snapshot(box.root) == before


def test_a_second_apply_or_revert_is_refused_while_one_runs(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prof = write_profile(PROFILE)
    root = str(box.root)
    before = snapshot(box.root)
    with locked(Root(root)):
        assert main(["apply", "--root", root, "--profile", str(prof)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "another host-tune" in err
        assert main(["revert", "--root", root]) == 1
        assert "another host-tune" in capsys.readouterr().err
        assert snapshot(box.root) == before
        # Reading is never refused: a monitoring check runs verify while apply works.
        assert main(["verify", "--root", root, "--profile", str(prof)]) == 1
        assert main(["apply", "--dry-run", "--root", root, "--profile", str(prof)]) == 0
    capsys.readouterr()
    assert main(["apply", "--root", root, "--profile", str(prof)]) == 0
    assert main(["revert", "--root", root]) == 0
    assert snapshot(box.root) == before


def test_a_forked_helper_ends_on_sigterm_as_without_host_tune(box: Machine) -> None:
    # pyroute2 forks a helper to enter a network namespace and stops it with SIGTERM: the
    # helper must die, not raise into a copy of host-tune that goes on applying.
    ready_r, ready_w = os.pipe()
    with _stoppable("apply", Root(box.root)):
        pid = os.fork()
        if pid == 0:
            try:
                os.write(ready_w, b"1")  # past fork's own signal bookkeeping
                signal.pause()
            finally:
                os._exit(0)  # reached only when the handler raised or returned
        assert os.read(ready_r, 1) == b"1"
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    os.close(ready_r)
    os.close(ready_w)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


def test_apply_killed_outright_leaves_a_record_revert_undoes(
    box: Machine, write_profile: Callable[[str], Path]
) -> None:
    # SIGKILL (systemd's stop timeout, the OOM killer) runs no handler: each prior value must be
    # on disk before its setting is written, or a second apply saves the tuned value as prior.
    before = snapshot(box.root)
    prof = write_profile(PROFILE)
    code, _ = _apply_stopped_at_swappiness(box, prof, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert (box.root / GOVERNOR).read_text() == "performance\n"  # changed before the kill
    assert {"cpu0 governor", "sysctl kernel.nmi_watchdog"} <= set(load(Root(box.root)).entries)
    assert main(["apply", "--root", str(box.root), "--profile", str(prof)]) == 0
    assert main(["revert", "--root", str(box.root)]) == 0
    assert snapshot(box.root) == before


def test_a_journal_line_cut_short_by_a_kill_is_no_entry(box: Machine) -> None:
    root = Root(box.root)
    state = State()
    state.entries["sysctl vm.swappiness"] = Entry("sysctl", "/proc/sys/vm/swappiness", "60\n")
    save(root, state)
    state.entries["sysctl vm.stat_interval"] = Entry("sysctl", "/proc/sys/vm/stat_interval", "1\n")
    record(root, state, "sysctl vm.stat_interval", durable=False)
    journal = box.root / JOURNAL.lstrip("/")
    journal.write_text(journal.read_text() + '{"key": "sysctl net.core.busy_read", "plug')
    assert list(load(root).entries) == ["sysctl vm.swappiness", "sysctl vm.stat_interval"]
    journal.write_text('{"key": 1}\n')
    with pytest.raises(StateError, match="damaged"):
        load(root)


def _fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths os.fsync is called on from now on (a folder's path ends in '/')."""
    paths: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        paths.append(path + "/" if os.path.isdir(path) else path)
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return paths


def test_a_durable_record_that_starts_the_journal_flushes_its_folder(
    box: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A new file's name is on disk only once its folder is flushed: without it a power cut can
    # lose the journal, and with it the prior value of a setting under /etc written since.
    root = Root(box.root)
    state = State()
    save(root, state)
    state.entries["grub iommu"] = Entry("cmdline", "/etc/default/grub.d/iommu.cfg", None)
    synced = _fsynced(monkeypatch)
    record(root, state, "grub iommu", durable=True)
    folder = str((box.root / JOURNAL.lstrip("/")).parent) + "/"
    assert str(box.root / JOURNAL.lstrip("/")) in synced
    assert folder in synced


def test_apply_flushes_the_state_file_it_replaces_before_its_first_write(
    box: Machine, write_profile: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The state file apply replaces may hold the prior values of files under /etc from an
    # earlier apply: its replacement must be on disk before any setting is written, or a power
    # cut mid-apply can leave an empty state file where the rename reached the disk and its
    # data did not.
    prof = write_profile(PROFILE)
    state_file = str(box.root / STATE_FILE.lstrip("/"))
    first: list[list[str]] = []
    real_write = Root.write
    synced = _fsynced(monkeypatch)

    def write(self: Root, rel: str, data: str) -> None:
        if not first:
            first.append(list(synced))
        real_write(self, rel, data)

    monkeypatch.setattr(Root, "write", write)
    assert main(["apply", "--root", str(box.root), "--profile", str(prof)]) == 0
    assert first, "apply wrote no setting"
    assert any(p.startswith(state_file) for p in first[0]), first[0]
