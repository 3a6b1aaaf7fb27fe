"""`cuda` resolves to the current CUDA device with its index wherever the engine enters a device,
tested on the CPU with torch.cuda faked as one GPU that behaves as real torch does."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch

from appliance import cli as appliance_cli
from appliance.engine.device import enter_device, resolve_device
from appliance.engine.llama import KVCache, LlamaModel
from appliance.engine.options import EngineOptions
from appliance.engine.runner import Runner
from bench import gpu_decode


class FakeCuda:
    """torch.cuda as seen on a host with `count` GPUs whose current device is `current`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int = 1, current: int = 0) -> None:
        self.current = current
        self.set_calls: list[torch.device] = []
        self.capability = (9, 0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(
            torch.cuda, "get_device_capability", lambda device=None: self.capability
        )

    def set_device(self, device: torch.device | int | str) -> None:
        device = (
            torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        )
        self.set_calls.append(device)
        if device.index is None:  # what torch.cuda.set_device does with an index-less device
            raise ValueError(
                f"Expected a torch.device with a specified index or an integer, but got:{device}"
            )
        self.current = device.index


def test_cuda_resolves_to_the_current_device_with_its_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = FakeCuda(monkeypatch, count=2, current=1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    assert enter_device("cuda") == torch.device("cuda", 1)
    assert enter_device("cpu") == torch.device("cpu")
    assert cuda.set_calls == [torch.device("cuda", 1)]  # the CPU is never "entered"
    assert EngineOptions(device="cuda").torch_device == torch.device("cuda", 1)


def test_the_runner_thread_enters_an_index_less_cuda_device(
    micro_model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = FakeCuda(monkeypatch)
    on_gpu = copy.copy(micro_model)  # computes on the CPU, but says it lives on `cuda`
    on_gpu.device = torch.device("cuda")

    def cpu_cache(max_seq_len: int) -> KVCache:
        return micro_model.new_cache(max_seq_len)

    monkeypatch.setattr(on_gpu, "new_cache", cpu_cache)
    failures: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    runner = Runner(on_gpu, 64)
    try:
        assert runner.close(10)
    finally:
        runner.close(10)
    assert failures == []  # the compute thread did not die entering its device
    assert cuda.set_calls == [torch.device("cuda", 0)]


def test_the_gpu_benchmark_enters_an_index_less_cuda_device(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cuda = FakeCuda(monkeypatch)

    class Entered(Exception):
        pass

    def stop(*args: object, **kwargs: object) -> None:
        raise Entered

    monkeypatch.setattr(torch.cuda, "get_device_name", stop)
    monkeypatch.setattr(gpu_decode, "copy_bandwidth", stop)
    with pytest.raises(Entered):
        gpu_decode.main(["--device", "cuda", "--skip-path", "--out", str(tmp_path)])
    assert cuda.set_calls == [torch.device("cuda", 0)]


def test_fp8_on_a_gpu_without_fp8_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cuda = FakeCuda(monkeypatch)
    cuda.capability = (8, 0)  # an A100
    argv = ["engine", "--repository", str(tmp_path), "--device", "cuda", "--weights", "fp8"]
    assert appliance_cli.main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [
        "appliance engine: --weights fp8: FP8 matrix products need compute capability 8.9 or "
        "later (Ada, Hopper); this GPU is 8.0: use --weights dtype"
    ]
