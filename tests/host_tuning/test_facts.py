"""Facts read through a root prefix from generated machines, NVML faked at pynvml."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from host_tuning import cpulist
from host_tuning.cli import main
from host_tuning.facts import pci
from host_tuning.facts.collect import collect
from host_tuning.rootfs import Root
from tests.host_tuning import hostbuilder
from tests.host_tuning.hostbuilder import Machine


@given(st.sets(st.integers(0, 600)))
def test_cpulist_round_trip(cpus: set[int]) -> None:
    assert cpulist.parse(cpulist.format(cpus)) == cpus


@given(st.sets(st.integers(0, 300)), st.integers(1, 320))
def test_mask_round_trip(cpus: set[int], n: int) -> None:
    assert cpulist.parse_mask(cpulist.format_mask(cpus, n)) == cpus


def test_cpulist_examples() -> None:
    assert cpulist.parse("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpulist.format([3, 1, 2, 7]) == "1-3,7"
    # The kernel's group form START-END:USED/GROUP (kernel-parameters "cpu lists").
    assert cpulist.parse("100-200:2/25") == {100, 101, 125, 126, 150, 151, 175, 176, 200}
    assert cpulist.parse("0-6:1/2") == {0, 2, 4, 6}
    assert cpulist.format_mask([0, 33], 64) == "00000002,00000001"
    assert cpulist.from_words([0b101, 1]) == {0, 2, 64}


@pytest.mark.parametrize(
    "text",
    [
        "0-6:2",  # no group size: the kernel refuses it
        "3-1",
        "0-7:3/2",
        "0-7:1/0",
        "1_0",
        "+3",
        "0-8192",  # the kernel has at most 8192 CPUs: a typo, never a list to expand
        "4000000000",
    ],
)
def test_cpulist_refuses_what_the_kernel_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        cpulist.parse(text)


def test_cpulist_mask_examples() -> None:
    assert cpulist.format_mask([0, 33], 64) == "00000002,00000001"
    assert cpulist.from_words([0b101, 1]) == {0, 2, 64}


def test_hgx_topology(hgx: Machine) -> None:
    f = collect(Root(hgx.root))
    assert len(f.cpus) == 192 and sorted(f.nodes) == [0, 1]
    assert f.cpu(0).siblings == (0, 96) and f.cpu(150).node == 1
    assert [g.bus_id for g in f.gpus] == hgx.gpus
    g4 = f.gpu(4)
    assert g4.numa_node == 1 and g4.source == "nvml"
    assert g4.nvml_bus_id.startswith("00000000:") and f.gpu(g4.nvml_bus_id) == g4
    assert set(g4.local_cpus) == set(hgx.nodes[1])
    rdma = [n for n in f.nics if n.rdma]
    assert sorted(n.name for n in rdma) == sorted(hgx.rdma_nics)
    mgmt = f.nic("eno1")
    assert mgmt.rdma is None and mgmt.driver == "i40e"
    assert all(len(n.irqs) == 9 and n.driver == "mlx5_core" for n in rdma)
    assert f.thp == {"enabled": "madvise", "defrag": "madvise"}
    assert f.irqbalance["running"] is True
    assert f.iommu["passthrough"] is False
    assert f.hugepages[1] == {"2048": 0, "1048576": 0}


def test_hgx_pcie_distance_and_acs(hgx: Machine) -> None:
    f = collect(Root(hgx.root))
    gpu0, nic0 = f.gpus[0].bus_id, f.nic(hgx.rdma_nics[0]).pci
    same_switch = next(p for p in f.pci_paths if p.gpu == gpu0 and p.nic == nic0)
    assert same_switch.distance == "PIX"
    # switch upstream port (no ACS) and both downstream ports (ACS redirect on)
    assert [b.acs_ctl for b in same_switch.bridges] == [None, 0x1D, 0x1D]
    nic1 = f.nic(hgx.rdma_nics[1]).pci
    assert next(p for p in f.pci_paths if p.nic == nic1 and p.gpu == gpu0).distance == "NODE"
    far = f.nic(hgx.rdma_nics[7]).pci
    assert next(p for p in f.pci_paths if p.nic == far and p.gpu == gpu0).distance == "SYS"


def test_acs_capability_walk() -> None:
    assert pci.acs_capability(hostbuilder.config_space(0x1D)) == 0x148
    assert pci.acs_capability(hostbuilder.config_space(None)) is None
    assert pci.acs_capability(b"\0" * 64) is None  # unprivileged reads stop at 64 bytes


def test_pci_classify() -> None:
    root = ["pci0000:00"]
    assert (
        pci.classify([*root, "0000:00:01.0", "0000:01:00.0"], [*root, "0000:00:02.0"], True)[0]
        == "PHB"
    )
    a = [*root, "0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"]
    b = [*root, "0000:00:01.0", "0000:01:00.0", "0000:05:00.0"]
    assert pci.classify(a, b, True)[0] == "PXB"


def test_single_socket_numa_minus_one(box: Machine) -> None:
    f = collect(Root(box.root))
    assert len(f.cpus) == 16 and f.cpu(3).siblings == (3, 11)
    (gpu,) = f.gpus
    assert gpu.numa_node == -1 and gpu.name == "NVIDIA L40S"
    nic = f.nic("enp2s0f0np0")
    assert nic.numa_node == -1 and nic.local_cpus == tuple(range(16))
    assert f.pci_paths[0].distance == "PHB"
    assert f.cpufreq["energy_perf_bias_cpu0"] is None
    assert f.irqbalance["running"] is False


def test_nvml_missing_falls_back_to_sysfs(box: Machine) -> None:
    box.nvml.missing = True
    f = collect(Root(box.root))
    assert f.gpu_error is not None and "NVML" in f.gpu_error
    assert [(g.bus_id, g.source) for g in f.gpus] == [("0000:01:00.0", "sysfs")]


def test_nvml_shutdown_after_use(hgx: Machine) -> None:
    collect(Root(hgx.root))
    assert hgx.nvml.calls == ["nvmlInit", "nvmlShutdown"]


def test_cli_facts_json(hgx: Machine, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["facts", "--root", str(hgx.root)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["gpus"]) == 8 and data["root"] == str(hgx.root)
    assert main(["facts", "--root", str(hgx.root), "--json"]) == 0  # accepted: always JSON
    assert json.loads(capsys.readouterr().out) == data
