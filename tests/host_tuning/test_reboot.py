"""What a reboot changes: saved runtime values, settings waiting for it, hand-set isolation."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from host_tuning.actions import EXIT_CODES
from host_tuning.cli import main
from host_tuning.state import STATE_FILE
from tests.host_tuning.hostbuilder import Machine
from tests.host_tuning.test_apply import run, statuses
from tests.host_tuning.test_plan import _take_offline

SWAPPINESS = "proc/sys/vm/swappiness"
DROPIN = "etc/default/grub.d/99-host-tune.cfg"


def reboot(m: Machine, cmdline_extra: str = "") -> None:
    """A new boot: a new boot id, runtime settings back at what the kernel starts with."""
    (m.root / "proc/sys/kernel/random/boot_id").write_text("0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9\n")
    (m.root / SWAPPINESS).write_text("30\n")  # a sysctl.d file the operator added meanwhile
    if cmdline_extra:
        cmdline = m.root / "proc/cmdline"
        cmdline.write_text(cmdline.read_text().strip() + " " + cmdline_extra + "\n")


def saved(m: Machine) -> dict[str, str | None]:
    state = json.loads((m.root / STATE_FILE.lstrip("/")).read_text())
    return {e["key"]: e["snapshot"] for e in state["entries"]}


def test_apply_after_a_reboot_saves_fresh_runtime_values_and_keeps_file_ones(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(box.root)
    args = ["apply", "--root", root, "--profile", str(write_profile(""))]
    assert main(args) == 0
    assert saved(box)["sysctl vm.swappiness"] == "60\n"
    dropin_entry = saved(box)["cmdline nohz_full"]
    reboot(box)
    assert main(args) == 0
    capsys.readouterr()
    # The value the kernel held at this boot is what revert must go back to, not last boot's.
    assert saved(box)["sysctl vm.swappiness"] == "30\n"
    assert saved(box)["cmdline nohz_full"] == dropin_entry  # files under /etc survived the boot
    assert main(["revert", "--root", root]) == 0
    assert (box.root / SWAPPINESS).read_text() == "30\n"
    assert not (box.root / DROPIN).exists()


def test_revert_after_a_reboot_writes_back_no_value_of_the_earlier_boot(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(box.root)
    assert main(["apply", "--root", root, "--profile", str(write_profile(""))]) == 0
    capsys.readouterr()
    irq = next(k for k in saved(box) if k.startswith("irq "))
    reboot(box)
    # IRQ numbers are handed out again at boot: this number now belongs to another device.
    irq_file = box.root / f"proc/irq/{irq.split()[1]}/smp_affinity_list"
    irq_file.write_text("0-15\n")
    code, data = run(capsys, "revert", "--dry-run", "--root", root)
    assert code == 0 and statuses(data)["sysctl vm.swappiness"] == "reset-by-reboot"
    code, data = run(capsys, "revert", "--root", root)
    assert code == 0
    res = {r["key"]: r for r in data["results"]}
    assert res["sysctl vm.swappiness"]["status"] == "reset-by-reboot"
    assert "reboot" in res["sysctl vm.swappiness"]["note"]
    assert res[irq]["status"] == "reset-by-reboot"
    assert res["cmdline nohz_full"]["status"] == "restored"
    assert (box.root / SWAPPINESS).read_text() == "30\n"
    assert irq_file.read_text() == "0-15\n"
    assert not (box.root / DROPIN).exists()
    assert not (box.root / STATE_FILE.lstrip("/")).exists()


def test_verify_lists_no_runtime_setting_of_an_earlier_boot_as_in_force(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(box.root)
    prof = write_profile('[memory]\nhugepages = 4\nhugepage_size = "2M"\n')
    assert main(["apply", "--root", root, "--profile", str(prof)]) == 0
    capsys.readouterr()
    reboot(box)
    prof = write_profile("[memory]\nhugepages = 0\n")
    _, data = run(capsys, "verify", "--root", root, "--profile", str(prof))
    assert "hugepages node0 2M" not in statuses(data)


def test_verify_exits_3_with_one_line_while_a_reboot_is_pending(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prof = str(write_profile("[kernel]\nisolate = false\n[memory]\nhugepages = 0\n"))
    root = str(box.root)
    assert main(["apply", "--root", root, "--profile", prof]) == 0  # apply did its part
    capsys.readouterr()
    assert main(["verify", "--root", root, "--profile", prof]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("host-tune: ")
    assert "reboot" in err and "iommu=pt" in err and "skew_tick=1" in err
    code, data = run(capsys, "verify", "--root", root, "--profile", prof)
    assert code == 3 and data["exit_code"] == 3 and data["reboot_required"] is True
    # Drift is the operator's first move (apply again): it wins over the pending reboot.
    (box.root / SWAPPINESS).write_text("60\n")
    assert main(["verify", "--root", root, "--profile", prof]) == 1


HAND_SET = "isolcpus=domain,1-3"


def test_plan_and_verify_report_a_hand_set_isolation_that_conflicts(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prof = str(write_profile(""))  # plans isolated 2-7,10-15 on this box
    root = str(box.root)
    (box.root / "etc/default/grub").write_text(
        'GRUB_DEFAULT=0\nGRUB_CMDLINE_LINUX_DEFAULT="quiet"\nGRUB_CMDLINE_LINUX="nohz_full=2-7"\n'
    )
    assert main(["apply", "--root", root, "--profile", prof]) == 0
    apply_out = capsys.readouterr().out
    assert "note: nohz_full=2-7 in /etc/default/grub" in apply_out
    ours = (box.root / DROPIN).read_text().split('"')[1].split()[1:]
    reboot(box, " ".join([HAND_SET, "nohz_full=2-7", *ours]))
    (box.root / SWAPPINESS).write_text("10\n")

    _, plan = run(capsys, "plan", "--root", root, "--profile", prof)
    found = {(c["param"], c["source"]): c for c in plan["conflicts"]}
    assert set(found) == {("isolcpus", "/proc/cmdline"), ("nohz_full", "/etc/default/grub")}
    iso = found[("isolcpus", "/proc/cmdline")]
    assert (iso["found"], iso["wanted"]) == ("1-3", "2-7,10-15")
    assert "1" in iso["text"] and "2-7,10-15" in iso["text"]
    assert main(["plan", "--root", root, "--profile", prof]) == 0
    table = capsys.readouterr().out
    assert "isolcpus=domain,1-3" in table and "/etc/default/grub" in table

    code, data = run(capsys, "verify", "--root", root, "--profile", prof)
    conflicts = [r for r in data["results"] if r["status"] == "conflict"]
    assert code == 1 and len(conflicts) == 2, data["results"]
    assert {r["actual"] for r in conflicts} == {HAND_SET, "nohz_full=2-7"}
    assert main(["verify", "--root", root, "--profile", prof]) == 1
    assert "2 hand-set kernel parameter(s) conflict with the plan" in capsys.readouterr().out


def test_isolation_host_tune_wrote_or_that_matches_the_plan_is_no_conflict(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prof = str(write_profile(""))
    root = str(box.root)
    assert main(["apply", "--root", root, "--profile", prof]) == 0
    # The running kernel booted with an earlier plan's value from host-tune's own drop-in, and
    # an identical hand-set value: the first is a pending reboot, the second agrees.
    ours = [t for t in (box.root / DROPIN).read_text().split('"')[1].split()[1:]]
    old = [("nohz_full=2-5" if t.startswith("nohz_full=") else t) for t in ours]
    reboot(box, " ".join(["rcu_nocbs=2-7,10-15", *old]))
    capsys.readouterr()
    _, plan = run(capsys, "plan", "--root", root, "--profile", prof)
    assert plan["conflicts"] == []


def test_hand_set_isolation_conflicts_with_a_plan_that_isolates_nothing(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    reboot(box, "nohz_full=4-7")
    prof = str(write_profile("[kernel]\nisolate = false\n"))
    _, plan = run(capsys, "plan", "--root", str(box.root), "--profile", prof)
    (c,) = plan["conflicts"]
    assert (c["param"], c["found"], c["wanted"]) == ("nohz_full", "4-7", "")
    assert "isolate = false" in c["text"]


def test_exit_codes_are_one_list_in_help_and_docs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    doc = (Path(__file__).parents[2] / "docs/HOST_TUNING.md").read_text()
    rows = {
        int(line.split("|")[1]): line.split("|")[2].strip()
        for line in doc.splitlines()
        if line[:4] in {f"| {c} " for c in range(10)}
    }
    assert rows == EXIT_CODES
    for code, meaning in EXIT_CODES.items():
        assert f"  {code} {meaning}\n" in text


def _applied_by_an_older_host_tune(m: Machine, profile: Path, btime_after_s: int) -> list[str]:
    """Applies, then leaves the state file as a host-tune before boot ids wrote it, with this
    boot begun `btime_after_s` after the file was written; the apply command's arguments."""
    args = ["apply", "--root", str(m.root), "--profile", str(profile)]
    assert main(args) == 0
    path = m.root / STATE_FILE.lstrip("/")
    state = json.loads(path.read_text())
    del state["boot_id"]
    path.write_text(json.dumps(state))
    (m.root / "proc/stat").write_text(
        f"cpu  1 2 3\nbtime {int(path.stat().st_mtime) + btime_after_s}\n"
    )
    return args


def test_a_state_file_of_an_older_host_tune_gets_this_boots_id_at_the_next_apply(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = _applied_by_an_older_host_tune(box, write_profile(""), -60)
    assert main(args) == 0  # nothing to change: the boot id is recorded all the same
    assert "boot_id" in json.loads((box.root / STATE_FILE.lstrip("/")).read_text())
    reboot(box)
    assert main(args) == 0
    capsys.readouterr()
    assert saved(box)["sysctl vm.swappiness"] == "30\n"


def test_a_state_file_of_an_older_host_tune_written_before_this_boot_is_stale(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = _applied_by_an_older_host_tune(box, write_profile(""), 60)
    reboot(box)
    assert main(args) == 0
    capsys.readouterr()
    assert saved(box)["sysctl vm.swappiness"] == "30\n"


def test_hand_set_isolation_in_the_kernels_group_form_or_past_its_cpus(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prof = str(write_profile(""))  # plans isolated 2-7,10-15 on this box
    grub = box.root / "etc/default/grub"
    # The plan's own CPUs in the kernel's START-END:USED/GROUP form: no conflict.
    grub.write_text('GRUB_CMDLINE_LINUX="nohz_full=2-15:6/8"\n')
    _, plan = run(capsys, "plan", "--root", str(box.root), "--profile", prof)
    assert plan["conflicts"] == []
    # A fat-fingered range is reported as no CPU list, at once, not expanded CPU by CPU.
    grub.write_text('GRUB_CMDLINE_LINUX="isolcpus=2-4000000000"\n')
    _, plan = run(capsys, "plan", "--root", str(box.root), "--profile", prof)
    (c,) = plan["conflicts"]
    assert (c["param"], c["found"]) == ("isolcpus", "") and "no CPU list" in c["text"]


def test_revert_says_the_running_kernel_keeps_its_command_line_until_a_reboot(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(box.root)
    (box.root / "etc/default/grub").write_text('GRUB_CMDLINE_LINUX="quiet iommu=pt"\n')
    assert main(["apply", "--root", root, "--profile", str(write_profile(""))]) == 0
    ours = (box.root / DROPIN).read_text().split('"')[1].split()[1:]
    reboot(box, " ".join(["quiet", "iommu=pt", *ours]))
    capsys.readouterr()
    code, data = run(capsys, "revert", "--root", root)
    assert code == 0 and data["reboot_required"] is True
    notes = {r["key"]: r["note"] for r in data["results"] if r["plugin"] == "cmdline"}
    assert "reboot required" in notes["cmdline nohz_full"]
    assert "nohz_full=" in notes["cmdline nohz_full"]
    # iommu=pt stays at the next boot too (/etc/default/grub sets it): nothing waits for a reboot.
    assert notes["cmdline iommu"] == ""


def test_revert_before_any_reboot_needs_none(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(box.root)
    assert main(["apply", "--root", root, "--profile", str(write_profile(""))]) == 0
    capsys.readouterr()
    code, data = run(capsys, "revert", "--root", root)
    assert code == 0 and data["reboot_required"] is False


def test_a_hand_edited_dropin_with_an_unbalanced_quote_is_read_not_a_traceback(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root, prof = str(box.root), str(write_profile(""))
    assert main(["apply", "--root", root, "--profile", prof]) == 0
    dropin = box.root / DROPIN
    dropin.write_text(dropin.read_text().replace("skew_tick=1", "skew_tick=1 acpi='x"))
    capsys.readouterr()
    code, data = run(capsys, "verify", "--root", root, "--profile", prof)
    assert code == 3 and statuses(data)["cmdline skew_tick"] == "reboot-required"
    assert main(["apply", "--root", root, "--profile", prof]) == 0
    assert main(["revert", "--root", root]) == 0
    assert not dropin.exists()


def test_systemd_affinity_with_an_offline_housekeeping_cpu_is_in_effect_after_reexec(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _take_offline(box, 9, sibling_lists_it=True)  # core 1's second thread: housekeeping
    root, prof = str(box.root), str(write_profile(""))
    assert main(["apply", "--root", root, "--profile", prof]) == 0
    # After daemon-reexec PID 1 runs on the online part of CPUAffinity= (the kernel leaves
    # offline CPUs out of a task's allowed CPUs).
    (box.root / "proc/1/status").write_text("Name:\tsystemd\nCpus_allowed_list:\t0-1,8\n")
    capsys.readouterr()
    _, data = run(capsys, "verify", "--root", root, "--profile", prof)
    assert statuses(data)["systemd default CPUAffinity"] == "ok"
