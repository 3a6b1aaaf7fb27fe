"""CPU time of one linear layer per weight format at batch 1 (and a short prefill), same run.

    python -m bench.weight_kernels [--shapes 3072x576,576x1536,14336x4096] [--tokens 1,64]

For each (out x in) shape and token count: the model-dtype `F.linear` (the baseline), INT8
group-wise (dequantize per call), INT4 group-wise on torch's `_weight_int4pack_mm_for_cpu`, and
INT4 dequantized per call. Reports the median of `--repeat` calls and each format's ratio to the
baseline measured in the same run; nothing here is a pass/fail goal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from appliance.engine.linear import PlainLinear
from appliance.engine.quantized import GroupQuant, quantize_group_linear
from bench import record

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _median_ms(fn, x: torch.Tensor, repeat: int) -> float:  # type: ignore[no-untyped-def]
    fn(x)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.weight_kernels")
    p.add_argument("--shapes", default="3072x576,576x1536,14336x4096")
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--repeat", type=int, default=20)
    record.add_flag(p)
    args = p.parse_args(argv)
    with record.recording(
        "weight_kernels", record.record_dir(args), None if argv is None else list(argv)
    ):
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, group {args.group}")
        print(
            "| dtype | out x in | tokens | F.linear ms | int8 dequant | int4 int4pack | int4 dequant |"
        )
        print("|---|---|---:|---:|---:|---:|---:|")
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            for shape in args.shapes.split(","):
                out_f, in_f = (int(v) for v in shape.split("x"))
                w = torch.randn(out_f, in_f) * in_f**-0.5
                plain = w.to(dtype)
                int8 = quantize_group_linear("w", w, GroupQuant(8, args.group), dtype)
                fast = quantize_group_linear("w", w, GroupQuant(4, args.group), dtype, "int4pack")
                slow = quantize_group_linear("w", w, GroupQuant(4, args.group), dtype, "dequantize")
                for n in (int(t) for t in args.tokens.split(",")):
                    x = torch.randn(n, in_f).to(dtype)
                    with torch.inference_mode():
                        base = _median_ms(PlainLinear(plain), x, args.repeat)
                        cells = [_median_ms(layer, x, args.repeat) for layer in (int8, fast, slow)]
                    row = " | ".join(f"{c:.2f} ({c / base:.2f}x)" for c in cells)
                    print(f"| {dname} | {shape} | {n} | {base:.2f} | {row} |", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
