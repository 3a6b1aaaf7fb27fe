"""What an engine needs from the runtime that serves it: the same TensorRT-LLM, and one GPU.

A TensorRT engine deserializes only on the TensorRT version that built it, and each TensorRT-LLM
release pins one TensorRT version, so the TensorRT-LLM version trtllm-build records in the
engine's config.json (``version``) must equal the one installed in the Triton root filesystem
(the ``tensorrt_llm-*.dist-info`` of the exported NGC image).

Engines with more than one rank are refused: the tensorrtllm backend runs them only under
``mpirun -n <ranks>`` or in orchestrator mode (``TRTLLM_ORCHESTRATOR=1`` spawning the backend's
``trtllmExecutorWorker``), and appliance-triton.service launches neither.
"""

from __future__ import annotations

from pathlib import Path

from engine_build.errors import SpecError
from engine_build.spec import BuildSpec

# Where the NGC trtllm image installs the tensorrt_llm wheel, relative to its root.
TRTLLM_DIST_INFO_GLOB = "usr/local/lib/python3*/dist-packages/tensorrt_llm-*.dist-info"


def multi_gpu_refusal(ranks: int) -> str:
    """Why an engine of ``ranks`` > 1 ranks is refused, and what to do instead."""
    return (
        f"{ranks} ranks (parallel.tp_size {ranks}): appliance-triton.service does not launch "
        "multi-GPU engines (the tensorrtllm backend needs `mpirun -n RANKS tritonserver` or "
        "TRTLLM_ORCHESTRATOR=1); build with parallel.tp_size = 1"
    )


def require_single_gpu(spec: BuildSpec) -> None:
    """``build`` and ``repo`` refuse what Triton would not be started for (``plan`` still
    shows how a multi-GPU engine would fit)."""
    if spec.tp_size > 1:
        raise SpecError(f"{spec.source}: key 'parallel.tp_size': {multi_gpu_refusal(spec.tp_size)}")


def root_trtllm_version(root: Path) -> str | None:
    """The TensorRT-LLM version installed in a Triton root filesystem; None when it has none
    or more than one."""
    found = sorted(root.glob(TRTLLM_DIST_INFO_GLOB))
    if len(found) != 1:
        return None
    name = found[0].name.removesuffix(".dist-info")
    return name.split("-", 1)[1]


def version_problems(engine_version: object, root: Path | None, supported: str) -> list[str]:
    """Mismatches between the engine's recorded TensorRT-LLM version and the runtime's.

    Without ``root`` the engine must at least come from the pinned line (``supported``, e.g.
    "1.2"); with it, the versions must be equal.
    """
    if not isinstance(engine_version, str) or not engine_version:
        return [
            "engine config.json records no TensorRT-LLM version ('version'); rebuild it with "
            "`engine-build build`"
        ]
    if root is None:
        if engine_version.split(".")[:2] != supported.split("."):
            return [
                f"engine was built by TensorRT-LLM {engine_version}, not the {supported} line "
                "the tensorrtllm backend serves; rebuild it"
            ]
        return []
    runtime = root_trtllm_version(root)
    if runtime is None:
        return [
            f"{root} holds no single tensorrt_llm installation ({TRTLLM_DIST_INFO_GLOB}); "
            "not a Triton TensorRT-LLM root filesystem"
        ]
    if runtime != engine_version:
        return [
            f"engine was built by TensorRT-LLM {engine_version} but {root} runs {runtime}: "
            "a TensorRT engine loads only on the TensorRT that built it; rebuild the engine "
            "with the root's version"
        ]
    return []
