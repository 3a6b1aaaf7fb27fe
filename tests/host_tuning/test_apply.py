"""apply / verify / revert round trips on generated trees: bytes, idempotence, drift, EIO."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from host_tuning.cli import main
from host_tuning.rootfs import KERNEL_MARKER
from host_tuning.state import STATE_FILE
from tests.host_tuning.hostbuilder import Machine
from tests.host_tuning.test_plan import HGX_PROFILE

Tree = dict[str, tuple[str, bytes | str | None]]


def snapshot(root: Path) -> Tree:
    """Every path under root with its kind and content (files), target (links)."""
    out: Tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", None)
            else:
                out[rel] = ("file", p.read_bytes())
    return out


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main([*args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def statuses(data: Any) -> dict[str, str]:
    return {r["key"]: r["status"] for r in data["results"]}


@pytest.fixture
def hgx_profile(write_profile: Callable[[str], Path]) -> Path:
    return write_profile(HGX_PROFILE)


def test_round_trip_restores_every_byte(
    hgx_rw: Machine, hgx_profile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(hgx_rw.root)
    before = snapshot(hgx_rw.root)
    code, data = run(capsys, "apply", "--root", root, "--profile", str(hgx_profile))
    assert code == 0 and data["changed"] is True
    st = statuses(data)
    assert st["sysctl vm.swappiness"] == "changed"
    assert snapshot(hgx_rw.root) != before
    assert (hgx_rw.root / "proc/sys/vm/swappiness").read_text() == "10\n"
    assert "[never]" in (hgx_rw.root / "sys/kernel/mm/transparent_hugepage/enabled").read_text()
    dropin = (hgx_rw.root / "etc/default/grub.d/99-host-tune.cfg").read_text()
    assert "nohz_full=52-95,148-191" in dropin and "iommu=pt" in dropin

    code, data = run(capsys, "verify", "--root", root, "--profile", str(hgx_profile))
    assert code == 3 and data["reboot_required"] is True  # the command line waits for a reboot
    assert "drift" not in data["counts"]

    code, data = run(capsys, "revert", "--root", root)
    assert code == 0
    assert snapshot(hgx_rw.root) == before


def test_second_apply_changes_nothing(
    hgx_rw: Machine, hgx_profile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["apply", "--root", str(hgx_rw.root), "--profile", str(hgx_profile)]
    assert main(args) == 0
    capsys.readouterr()
    state_after_first = (hgx_rw.root / STATE_FILE.lstrip("/")).read_bytes()
    tree = snapshot(hgx_rw.root)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "nothing to change" in out and "changed" not in out.split("nothing")[0].split()
    assert snapshot(hgx_rw.root) == tree
    assert (hgx_rw.root / STATE_FILE.lstrip("/")).read_bytes() == state_after_first
    _, data = run(capsys, *args)
    assert data["changed"] is False


def test_managed_irqs_recorded_and_skipped(
    hgx_rw: Machine, hgx_profile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(hgx_rw.root)
    code, data = run(capsys, "apply", "--root", root, "--profile", str(hgx_profile))
    assert code == 0  # EIO on a managed IRQ is not a failure
    st = statuses(data)
    for n in hgx_rw.managed_irqs:
        assert st[f"irq {n}"] == "managed-skipped"
        assert (hgx_rw.root / f"proc/irq/{n}/smp_affinity_list").read_text() != "0-49,96-145\n"
    assert "failed" not in st.values()
    state = json.loads((hgx_rw.root / STATE_FILE.lstrip("/")).read_text())
    assert {f"irq {n}" for n in hgx_rw.managed_irqs} <= set(state["managed"])
    code, data = run(capsys, "verify", "--root", root, "--profile", str(hgx_profile))
    # Managed IRQs are no failure; only the kernel command line (exit 3) waits for a reboot.
    assert code == 3 and statuses(data)[f"irq {hgx_rw.managed_irqs[0]}"] == "managed-skipped"


def test_verify_lists_drift(
    hgx_rw: Machine, hgx_profile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(hgx_rw.root)
    assert main(["apply", "--root", root, "--profile", str(hgx_profile)]) == 0
    (hgx_rw.root / "proc/sys/net/core/busy_poll").write_text("0\n")
    (hgx_rw.root / "sys/devices/system/cpu/cpu60/cpufreq/scaling_governor").write_text(
        "powersave\n"
    )
    capsys.readouterr()
    assert main(["verify", "--root", root, "--profile", str(hgx_profile)]) == 1
    out = capsys.readouterr().out
    assert "2 setting(s) drifted" in out
    line = next(ln for ln in out.splitlines() if "net.core.busy_poll" in ln)
    assert line.split()[0] == "drift" and "50" in line and line.split()[-1] == "0"
    _, data = run(capsys, "verify", "--root", root, "--profile", str(hgx_profile))
    drift = [r for r in data["results"] if r["status"] == "drift"]
    assert {(r["key"], r["expected"], r["actual"]) for r in drift} == {
        ("sysctl net.core.busy_poll", "50", "0"),
        ("cpu60 governor", "performance", "powersave"),
    }
    # re-apply fixes drift but keeps the original prior value for revert
    before_apply = json.loads((hgx_rw.root / STATE_FILE.lstrip("/")).read_text())
    assert main(["apply", "--root", root, "--profile", str(hgx_profile)]) == 0
    after = json.loads((hgx_rw.root / STATE_FILE.lstrip("/")).read_text())
    assert after["entries"] == before_apply["entries"]
    assert main(["revert", "--root", root]) == 0
    assert (hgx_rw.root / "proc/sys/net/core/busy_poll").read_text() == "0\n"


def test_dry_run_changes_nothing(
    hgx_rw: Machine, hgx_profile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(hgx_rw.root)
    root = str(hgx_rw.root)
    code, data = run(capsys, "apply", "--dry-run", "--root", root, "--profile", str(hgx_profile))
    assert code == 0 and statuses(data)["thp enabled"] == "would-change"
    assert snapshot(hgx_rw.root) == before
    assert main(["apply", "--root", root, "--profile", str(hgx_profile)]) == 0
    capsys.readouterr()
    after_apply = snapshot(hgx_rw.root)
    code, data = run(capsys, "revert", "--dry-run", "--root", root)
    assert set(statuses(data).values()) == {"would-restore"}
    assert snapshot(hgx_rw.root) == after_apply


def test_reboot_required_until_cmdline_shows_it(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prof = write_profile("[kernel]\nisolate = false\n[memory]\nhugepages = 0\n")
    root = str(box.root)
    code, data = run(capsys, "apply", "--root", root, "--profile", str(prof))
    assert data["reboot_required"] is True
    tokens = "skew_tick=1 tsc=reliable rcupdate.rcu_normal_after_boot=1 iommu=pt"
    cmdline = box.root / "proc/cmdline"
    cmdline.write_text(cmdline.read_text().strip() + " " + tokens + "\n")  # "after reboot"
    code, data = run(capsys, "verify", "--root", root, "--profile", str(prof))
    assert code == 0 and data["reboot_required"] is False
    assert statuses(data)["cmdline iommu"] == "ok"


def test_box_round_trip_with_irqbalance_file_absent(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    (box.root / "etc/default/irqbalance").unlink()
    prof = write_profile('[serve]\nnics = ["enp2s0f0np0"]\n[nic]\nmtu = 9000\n')
    before = snapshot(box.root)
    root = str(box.root)
    assert main(["apply", "--root", root, "--profile", str(prof)]) == 0
    assert (box.root / "sys/class/net/enp2s0f0np0/mtu").read_text() == "9000\n"
    banned = (box.root / "etc/default/irqbalance").read_text()
    assert banned == 'IRQBALANCE_BANNED_CPULIST="2-7,10-15"\n'
    assert main(["revert", "--root", root]) == 0
    assert snapshot(box.root) == before


def test_refuses_real_host_without_root(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    prof = tmp_path / "p.toml"
    prof.write_text("")
    assert main(["apply", "--root", "/", "--profile", str(prof)]) == 2
    assert "must run as root" in capsys.readouterr().err
    assert main(["revert", "--root", "/"]) == 2
    assert "must run as root" in capsys.readouterr().err


def _one_entry(**fields: Any) -> str:
    entry: dict[str, Any] = {"key": "sysctl vm.swappiness", "plugin": "sysctl"}
    entry.update(target="/proc/sys/vm/swappiness", snapshot="60\n")
    entry.update(fields)
    return json.dumps({"entries": [entry]})


@pytest.mark.parametrize(
    "text",
    [
        '{"entries": [{"plugin": "sysctl"}]}',
        # Wrong types inside an entry: refused before anything is written, not a traceback.
        _one_entry(snapshot=60),
        _one_entry(target=7),
        _one_entry(created_dirs=[1]),
        '{"entries": [], "managed": [3]}',
        "[]",
    ],
)
def test_damaged_state_file_is_refused_in_one_line(
    box: Machine, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    state = box.root / STATE_FILE.lstrip("/")
    state.parent.mkdir(parents=True)
    state.write_text(text)
    before = snapshot(box.root)
    assert main(["revert", "--root", str(box.root)]) == 2
    err = capsys.readouterr().err
    assert "is damaged" in err and err.count("\n") == 1
    assert snapshot(box.root) == before


def test_revert_keeps_entries_of_an_unknown_plugin(
    box: Machine, capsys: pytest.CaptureFixture[str]
) -> None:
    state = box.root / STATE_FILE.lstrip("/")
    state.parent.mkdir(parents=True)
    entry = {"key": "k", "plugin": "future", "target": "/x", "snapshot": "1"}
    state.write_text(json.dumps({"version": 1, "entries": [entry]}))
    code, data = run(capsys, "revert", "--root", str(box.root))
    assert code == 1 and statuses(data) == {"k": "failed"}
    assert "unknown plugin" in data["results"][0]["note"]
    assert json.loads(state.read_text())["entries"][0]["plugin"] == "future"


def test_verify_accepts_dry_run(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prof = write_profile("")
    code, data = run(capsys, "verify", "--dry-run", "--root", str(box.root), "--profile", str(prof))
    assert code == 1 and data["command"] == "verify"  # the untouched box drifts from the plan


def test_revert_without_state_is_a_no_op(box: Machine, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(box.root)
    assert main(["revert", "--root", str(box.root)]) == 0
    assert snapshot(box.root) == before


def test_verify_reports_settings_left_from_an_earlier_profile(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(box.root)
    prof = write_profile('[memory]\nhugepages = 4\nhugepage_size = "2M"\n')
    assert main(["apply", "--root", root, "--profile", str(prof)]) == 0
    capsys.readouterr()
    prof = write_profile("[memory]\nhugepages = 0\n")
    code, data = run(capsys, "verify", "--root", root, "--profile", str(prof))
    assert code == 3 and statuses(data)["hugepages node0 2M"] == "stale"  # 3: cmdline pending


def _kernel_rule(m: Machine, line: str) -> None:
    """Add a fixture-kernel rule (see host_tuning.rootfs) to the tree."""
    marker = m.root / KERNEL_MARKER
    marker.write_text(marker.read_text() + line + "\n")


NR_2M = "sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages"


def test_hugepages_the_kernel_cannot_all_reserve_are_reported(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _kernel_rule(box, f"{NR_2M} max=3")  # memory too fragmented for more than 3 pages
    prof = write_profile('[memory]\nhugepages = 8\nhugepage_size = "2M"\n')
    root = str(box.root)
    code, data = run(capsys, "apply", "--root", root, "--profile", str(prof))
    res = {r["key"]: r for r in data["results"]}["hugepages node0 2M"]
    assert code == 1 and res["status"] == "failed"
    assert "3 of 8" in res["note"]
    code, data = run(capsys, "verify", "--root", root, "--profile", str(prof))
    res = {r["key"]: r for r in data["results"]}["hugepages node0 2M"]
    assert code == 1 and (res["status"], res["actual"]) == ("drift", "3")
    assert "3 of 8" in res["note"]
    assert main(["revert", "--root", root]) == 0  # the 3 it did reserve are given back
    assert (box.root / NR_2M).read_text() == "0\n"


def test_a_write_the_kernel_refuses_is_one_failed_line(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _kernel_rule(box, "proc/sys/kernel/nmi_watchdog EBUSY")  # perf holds the PMU counter
    _kernel_rule(box, "sys/devices/system/cpu/cpu3/cpufreq/scaling_governor EINVAL")
    before = snapshot(box.root)
    prof = write_profile("[kernel]\nisolate = false\n")
    root = str(box.root)
    assert main(["apply", "--root", root, "--profile", str(prof)]) == 1
    out = capsys.readouterr().out
    failed = [ln for ln in out.splitlines() if ln.startswith("failed")]
    assert len(failed) == 2
    assert "kernel.nmi_watchdog" in failed[1] and "Device or resource busy" in failed[1]
    assert (box.root / "proc/sys/vm/swappiness").read_text() == "10\n"  # the rest applied
    assert main(["revert", "--root", root]) == 0
    assert snapshot(box.root) == before


def test_an_irq_no_longer_managed_after_reboot_is_tuned(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prof = write_profile("")
    args = ["apply", "--root", str(box.root), "--profile", str(prof)]
    first = box.managed_irqs[0]
    code, data = run(capsys, *args)
    assert statuses(data)[f"irq {first}"] == "managed-skipped"
    # Reboot: IRQ numbers are handed out again, and this one is now an ordinary vector.
    marker = box.root / KERNEL_MARKER
    rules = marker.read_text().splitlines()
    marker.write_text("\n".join(r for r in rules if f"/{first}/" not in r) + "\n")
    code, data = run(capsys, *args)
    assert code == 0 and statuses(data)[f"irq {first}"] == "changed"
    assert statuses(data)[f"irq {box.managed_irqs[1]}"] == "managed-skipped"
    code, data = run(capsys, "verify", "--root", str(box.root), "--profile", str(prof))
    assert statuses(data)[f"irq {first}"] == "ok"


def test_revert_passes_over_a_setting_whose_device_is_gone(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(box.root)
    assert main(["apply", "--root", root, "--profile", str(write_profile(""))]) == 0
    capsys.readouterr()
    state = json.loads((box.root / STATE_FILE.lstrip("/")).read_text())
    irq = next(e["key"] for e in state["entries"] if e["key"].split()[-1].isdigit())
    shutil.rmtree(box.root / "proc/irq" / irq.split()[-1])  # its driver was unloaded since
    code, data = run(capsys, "revert", "--root", root)
    assert code == 0 and statuses(data)[irq] == "unsupported"
    assert "gone" in next(r["note"] for r in data["results"] if r["key"] == irq)
    assert not (box.root / STATE_FILE.lstrip("/")).exists()


def test_a_governor_the_kernel_does_not_offer_is_unsupported_not_written(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cpu = box.root / "sys/devices/system/cpu"
    for d in sorted(cpu.glob("cpu[0-9]*")):
        (d / "cpufreq/scaling_available_governors").write_text("powersave schedutil\n")
        # The kernel refuses a governor it does not offer with EINVAL.
        _kernel_rule(box, f"{d.relative_to(box.root)}/cpufreq/scaling_governor EINVAL")
    prof = write_profile("[kernel]\nisolate = false\n")
    root = str(box.root)
    for cmd in ("apply", "verify", "verify"):
        code, data = run(capsys, cmd, "--root", root, "--profile", str(prof))
        res = {r["key"]: r for r in data["results"]}["cpu3 governor"]
        assert code == (0 if cmd == "apply" else 3), (cmd, res)  # 3: cmdline waits for reboot
        assert res["status"] == "unsupported", (cmd, res)
        assert "powersave schedutil" in res["note"] and res["actual"] == "powersave"
    state = json.loads((box.root / STATE_FILE.lstrip("/")).read_text())
    assert not [e for e in state["entries"] if e["key"].endswith("governor")]
    assert main(["apply", "--root", root, "--profile", str(prof)]) == 0
    table = capsys.readouterr().out
    row = next(ln for ln in table.splitlines() if "cpu{0-15} governor" in ln)
    assert row.startswith("unsupported") and "failed" not in table


def test_a_refused_write_leaves_no_entry_when_nothing_else_changed(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    (box.root / "proc/sys/net/core/somaxconn").write_text("4096\n")
    before = snapshot(box.root)
    root = str(box.root)
    assert main(["apply", "--root", root, "--profile", str(write_profile(""))]) == 0
    # A second apply whose only new setting the kernel refuses changes nothing else.
    rules = (box.root / KERNEL_MARKER).read_text()
    _kernel_rule(box, "proc/sys/net/core/somaxconn EPERM")
    prof = write_profile('[sysctl]\n"net.core.somaxconn" = 128\n')
    assert main(["apply", "--root", root, "--profile", str(prof)]) == 1
    state = json.loads((box.root / STATE_FILE.lstrip("/")).read_text())
    assert "sysctl net.core.somaxconn" not in {e["key"] for e in state["entries"]}
    capsys.readouterr()
    assert main(["revert", "--root", root]) == 0
    (box.root / KERNEL_MARKER).write_text(rules)
    assert snapshot(box.root) == before


def test_a_hand_edited_irqbalance_list_that_is_no_cpu_list_is_drift(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    conf = box.root / "etc/default/irqbalance"
    conf.write_text('IRQBALANCE_BANNED_CPULIST="$ISOLATED"\n')
    before = snapshot(box.root)
    root, prof = str(box.root), str(write_profile(""))
    code, data = run(capsys, "verify", "--root", root, "--profile", prof)
    assert code == 1 and statuses(data)["irqbalance banned cpus"] == "drift"
    code, data = run(capsys, "apply", "--root", root, "--profile", prof)
    assert statuses(data)["irqbalance banned cpus"] == "changed"
    assert 'IRQBALANCE_BANNED_CPULIST="2-7,10-15"' in conf.read_text()
    assert main(["revert", "--root", root]) == 0
    assert snapshot(box.root) == before


def test_irqbalance_list_set_twice_in_its_file_is_read_as_the_shell_does(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # The file is sourced by a shell: the last assignment is the one irqbalance gets.
    conf = box.root / "etc/default/irqbalance"
    conf.write_text('IRQBALANCE_BANNED_CPULIST="2-7,10-15"\nIRQBALANCE_BANNED_CPULIST="3"\n')
    before = snapshot(box.root)
    root, prof = str(box.root), str(write_profile(""))
    _, data = run(capsys, "verify", "--root", root, "--profile", prof)
    assert statuses(data)["irqbalance banned cpus"] == "drift"
    _, data = run(capsys, "apply", "--root", root, "--profile", prof)
    assert statuses(data)["irqbalance banned cpus"] == "changed"
    _, data = run(capsys, "verify", "--root", root, "--profile", prof)
    assert statuses(data)["irqbalance banned cpus"] == "ok"
    assert '"3"' not in conf.read_text()
    assert main(["revert", "--root", root]) == 0
    assert snapshot(box.root) == before
