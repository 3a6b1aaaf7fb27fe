"""Invariants of the pure core chooser over generated topologies (no files involved)."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from host_tuning.cores import PlanError, choose
from host_tuning.facts.model import Cpu, Facts, Gpu
from host_tuning.profile import Profile


def facts_for(sockets: int, cores: int, threads: int, gpu_node: int) -> Facts:
    per = sockets * cores
    cpus = [
        Cpu(
            id=cid,
            core=(cid % per) % cores,
            package=(cid % per) // cores,
            node=(cid % per) // cores,
            siblings=tuple(t * per + cid % per for t in range(threads)),
        )
        for cid in range(per * threads)
    ]
    nodes: dict[int, list[int]] = {}
    for c in cpus:
        nodes.setdefault(c.node, []).append(c.id)
    gpu = Gpu(
        0,
        "NVIDIA H100",
        "0000:18:00.0",
        "00000000:18:00.0",
        "GPU-x",
        gpu_node,
        tuple(nodes[gpu_node]),
        "nvml",
    )
    return Facts(root="/", cpus=cpus, nodes=nodes, gpus=[gpu])


@settings(max_examples=60, deadline=None)
@given(
    sockets=st.integers(1, 2),
    cores=st.integers(2, 40),
    threads=st.integers(1, 2),
    hk=st.integers(1, 4),
    nic=st.integers(0, 4),
    gw=st.integers(0, 4),
    smt=st.booleans(),
    data=st.data(),
)
def test_roles_are_disjoint_whole_cores_on_the_gpu_node(
    sockets: int,
    cores: int,
    threads: int,
    hk: int,
    nic: int,
    gw: int,
    smt: bool,
    data: st.DataObject,
) -> None:
    node = data.draw(st.integers(0, sockets - 1))
    facts = facts_for(sockets, cores, threads, node)
    profile = Profile(
        housekeeping_cores=hk,
        nic_irq_cores=nic,
        gateway_cores=gw,
        serving_smt=smt,
        nics=("eth9",) if nic else (),
    )
    try:
        plan = choose(facts, profile)
    except PlanError:
        assume(False)
        return
    everything = {c.id for c in facts.cpus}
    hk_set, nic_set, iso = set(plan.housekeeping), set(plan.nic_irq), set(plan.isolated)
    assert hk_set | nic_set | iso == everything
    assert not (hk_set & nic_set or hk_set & iso or nic_set & iso)
    assert set(plan.serving) <= iso and not set(plan.gateway) & set(plan.triton)
    node_cpus = set(facts.nodes[node])
    assert iso <= node_cpus and nic_set <= node_cpus
    for c in facts.cpus:  # whole physical cores: siblings share a role
        if c.id in iso:
            assert set(c.siblings) <= iso
    assert len(plan.gateway) == gw * (threads if smt else 1)
    assert plan.triton  # at least one core is left for Triton
