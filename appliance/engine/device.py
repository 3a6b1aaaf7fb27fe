"""The engine's device: a device string resolved to one indexed torch.device, made current.

`cuda` means the CUDA device that is current when it is resolved, with its index: torch accepts an
index-less CUDA device for tensors but `torch.cuda.set_device` refuses it ("Expected a torch.device
with a specified index"), and the current device is per thread, so a compute thread must set the
indexed one itself. Every place that picks or enters the engine's device goes through here.
"""

from __future__ import annotations

import torch

__all__ = ["enter_device", "resolve_device"]


def resolve_device(device: str | torch.device) -> torch.device:
    """`device` with an index when it is a CUDA device: `cuda` -> `cuda:{current device}`.

    CPU (and any other type) devices are returned as they are. Resolving `cuda` initialises CUDA,
    so callers check availability first (`options.device_problem`).
    """
    parsed = torch.device(device)
    if parsed.type == "cuda" and parsed.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return parsed


def enter_device(device: str | torch.device) -> torch.device:
    """Make `device` current for the calling thread when it is a CUDA device; returns it indexed."""
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    return resolved
