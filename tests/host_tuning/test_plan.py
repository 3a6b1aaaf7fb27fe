"""The pure planner and the profile, on generated machines."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

import host_tuning
from host_tuning import cpulist
from host_tuning.cli import main
from host_tuning.cores import PlanError, cpu_affinity_dropin
from host_tuning.facts.collect import collect
from host_tuning.planner import TuningPlan, make_plan
from host_tuning.profile import Profile, ProfileError, load, parse
from host_tuning.rootfs import Root
from tests.host_tuning.hostbuilder import Machine

HGX_PROFILE = """
[serve]
gpu = 4
nics = ["ibp153s0"]
[cpu]
housekeeping_cores = 2
nic_irq_cores = 2
gateway_cores = 2
[memory]
hugepages = 8
hugepage_size = "1G"
[nic]
mtu = 9000
rx_ring = 1024
[gpudirect]
method = "peermem"
[sysctl]
"net.core.somaxconn" = 4096
"""


def hgx_plan(m: Machine, text: str = HGX_PROFILE) -> TuningPlan:
    return make_plan(collect(Root(m.root)), parse(text))


def by_key(plan: TuningPlan) -> dict[str, str]:
    return {i.key: i.desired for i in plan.items}


def test_hgx_cores_local_to_gpu(hgx: Machine) -> None:
    plan = hgx_plan(hgx)
    c = plan.cores
    node1 = set(hgx.nodes[1])
    assert c.node == 1 and c.gpu == hgx.gpus[4]
    assert set(c.serving) <= node1 and set(c.isolated) <= node1 and set(c.nic_irq) <= node1
    # whole physical cores: every isolated thread's sibling is isolated too
    assert c.isolated == tuple(sorted(set(range(52, 96)) | set(range(148, 192))))
    assert c.gateway == (52, 53) and c.triton == tuple(range(54, 96))  # first threads only
    assert c.nic_irq == (50, 51, 146, 147)
    assert set(c.housekeeping) == set(range(192)) - set(c.isolated) - set(c.nic_irq)
    assert all(c.reasons[k] for k in ("node", "housekeeping", "gateway", "triton", "isolated"))


def test_hgx_settings(hgx: Machine) -> None:
    plan = hgx_plan(hgx)
    k = by_key(plan)
    assert not any("kernel.sched_" in key for key in k)
    assert k["sysctl net.core.busy_read"] == "50" and k["sysctl net.core.somaxconn"] == "4096"
    assert k["thp enabled"] == "never"
    assert k["hugepages node1 1G"] == "8"
    assert k["cmdline nohz_full"] == "nohz_full=52-95,148-191"
    # No `domain`: the scheduler keeps balancing gateway/Triton threads across serving cores;
    # other work stays off them by affinity (workqueues, systemd's default CPUAffinity=).
    assert k["cmdline isolcpus"] == "isolcpus=managed_irq,52-95,148-191"
    assert k["cmdline rcutree.nohz_full_patience_delay"] == "rcutree.nohz_full_patience_delay=1000"
    assert k["cmdline nosoftlockup"] == "nosoftlockup"
    housekeeping = set(range(192)) - set(range(50, 96)) - set(range(146, 192))
    assert cpulist.parse_mask(k["workqueue cpumask"]) == housekeeping
    assert cpulist.parse_mask(k["writeback cpumask"]) == housekeeping
    assert k["workqueue cpumask"].count(",") == 5  # 192 CPUs: six 32-bit words, as sysfs shows
    assert cpulist.parse(k["systemd default CPUAffinity"]) == housekeeping
    assert k["cmdline iommu"] == "iommu=pt"
    assert k["irqbalance banned cpus"] == "50-95,146-191"
    assert k["nic ibp153s0 mtu"] == "9000"
    assert k["gpudirect nvidia-peermem"] == "nvidia-peermem"
    assert all(i.reason for i in plan.items)


def test_hgx_irq_choices(hgx: Machine) -> None:
    facts = collect(Root(hgx.root))
    plan = hgx_plan(hgx)
    k = by_key(plan)
    nic = facts.nic("ibp153s0")
    first, *queues = nic.irqs
    assert k[f"irq {first}"] == cpulist.format(plan.cores.housekeeping)  # mlx5 async vector
    assert {k[f"irq {q}"] for q in queues} == {"50-51,146-147"}
    # unnamed NICs (the management port, the other RDMA NICs) are never touched
    for other in facts.nics:
        if other.name != "ibp153s0":
            assert not any(f"irq {n}" in k for n in other.irqs)
            assert f"nic {other.name} mtu" not in k
    for n in hgx.managed_irqs:  # planned; the kernel's EIO decides at apply time
        assert k[f"irq {n}"] == cpulist.format(plan.cores.housekeeping)


def test_hgx_acs_advice_on_the_serving_path(hgx: Machine) -> None:
    plan = hgx_plan(hgx)
    acs = [a.text for a in plan.advice if a.topic == "acs"]
    assert acs == [
        "setpci -s 0000:97:00.0 ECAP_ACS+0x6.w=0000 (at every boot)",
        "setpci -s 0000:97:01.0 ECAP_ACS+0x6.w=0000 (at every boot)",
    ]


def test_single_socket_box(box: Machine) -> None:
    plan = make_plan(collect(Root(box.root)), Profile(nics=("enp2s0f0np0",), mtu=9000))
    c = plan.cores
    assert c.node == 0  # numa_node -1: node of the GPU's NVML-local CPUs
    assert c.housekeeping == (0, 1, 8, 9) and c.nic_irq == (2, 3, 10, 11)
    assert c.gateway == (4, 5) and c.triton == (6, 7)
    k = by_key(plan)
    assert "cpu0 energy_perf_bias" not in k  # attribute absent on this box
    assert "hugepages node0 1G" not in k  # profile asks for none


def test_not_enough_cores(box: Machine) -> None:
    with pytest.raises(PlanError, match="physical cores"):
        make_plan(collect(Root(box.root)), Profile(housekeeping_cores=6, nics=("x",)))


def test_unknown_gpu(box: Machine) -> None:
    with pytest.raises(PlanError):
        make_plan(collect(Root(box.root)), Profile(gpu=3))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[cpu]\nhousekeeping = 2\n",
            "2: key 'cpu.housekeeping': unknown key; known keys are energy_perf_bias, gateway_cores,",
        ),
        ("[bogus]\n", "1: key 'bogus': unknown key; known keys are cpu, gpudirect, kernel,"),
        ('[sysctl]\n"kernel.sched_min_granularity_ns" = 1\n', "kernel.sched_"),
        ('[kernel]\nirreversible = ["idle=poll"]\n', "allow_irreversible"),
        ('[kernel]\nextra_cmdline = ["idle=poll"]\n', "irreversible"),
        (
            '[memory]\nhugepage_size = "4M"\n',
            "2: key 'memory.hugepage_size': must be one of 2M, 1G",
        ),
        (
            "[cpu]\nhousekeeping_cores = 0\n",
            "2: key 'cpu.housekeeping_cores': must be between 1 and 8192 (physical cores; the OS "
            "needs one), got 0",
        ),
        ("[cpu]\npm_qos_latency_us = 0\n", "key 'cpu.pm_qos_latency_us'"),
        ('[cpu]\nenergy_perf_bias = "turbo"\n', "key 'cpu.energy_perf_bias'"),
        ("[nic]\nmtu = 20\n", "key 'nic.mtu': must be between 68 and 65535 (bytes), got 20"),
        # Numbers are bounded by what the kernel takes, not only sign-checked.
        (
            '[memory]\nhugepage_size = "2M"\nhugepages = 99999999999999999999\n',
            "3: key 'memory.hugepages': must be between 0 and 33554432 (2M pages, 64 TiB in all), "
            "got 99999999999999999999",
        ),
        (
            "[memory]\nhugepages = 65537\n",
            "key 'memory.hugepages': must be between 0 and 65536 (1G pages, 64 TiB in all)",
        ),
        ("[cpu]\ngateway_cores = 8193\n", "key 'cpu.gateway_cores': must be between 0 and 8192"),
        ("[cpu]\nnic_irq_cores = -1\n", "key 'cpu.nic_irq_cores': must be between 0 and 8192"),
        (
            "[cpu]\npm_qos_latency_us = 2000000001\n",
            "key 'cpu.pm_qos_latency_us': must be between 1 and 2000000000",
        ),
        ("[nic]\ntx_ring = 99999999999\n", "key 'nic.tx_ring': must be between 1 and 65536"),
        ('[cpu]\nenergy_perf_bias = "\u00b2"\n', "key 'cpu.energy_perf_bias': must be one of"),
        # Wrong types are refused, never coerced: a string of NIC names would match the
        # management NIC by substring, "no" would be a true flag.
        ('[serve]\nnics = "ibp25s0"\n', "key 'serve.nics': expected list, got str"),
        ('[nic]\nmtu = "9000"\n', "key 'nic.mtu': must be an integer"),
        ('[kernel]\nisolate = "no"\n', "key 'kernel.isolate': must be true/false"),
        ("[cpu]\ngateway_cores = true\n", "key 'cpu.gateway_cores': must be an integer"),
        ("[cpu]\nhousekeeping_cores = 1.5\n", "key 'cpu.housekeeping_cores': must be an integer"),
        ('[serve]\nnics = ["eth0|x"]\n', "not an interface name"),
        ('[sysctl]\n"kernel/sched_min_granularity_ns" = 1\n', "kernel.sched_"),
        (
            '[sysctl]\n"../../etc/shadow" = 1\n',
            "2: key 'sysctl.../../etc/shadow': not a sysctl name",
        ),
        ('[sysctl]\n"vm.swappiness" = true\n', "integer or a string"),
        (
            '[sysctl]\n"vm.swappiness" = 1\n"vm/swappiness" = 2\n',
            "key 'sysctl.vm/swappiness': the same sysctl as vm.swappiness",
        ),
        ('[kernel]\nextra_cmdline = ["a b"]\n', "one kernel parameter per entry"),
        ('[kernel]\nextra_cmdline = ["x=$(reboot)"]\n', "one kernel parameter per entry"),
        ("[nic]\nrx_ring = 0\n", "rx_ring"),
    ],
)
def test_profile_refusals(text: str, message: str) -> None:
    with pytest.raises(ProfileError) as info:
        parse(text, Path("p.toml"))
    assert str(info.value).startswith("p.toml:") and message in str(info.value)


def test_energy_perf_bias_number_is_planned_as_the_kernel_reads_it_back() -> None:
    # The kernel shows "4" for a write of "04": planning "04" would be drift at every verify.
    assert parse('[cpu]\nenergy_perf_bias = "04"\n').energy_perf_bias == "4"


def test_energy_perf_bias_number_and_slash_sysctl_accepted(box: Machine) -> None:
    p = parse('[cpu]\nenergy_perf_bias = 4\n[sysctl]\n"net/ipv4/conf/eth0.100/rp_filter" = 2\n')
    assert p.energy_perf_bias == "4"
    plan = make_plan(collect(Root(box.root)), p)
    item = next(i for i in plan.items if i.key == "sysctl net/ipv4/conf/eth0.100/rp_filter")
    assert item.target == "/proc/sys/net/ipv4/conf/eth0.100/rp_filter"


def test_a_slash_spelt_sysctl_overrides_the_default_of_the_same_file(box: Machine) -> None:
    # Two items on one file would each write their value: verify would find one drifted forever.
    plan = make_plan(collect(Root(box.root)), parse('[sysctl]\n"vm/swappiness" = 1\n'))
    on_file = [i for i in plan.items if i.target == "/proc/sys/vm/swappiness"]
    assert [(i.key, i.desired) for i in on_file] == [("sysctl vm/swappiness", "1")]


def test_extra_cmdline_repeating_a_planned_parameter_is_a_plan_error(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    p = parse('[kernel]\nextra_cmdline = ["iommu=pt"]\n')
    with pytest.raises(PlanError, match="iommu is planned twice"):
        make_plan(collect(Root(box.root)), p)
    prof = write_profile('[kernel]\nextra_cmdline = ["nohz_full=1-3"]\n')
    assert main(["plan", "--root", str(box.root), "--profile", str(prof)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nohz_full is planned twice" in err


@pytest.mark.parametrize(
    "token", ["isolcpus=0-15", "nohz_full=0-15", "rcu_nocbs=1", "irqaffinity=3"]
)
def test_extra_cmdline_cannot_split_cores_behind_a_plan_that_isolates_none(
    box: Machine, token: str
) -> None:
    # isolcpus=0-15 would isolate every CPU, housekeeping included, and the conflict check
    # never looks at host-tune's own drop-in: the split is the plan's alone.
    p = parse(f'[kernel]\nisolate = false\nextra_cmdline = ["{token}"]\n')
    with pytest.raises(PlanError, match=f"{token.split('=')[0]} .*isolate = true"):
        make_plan(collect(Root(box.root)), p)


def test_pcie_aspm_off_gets_a_warning(box: Machine) -> None:
    p = parse('[kernel]\nextra_cmdline = ["pcie_aspm=off"]\n')
    plan = make_plan(collect(Root(box.root)), p)
    assert any("does not disable ASPM" in a.text for a in plan.advice)


def test_unreadable_profile_is_one_line(
    box: Machine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for bad in (tmp_path / "missing.toml", tmp_path):
        assert main(["plan", "--root", str(box.root), "--profile", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"host-tune: {bad}: cannot read profile") and err.count("\n") == 1


def test_profile_error_names_file_line_and_known_keys(
    box: Machine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[serve]\ngpu = 0\n\n[nic]\nmtu = 9000\nrx_rings = 512\n")
    assert main(["plan", "--root", str(box.root), "--profile", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"host-tune: {path}:6: key 'nic.rx_rings': unknown key; known keys are link_up, mtu, "
        "rx_ring, skip_first_mlx5_vector, tx_ring\n"
    )


@pytest.mark.parametrize("command", ["plan", "apply", "verify"])
def test_a_nic_that_does_not_exist_is_refused(
    box: Machine,
    write_profile: Callable[[str], Path],
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    prof = write_profile('[serve]\nnics = ["eth9"]\n')
    assert main([command, "--root", str(box.root), "--profile", str(prof)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"host-tune: [serve] nics: no NIC 'eth9' on this host; NICs found: "
        f"{', '.join(sorted(os.listdir(box.root / 'sys/class/net')))}\n"
    )


def test_irreversible_with_opt_in(box: Machine) -> None:
    p = parse('[kernel]\nirreversible = ["idle=poll"]\nallow_irreversible = true\n')
    plan = make_plan(collect(Root(box.root)), p)
    assert by_key(plan)["cmdline idle"] == "idle=poll"


def test_affinity_dropin() -> None:
    text = cpu_affinity_dropin((4, 5, 6, 9), "the gateway")
    assert "[Service]\nCPUAffinity=4-6 9\n" in text


def test_cli_plan_table_and_json(
    hgx: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prof = write_profile(HGX_PROFILE)
    assert main(["plan", "--root", str(hgx.root), "--profile", str(prof)]) == 0
    table = capsys.readouterr().out
    assert "cpu{0-191} governor" in table and "tuned network-latency" in table
    assert "ADVICE" in table and "setpci" in table
    assert main(["plan", "--root", str(hgx.root), "--profile", str(prof), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cores"]["gateway"] == "52-53"
    assert "CPUAffinity=54-95" in data["systemd"]["triton"]
    assert all(i["reason"] for i in data["items"])
    args = ["plan", "--root", str(hgx.root), "--profile", str(prof), "--affinity-dropin"]
    assert main([*args, "gateway"]) == 0
    assert "CPUAffinity=52-53" in capsys.readouterr().out


def test_cli_out_of_range_hugepages_is_one_line_exit_2(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prof = write_profile('[memory]\nhugepage_size = "2M"\nhugepages = 99999999999999999999\n')
    argv = ["apply", "--dry-run", "--no-nvml", "--root", str(box.root), "--profile", str(prof)]
    assert main(argv) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err == (
        f"host-tune: {prof}:3: key 'memory.hugepages': must be between 0 and 33554432 "
        "(2M pages, 64 TiB in all), got 99999999999999999999\n"
    )


def test_revert_options_have_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["revert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--dry-run list the saved settings revert would restore and change nothing" in text
    assert "--verbose accepted like apply's and verify's" in text
    assert "--root ROOT read and write under this directory (default: /, this host)" in text


def test_cli_profile_error_exit_2(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prof = write_profile('[kernel]\nirreversible = ["intel_idle.max_cstate=0"]\n')
    assert main(["plan", "--root", str(box.root), "--profile", str(prof)]) == 2
    assert "refusing irreversible" in capsys.readouterr().err


def test_shipped_example_profiles_plan(hgx: Machine, box: Machine) -> None:
    examples = Path(host_tuning.__file__).parent / "profiles"
    hgx_prof = load(examples / "hgx-h100.toml")
    assert make_plan(collect(Root(hgx.root)), hgx_prof).cores.node == 0
    box_prof = load(examples / "single-gpu.toml")
    assert make_plan(collect(Root(box.root)), box_prof).cores.gateway


def _take_offline(m: Machine, cpu: int, sibling_lists_it: bool) -> None:
    """What the kernel shows with ``cpu`` offline: gone from ``online``, the node's cpulist and
    the GPU's local CPUs, its topology directory removed; its sibling's list may still name it."""
    base = m.root / "sys/devices/system/cpu"
    online = cpulist.parse((base / "online").read_text()) - {cpu}
    (base / "online").write_text(cpulist.format(online) + "\n")
    (base / f"cpu{cpu}/online").write_text("0\n")
    for f in (base / f"cpu{cpu}/topology").iterdir():
        f.unlink()
    (base / f"cpu{cpu}/topology").rmdir()
    node0 = m.root / "sys/devices/system/node/node0/cpulist"
    node0.write_text(cpulist.format(cpulist.parse(node0.read_text()) - {cpu}) + "\n")
    m.nvml.gpus[0].cpus = m.nvml.gpus[0].cpus - {cpu}
    if not sibling_lists_it:
        for d in base.glob("cpu[0-9]*/topology/thread_siblings_list"):
            sibs = cpulist.parse(d.read_text())
            if cpu in sibs:
                d.write_text(cpulist.format(sibs - {cpu}) + "\n")


def test_an_offline_cpu_keeps_its_core_in_the_split(
    box: Machine, capsys: pytest.CaptureFixture[str], write_profile: Callable[[str], Path]
) -> None:
    before = make_plan(collect(Root(box.root)), Profile()).cores
    _take_offline(box, 7, sibling_lists_it=True)
    after = make_plan(collect(Root(box.root)), Profile()).cores
    assert after.isolated == before.isolated and 7 in after.isolated
    assert after.housekeeping == before.housekeeping and 15 not in after.gateway
    assert 15 in after.triton and 7 not in after.triton  # the core's online thread serves
    assert after.offline == (7,) and "cpu7" in after.reasons["offline"]
    keys = by_key(make_plan(collect(Root(box.root)), Profile()))
    assert "cpu15 governor" in keys and "cpu7 governor" not in keys  # no cpufreq when offline
    prof = str(write_profile(""))
    assert main(["plan", "--root", str(box.root), "--profile", prof]) == 0
    assert "cpu7" in next(ln for ln in capsys.readouterr().out.splitlines() if "offline" in ln)
    assert main(["verify", "--root", str(box.root), "--profile", prof]) == 1
    assert "cpu7 offline" in capsys.readouterr().out


def test_an_offline_cpu_of_unknown_core_is_never_housekeeping(box: Machine) -> None:
    # x86 clears the offline CPU from its sibling's thread_siblings_list too.
    _take_offline(box, 7, sibling_lists_it=False)
    c = make_plan(collect(Root(box.root)), Profile()).cores
    assert 7 in c.isolated and 7 not in c.housekeeping + c.serving
    assert c.offline == (7,) and "unknown" in c.reasons["offline"]


def test_a_json_refusal_leaves_stdout_empty(
    box: Machine, write_profile: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # The role parses any stdout as the documented object; a refusal is the stderr line alone.
    prof = write_profile("[serve]\ngpu = 3\n")
    for cmd in ("plan", "apply", "verify"):
        argv = [cmd, "--root", str(box.root), "--profile", str(prof), "--json"]
        assert main([*argv, "--dry-run"] if cmd == "apply" else argv) == 2
        cap = capsys.readouterr()
        assert cap.out == "" and cap.err.startswith("host-tune: ") and cap.err.count("\n") == 1
