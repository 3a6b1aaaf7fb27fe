"""The fused steps' Triton kernels compile for Hopper (sm_90) on this CPU host and none spills.

Triton's interpreter (the other kernel tests) runs a kernel's Python, not its compiled form: a
kernel can pass there and fail to compile, or compile to a spilling one (the attention kernel's
broadcast products once took 255 registers and a 1,776-byte stack frame). `bench.kernel_resources`
compiles every configuration the decode, prefill and verify steps launch on Llama-3.1-8B's
shape in every weight format."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_of_the_8b_step_compiles_for_sm90_without_spilling() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run(
        [sys.executable, "-m", "bench.kernel_resources", "--shape", "llama-3.1-8b", "--arch", "90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    table = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in run.stdout.splitlines()
        if line.startswith("| ")
    ]
    header, rows = table[0], table[1:]
    names = ("kernel", "constexprs", "stack B", "registers", "int→float cvt", "waits")
    column = {name: header.index(name) for name in names}
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
    assert all(row[column["stack B"]] == "0" for row in rows), run.stdout
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
