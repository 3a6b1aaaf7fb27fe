"""NVML faked at the pynvml call boundary, for the inference server's GPU families."""

from __future__ import annotations

import types

import pytest

UUID = "GPU-8d6c9d0e-3c2a-4a4e-9f0e-1f2e3d4c5b6a"


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """NVML faked at the pynvml call boundary: one GPU, UUID, 37 % busy, 20 of 141 GiB in use,
    412.5 W of a 700 W limit; the dict counts the calls that open the library ("init") and holds
    the GPU's energy counter, in millijoules since the driver loaded ("energy_mj")."""
    import pynvml

    calls = {"init": 0, "energy_mj": 9_000_000}

    def init() -> None:
        calls["init"] += 1

    def handle(uuid: str | bytes) -> object:
        if (uuid.decode() if isinstance(uuid, bytes) else uuid) != UUID:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return "handle"

    fakes = {
        "nvmlInit": init,
        "nvmlDeviceGetHandleByUUID": handle,
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=37, memory=5),
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(
            total=141 << 30, used=20 << 30, free=121 << 30
        ),
        "nvmlDeviceGetPowerUsage": lambda h: 412_500,
        "nvmlDeviceGetPowerManagementLimit": lambda h: 700_000,
        "nvmlDeviceGetTotalEnergyConsumption": lambda h: calls["energy_mj"],
    }
    for name, fn in fakes.items():
        monkeypatch.setattr(pynvml, name, fn)
    return calls
