"""What the fused decode and prefill steps' Triton kernels compile to on a GPU, without the GPU.

Triton compiles for any NVIDIA target on a host without one (its wheel carries ptxas and
cuobjdump), so each kernel configuration the fused step launches on a model's shape is compiled
here for the chosen architecture and read back: registers per thread, the stack frame (where
registers spill), the local-memory loads and stores inside a loop of the machine code (a spill
each pass pays: a matrix-vector or attention kernel that spills there reads local memory beside
the weights), shared memory (as Triton's launcher requests it: over the device's limit a kernel
fails at its first launch), the widest global load in its PTX and its integer-to-float conversions
(16 a clock per SM on a GPU, a quarter of the integer rate: a product that converts each weight
is bound by them, not by its bytes). The configurations are recorded from `fused.decode_step`,
`fused.folded_step`, `fused.static_rows` and `fused.prefill` themselves, run on a meta-device
model of one block (blocks are alike) in every weight format at a few attention spans and row
counts, so the list follows the steps.

    python -m bench.kernel_resources --shape llama-3.1-8b --arch 90
    PYTHONPATH=var/gpu-triton python -m bench.kernel_resources --record   # the GPU image's Triton

Exits 1 when a kernel spills inside a loop, or keeps more than `COLD_STACK_BYTES` of stack,
unless --allow-spills. ptxas may keep a value or two that a loop does not use on the stack
across it, to stay at a register count: a store before the loop and a load after, once per
thread, which costs nothing a kernel's bytes would show. The CPU suite runs it with the
installed Triton and with the GPU image's, whose ptxas decides differently.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Compiling needs the real triton.jit; the CPU suite interprets kernels (TRITON_INTERPRET=1).
os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said aloud

import torch

from appliance.engine import fused, kernels, quantized
from appliance.engine.linear import WeightQuant
from appliance.engine.llama import LlamaModel
from appliance.engine.quantized import GroupQuant
from appliance.engine.random_weights import SHAPES, random_config
from bench import record
from bench.sass import loop_spills

FORMATS: dict[str, WeightQuant | None] = {
    "bf16": None,
    "fp8": "channel",
    "fp8-tensor": "tensor",
    "int8": GroupQuant(8, 128),
    "int4": GroupQuant(4, 128),
}
# Spans of the attention kernels: one split, the most splits, and long splits.
SPANS = (64, 2048, 8192)
# Row counts of the fixed-shape prefill and verify steps: one row tile of each height
# (`kernels.ROWS_TILE`), and several.
ROWS = (16, 32, 64, 128)
# Stack a kernel may keep outside its loops (a few values ptxas parks across a loop).
COLD_STACK_BYTES = 16
# Launch keywords that are Triton compile options, not the kernel's constexprs.
OPTIONS = ("launch_pdl",)
_TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel configuration: its name, argument types and constexprs."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    divisible: tuple[int, ...]  # arguments 16-divisible (pointers, and ints that are)
    options: tuple[tuple[str, Any], ...] = ()  # Triton's compile options among the launch's


def record_launches(shape: str, fmt: WeightQuant | None, spans: tuple[int, ...]) -> list[Launch]:
    """The distinct launches of the fused decode step on a meta-device model of `shape`'s
    dimensions (one block), in weight format `fmt`, at each attention span."""
    from triton.runtime.jit import JITFunction

    from appliance.engine import triton_kernels

    launches: list[Launch] = []

    def kernel(name: str) -> Any:
        fn = getattr(triton_kernels, name)
        assert isinstance(fn, JITFunction), f"{name} is not compiled Triton (TRITON_INTERPRET?)"

        def launch(*args: Any, **constexprs: Any) -> None:
            options = tuple((k, constexprs.pop(k)) for k in OPTIONS if k in constexprs)
            signature, divisible = [], []
            for i, (arg_name, value) in enumerate(zip(fn.arg_names, args, strict=False)):
                if isinstance(value, torch.Tensor):
                    signature.append((arg_name, "*" + _TRITON_TYPES[value.dtype]))
                    divisible.append(i)
                elif isinstance(value, float):
                    signature.append((arg_name, "fp32"))
                else:
                    signature.append((arg_name, "i32" if abs(value) < 2**31 else "i64"))
                    # As Triton's launcher: no divisibility for an unspecialised argument.
                    if value % 16 == 0 and not fn.params[i].do_not_specialize:
                        divisible.append(i)
            signature += [(k, "constexpr") for k in constexprs]
            found = Launch(
                name, tuple(signature), tuple(constexprs.items()), tuple(divisible), options
            )
            if found not in launches:
                launches.append(found)

        return launch

    class Grid:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: object) -> Callable[..., None]:
            return kernel(self.name)  # type: ignore[no-any-return]

    class Recorder:
        def __getattr__(self, name: str) -> Grid:
            return Grid(name)

    config = dataclasses.replace(random_config(shape), num_hidden_layers=1)
    spans = tuple(sorted({min(span, config.max_position_embeddings) for span in spans}))
    meta = torch.device("meta")
    tensors = {
        n: torch.empty(s, device=meta) for n, s in LlamaModel.expected_shapes(config).items()
    }
    real_tk, real_int4, real_pdl = kernels._tk, quantized._int4_kernel, kernels.PDL
    kernels._tk = Recorder  # type: ignore[assignment]
    quantized._int4_kernel = lambda weight: "dequantize"  # the layout a CUDA device gets
    try:
        model = LlamaModel(config, tensors, meta, torch.bfloat16, fmt)
        model.kernels = "triton"
        cache = model.new_cache(max(spans))
        step_in = torch.empty(2, dtype=torch.long, device=meta)
        logits = torch.empty(config.vocab_size, device=meta)
        meta_in = torch.empty(2, dtype=torch.long, device=meta)
        # Without and with programmatic dependent launch (`kernels.PDL` is global: with it on,
        # the prefill and verify steps' norms and RoPE are launched early too).
        for pdl in ("off", "wait", "early-read"):
            kernels.PDL = pdl
            for span in spans:
                if pdl == "off":
                    fused.decode_step(model, step_in, cache, span, logits)
                fused.folded_step(model, step_in, cache, span, logits)
            for rows in ROWS:
                ids = torch.empty(rows, dtype=torch.long, device=meta)
                h = fused.static_rows(model, ids, meta_in, cache)
                fused.rows_logits(model, h, torch.empty(rows, config.vocab_size, device=meta))
            fused.prefill(model, [0] * (fused.FUSED_ROWS + 1), cache, 0)  # a long prefill
    finally:
        kernels._tk, quantized._int4_kernel, kernels.PDL = real_tk, real_int4, real_pdl
    return launches


@dataclasses.dataclass
class Resources:
    registers: int
    stack: int  # bytes of stack frame per thread: spilled registers live there
    loop_spills: int  # local-memory loads and stores inside a loop of the SASS
    local: int
    shared: int  # bytes of dynamic shared memory Triton's launcher asks for (its metadata)
    widest_load: str
    int_to_float: int  # cvt instructions from an integer to a float type in the PTX
    waits: bool  # the PTX waits on the kernel before it (programmatic dependent launch)
    seconds: float


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_launch(launch: Launch, arch: int) -> Resources:
    """Compile one configuration for sm_`arch` and read its resources from the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from appliance.engine import triton_kernels

    started = time.perf_counter()
    source = ASTSource(
        getattr(triton_kernels, launch.kernel),
        dict(launch.signature),
        constexprs=dict(launch.constexprs),
        attrs={(i,): [["tt.divisibility", 16]] for i in launch.divisible},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options=dict(launch.options)
    )
    seconds = time.perf_counter() - started
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage, sass = (
            subprocess.run(
                [_tool("cuobjdump"), flag, cubin.name], capture_output=True, text=True, check=True
            ).stdout
            for flag in ("-res-usage", "-sass")
        )
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {launch.kernel}")
    # cuobjdump's SHARED is the static shared memory (sm_90 reserves 1 KiB a block); Triton's
    # operand buffers (tl.dot's, pipelined) are dynamic, requested at each launch.
    registers, stack, _, local = map(int, found.groups())
    shared = int(compiled.metadata.shared)
    widths = re.findall(r"ld\.global(?:\.\w+)*?(?:\.v(\d))?\.[bfsu](\d+)", compiled.asm["ptx"])
    widest = max((int(v or 1) * int(bits) for v, bits in widths), default=0)
    conversions = len(re.findall(r"\bcvt\.\w+\.f(?:16|32|64)\.[su]\d+\b", compiled.asm["ptx"]))
    waits = "griddepcontrol.wait" in compiled.asm["ptx"]
    return Resources(
        registers,
        stack,
        loop_spills(sass),
        local,
        shared,
        f"{widest // 8} B",
        conversions,
        waits,
        seconds,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90, 80")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated")
    parser.add_argument("--allow-spills", action="store_true")
    record.add_flag(parser)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.formats.split(",")) - set(FORMATS))
    if unknown:
        parser.error(f"unknown format(s) {unknown}; known: {', '.join(FORMATS)}")
    launches: list[Launch] = []
    for name in args.formats.split(","):
        for found in record_launches(args.shape, FORMATS[name], SPANS):
            if found not in launches:
                launches.append(found)
    import triton

    with record.recording(
        "kernel_resources", record.record_dir(args), None if argv is None else list(argv)
    ) as run:
        spills = _report(
            launches,
            args.arch,
            f"{args.shape}, sm_{args.arch}, Triton {triton.__version__}",
            run.results.setdefault("launches", []),
        )
    if spills and not args.allow_spills:
        print(f"spilling: {', '.join(sorted(set(spills)))}", file=sys.stderr)
        return 1
    return 0


def _report(launches: list[Launch], arch: int, title: str, rows: list[dict[str, Any]]) -> list[str]:
    """Compiles and prints each launch's row, appended to `rows`; returns the kernels that
    spill."""
    print(f"{title}: {len(launches)} kernel configurations", flush=True)
    print(
        "| kernel | pointers | constexprs | registers | stack B | spills in loops | shared B | "
        "widest load | int→float cvt | waits | compile s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    spills = []
    for launch in launches:
        r = compile_launch(launch, arch)
        shown = ", ".join(f"{k}={v}" for k, v in launch.constexprs)
        pointers = ",".join(t[1:] for _, t in launch.signature if t.startswith("*"))
        print(
            f"| {launch.kernel} | {pointers} | {shown} | {r.registers} | {r.stack} | "
            f"{r.loop_spills} | {r.shared} | {r.widest_load} | {r.int_to_float} | "
            f"{'yes' if r.waits else 'no'} | {r.seconds:.1f} |",
            flush=True,
        )
        rows.append({"kernel": launch.kernel, "pointers": pointers, "constexprs": shown})
        rows[-1] |= dataclasses.asdict(r)
        if r.loop_spills or r.stack > COLD_STACK_BYTES or r.local:
            spills.append(launch.kernel)
    return spills


if __name__ == "__main__":
    sys.exit(main())
