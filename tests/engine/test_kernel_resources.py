"""The fused steps' Triton kernels compile for Hopper (sm_90) on this CPU host and none spills
inside a loop.

Triton's interpreter (the other kernel tests) runs a kernel's Python, not its compiled form: a
kernel can pass there and fail to compile, or compile to a spilling one (the attention kernel's
broadcast products once took 255 registers and a 1,776-byte stack frame). `bench.kernel_resources`
compiles every configuration the decode, prefill and verify steps launch on Llama-3.1-8B's
shape in every weight format, with the installed Triton and with the GPU image's (`make test`
puts it in var/gpu-triton): each ships its own ptxas, whose register choices differ."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_TRITON = ROOT / "var" / "gpu-triton"
# Shared memory one block may take on sm_90 (H100, H200), opted in: 227 KiB.
SM90_MAX_SHARED_BYTES = 227 * 1024


def _compiling(triton_dir: Path | None) -> dict[str, str]:
    """The environment of a process that compiles with the Triton in `triton_dir`, else the
    installed one."""
    if triton_dir is not None:
        assert (triton_dir / "triton").is_dir(), f"{triton_dir}: no Triton; `make test` installs it"
    path = [str(triton_dir)] if triton_dir is not None else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(ROOT)])}
    env.pop("TRITON_INTERPRET", None)
    return env


@pytest.mark.parametrize("triton_dir", [None, GPU_TRITON], ids=["installed", "gpu-image"])
def test_every_kernel_of_the_8b_step_compiles_for_sm90_without_spilling_in_a_loop(
    triton_dir: Path | None,
) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.kernel_resources", "--shape", "llama-3.1-8b", "--arch", "90"],
        cwd=ROOT,
        env=_compiling(triton_dir),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    if triton_dir is not None:
        assert run.stdout.startswith(f"llama-3.1-8b, sm_90, Triton {_version(triton_dir)}: ")
    table = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in run.stdout.splitlines()
        if line.startswith("| ")
    ]
    header, rows = table[0], table[1:]
    column = {name: i for i, name in enumerate(header)}
    assert {row[column["kernel"]] for row in rows} == {
        "rms_norm_kernel",
        "rope_kv_write_kernel",
        "decode_attention_split_kernel",
        "decode_attention_combine_kernel",
        "matvec_kernel",
        "int8_matvec_kernel",
        "int4_matvec_kernel",
        "rows_matmul_kernel",
        "prefill_attention_kernel",
        "silu_mul_kernel",
    }
    assert all(row[column["spills in loops"]] == "0" for row in rows), run.stdout
    assert all(int(row[column["stack B"]]) <= 16 for row in rows), run.stdout
    # Triton's dynamic shared memory (tl.dot's pipelined operands) within the most a block of
    # sm_90 may take, 227 KiB: past it a kernel fails at its first launch on the GPU.
    shared = [(row[column["kernel"]], int(row[column["shared B"]])) for row in rows]
    assert max(size for _, size in shared) <= SM90_MAX_SHARED_BYTES, run.stdout
    dots = [size for kernel, size in shared if kernel.startswith(("rows_", "prefill_"))]
    assert dots and min(dots) > 1024, run.stdout  # more than the static 1 KiB a block
    # Below the ceiling of 255 a thread can address: a kernel at it is one change from spilling.
    assert all(int(row[column["registers"]]) < 255 for row in rows), run.stdout
    assert len(rows) >= 19
    # A weight product converts no integer to a float: at 16 a clock per SM, one conversion per
    # INT4 weight made the step convert-bound (a bit trick takes an OR and a subtraction).
    products = [row for row in rows if "matvec" in row[0] or "matmul" in row[0]]
    assert products and all(row[column["int→float cvt"]] == "0" for row in products), run.stdout
    # With programmatic dependent launch each kernel of the step waits on the one before it on
    # the device; without, none does.
    launched_early = [row for row in rows if re.search(r"\bPDL=[12]\b", row[column["constexprs"]])]
    assert {row[column["kernel"]] for row in launched_early} == {
        "rms_norm_kernel",
        "rope_kv_write_kernel",  # the prefill and verify steps' RoPE, with PDL on
        "decode_attention_split_kernel",
        "decode_attention_combine_kernel",
        "matvec_kernel",
        "int8_matvec_kernel",
        "int4_matvec_kernel",
    }
    assert all(row[column["waits"]] == ("yes" if row in launched_early else "no") for row in rows)


def test_an_unknown_format_is_one_line() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.kernel_resources", "--formats", "bf16,int3"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "unknown format(s) ['int3']; known: bf16, fp8, fp8-tensor, int8, int4" in run.stderr


def _version(triton_dir: Path) -> str:
    (info,) = triton_dir.glob("triton-*.dist-info")
    return info.name.removeprefix("triton-").removesuffix(".dist-info")


def test_a_spill_inside_a_loop_is_counted_and_one_outside_is_not() -> None:
    """A product held to fewer registers than it needs spills in its loop; the SASS reader
    counts those local-memory accesses and not the ones before and after a loop."""
    script = """
from bench.kernel_resources import Launch, compile_launch
ints = [("n_rows", "i32"), ("n_out", "i32"), ("n_in", "i32")]
consts = {"FORMAT": 0, "SCALE": 0, "GROUP": 1, "GATED": True, "BLOCK_M": 64, "BLOCK_N": 64,
          "BLOCK_K": 64, "PRECISION": "tf32", "WIDEN": False}
signature = [(n, "*bf16") for n in ("x_ptr", "w_ptr", "scale_ptr", "out_ptr")] + ints
signature += [(k, "constexpr") for k in consts]
for options in ((), (("maxnreg", 72),)):
    launch = Launch("rows_matmul_kernel", tuple(signature), tuple(consts.items()),
                    (0, 1, 2, 3, 5, 6), options)
    r = compile_launch(launch, 90)
    print(r.registers, r.stack, r.loop_spills)
"""
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=_compiling(None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    free, held = (tuple(map(int, line.split())) for line in run.stdout.splitlines())
    assert free[1:] == (0, 0) and free[0] > 72
    assert held[0] <= 72 and held[1] > 0 and held[2] > 0


def test_the_sass_reader_finds_loops_by_their_backward_branches() -> None:
    from bench.sass import loop_spills

    def line(address: int, text: str) -> str:
        return f"        /*{address:04x}*/                   {text} ;   /* 0x0000000000000000 */"

    sass = "\n".join([
        line(0x00, "STL [R1], R2"),  # before the loop
        line(0x10, "@!P0 BRA 0x60"),  # forward: skips the loop
        line(0x20, "LDL R3, [R1+0x4]"),  # the loop's first instruction
        line(0x30, "STL.64 [R1+0x8], R4"),
        line(0x40, "@P1 BRA 0x20"),  # back to the loop's start
        line(0x50, "LDL.LU R2, [R1]"),  # after it
        line(0x60, "EXIT"),
        line(0x70, "BRA 0x70"),  # the trap after EXIT
    ])  # fmt: skip
    assert loop_spills(sass) == 2
