"""GPUDirect RDMA prerequisites: peer-memory module at boot, ACS off on the GPU–NIC path.

ACS and DMA-BUF are reported as advice: ACS control resets at every boot, so the oneshot
appliance-acs.service clears it at each boot for the bridges the host_tuning role lists
(host_tuning_acs_bridges); DMA-BUF needs the open kernel modules, not something to switch at runtime.
"""

from __future__ import annotations

from host_tuning.cores import CorePlan
from host_tuning.facts.model import Facts
from host_tuning.items import Advice, Item
from host_tuning.plugins.base import FilePlugin
from host_tuning.profile import Profile

PEERMEM_CONF = "/etc/modules-load.d/host-tune-peermem.conf"


class GpuDirect(FilePlugin):
    name = "gpudirect"
    owns_files = True

    def plan(
        self, facts: Facts, profile: Profile, cores: CorePlan
    ) -> tuple[list[Item], list[Advice]]:
        items: list[Item] = []
        advice: list[Advice] = []
        if profile.gpudirect == "none":
            return items, advice
        if profile.gpudirect == "peermem":
            items.append(
                Item(
                    self.name,
                    "gpudirect nvidia-peermem",
                    PEERMEM_CONF,
                    "nvidia-peermem",
                    "nvidia-peermem must be loaded at every boot for GPUDirect RDMA",
                )
            )
        else:
            advice.append(
                Advice(
                    "gpudirect",
                    "use DMA-BUF (NVIDIA open kernel modules); no nvidia-peermem",
                    "NVIDIA recommends DMA-BUF over nvidia-peermem",
                )
            )
        advice.append(
            Advice("gpudirect", "LimitMEMLOCK=infinity in the serving units", "RDMA pins memory")
        )
        if facts.iommu.get("passthrough") is False:
            advice.append(
                Advice(
                    "iommu",
                    f"IOMMU domain is {facts.iommu.get('gpu_domain_type')}: needs iommu=pt",
                    "DMA remapping breaks or slows GPUDirect P2P",
                )
            )
        if profile.disable_acs:
            gpu = cores.gpu
            for path in facts.pci_paths:
                if path.gpu != gpu or path.nic not in _nic_bdfs(facts, profile):
                    continue
                for br in path.bridges:
                    if br.acs_ctl:
                        advice.append(
                            Advice(
                                "acs",
                                f"setpci -s {br.bdf} ECAP_ACS+0x6.w=0000 (at every boot)",
                                f"ACSCtl={br.acs_ctl:#06x} on the {path.distance} path "
                                f"{path.gpu}↔{path.nic} redirects P2P via the root complex",
                            )
                        )
        return items, advice


def _nic_bdfs(facts: Facts, profile: Profile) -> set[str]:
    return {n.pci for n in facts.nics if n.name in profile.nics and n.pci}
