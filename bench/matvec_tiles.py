"""The fused steps' product kernels at each tile shape: which reads the weights fastest.

At one token a matrix-vector product is a read of its weight, so its speed is bytes per second
against the device's copy bandwidth. The tile (output rows x input columns a program loads per
iteration: `kernels.MATVEC_TILES`, one per kernel) sets how many programs share the GPU and
how many bytes each keeps in flight; it is chosen by this sweep on the GPU, not by reasoning.
With `--tokens N` (N > 1) the sweep is of the row-tile kernel of a short prefill or a verify step
(`kernels.rows_matmul`: outputs x inputs of `kernels.ROWS_TILE`, N rows of input), and each
table also times torch's own product of the layer (cuBLAS, `torch._scaled_mm`, or the INT8/INT4
layers' dequantise-and-multiply) on the same rows.
Every format (model dtype, FP8 per channel, INT8 and INT4 group 128) runs on the four products of
a block of the model's shape (qkv, o, gate-up, and down with SiLU(gate) * up as its input), each
tile checked against the first tile's output before it is timed. On CUDA, a captured graph of
back-to-back launches is timed with events (a Python launch costs more than a small product),
cycling through copies of the weight larger together than the L2 (`CYCLE_BYTES`).

    python -m bench.matvec_tiles --device cuda --shape llama-3.1-8b
    python -m bench.matvec_tiles --device cuda --tokens 128 --rows 32,64,128 --cols 64,128

Prints one table per format (GB/s per product and tile, the current tile marked) and the best
tile by total time of the block's four products; `--record` keeps it under docs/runs/.
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from appliance.engine import fused, kernels
from appliance.engine.device import enter_device
from appliance.engine.linear import Linear, PlainLinear, WeightQuant, quantize_linear
from appliance.engine.quantized import GroupQuant, quantize_group_linear
from appliance.engine.random_weights import SHAPES, random_config
from bench import record

# Format label: (weight format, the kernel of `kernels.MATVEC_TILES` that reads it).
FORMATS: dict[str, tuple[WeightQuant | None, kernels.MatvecKernel]] = {
    "bf16": (None, "matvec"),
    "fp8": ("channel", "matvec"),
    "int8": (GroupQuant(8, 128), "int8"),
    "int4": (GroupQuant(4, 128), "int4"),
}
ROWS = (8, 16, 32, 64)
COLS = (256, 512, 1024, 2048)
# The same for the row-tile kernel (`--tokens` > 1): tl.dot takes at least 16 along each side,
# and INT4 splits an input tile into its even and odd halves.
ROW_TILE_OUTS = (16, 32, 64, 128)
ROW_TILE_INS = (32, 64, 128)
# Values a tile holds, at most: compiled for sm_90, tiles of 32,768 values spill (a stack frame
# of 8 to 9,192 bytes in every format but bf16 at 32 x 2048), tiles of 16,384 do not.
MAX_TILE = 16384
# Launches per timed graph (at least), and timed replays (the best is kept).
LAUNCHES = 20
REPLAYS = 5
# On CUDA the timed launches cycle through copies of a weight that together hold at least this
# many bytes, several times an H100's or H200's L2 (50 or 60 MB): each launch reads its weight
# from memory, as each block's product does in a decode step, never from the L2 the launch
# before it filled.
CYCLE_BYTES = 256 << 20


# The key of torch's own product in a sweep's times (not a tile).
TORCH = (0, 0)


@contextmanager
def tile(kernel: kernels.MatvecKernel | None, rows: int, cols: int) -> Iterator[None]:
    """`kernel`'s tile for the body (`kernels.MATVEC_TILES`, read at each launch), or with
    `kernel` None the outputs and inputs of `kernels.ROWS_TILE`."""
    if kernel is None:
        saved_rows = kernels.ROWS_TILE
        kernels.ROWS_TILE = (saved_rows[0], rows, cols)
        try:
            yield
        finally:
            kernels.ROWS_TILE = saved_rows
        return
    saved = kernels.MATVEC_TILES[kernel]
    kernels.MATVEC_TILES[kernel] = (rows, cols)
    try:
        yield
    finally:
        kernels.MATVEC_TILES[kernel] = saved


def current_tile(kernel: kernels.MatvecKernel | None) -> tuple[int, int]:
    """The tile `tile` sets, as it stands."""
    if kernel is None:
        return kernels.ROWS_TILE[1], kernels.ROWS_TILE[2]
    return kernels.MATVEC_TILES[kernel]


def block_products(shape: str) -> list[tuple[str, int, int, bool]]:
    """(name, out, in, gated) of one block's four products at `shape`."""
    c = random_config(shape)
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    hidden, inner = c.hidden_size, c.intermediate_size
    return [
        ("qkv", qkv, hidden, False),
        ("o", hidden, c.num_attention_heads * c.head_dim, False),
        ("gate-up", 2 * inner, hidden, False),
        ("down", hidden, inner, True),
    ]


def seconds_per_call(calls: Sequence[Callable[[], Any]], device: torch.device) -> float:
    """Best time of one call: on CUDA from a graph of at least LAUNCHES back-to-back calls,
    cycling through `calls` (each over its own copy of the weight), timed by events; elsewhere
    (the interpreter, in tests, where a time only fills the table) one call by the clock."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        calls[0]()
        return time.perf_counter() - t0
    for call in calls:
        call()  # compiles the kernel before any capture
    torch.cuda.synchronize(device)
    launches = len(calls) * -(-LAUNCHES // len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            calls[i % len(calls)]()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    best = float("inf")
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000 / launches)
    return best


def make_layer(name: str, weight: torch.Tensor, fmt: WeightQuant | None) -> Linear:
    """`weight` in format `fmt`, INT4 in the layout the Triton kernel reads (a CUDA device's)."""
    if fmt is None:
        return PlainLinear(weight)
    if isinstance(fmt, GroupQuant):
        return quantize_group_linear(name, weight, fmt, weight.dtype, int4_kernel="dequantize")
    return quantize_linear(name, weight, fmt, weight.dtype)


def sweep_format(
    fmt: WeightQuant | None,
    kernel: kernels.MatvecKernel,
    products: list[tuple[str, int, int, bool]],
    tiles: list[tuple[int, int]],
    device: torch.device,
    seed: int = 0,
    tokens: int = 1,
) -> dict[str, tuple[int, dict[tuple[int, int], float]]]:
    """Per product: its weight bytes and the seconds per call at each tile (with `tokens` > 1,
    of `fused.rows_product` on that many rows, and under TORCH the layer's own product);
    AssertionError when a tile's output differs from the first tile's beyond float32 summation
    order."""
    rows_kernel = tokens > 1
    gen = torch.Generator(device=device).manual_seed(seed)
    times: dict[str, tuple[int, dict[tuple[int, int], float]]] = {}
    for name, n_out, n_in, gated in products:
        bound = n_in**-0.5
        weight = (torch.rand(n_out, n_in, generator=gen, device=device) * 2 - 1) * bound
        layer = make_layer(name, weight.to(torch.bfloat16), fmt)
        del weight
        times[name] = (layer.nbytes, {})
        n_copies = -(-CYCLE_BYTES // layer.nbytes) if device.type == "cuda" else 1
        layers = [layer] + [copy.deepcopy(layer) for _ in range(n_copies - 1)]
        width = 2 * n_in if gated else n_in
        x = torch.randn(tokens, width, generator=gen, device=device).to(torch.bfloat16)
        product = fused.rows_product if rows_kernel else fused.matvec
        reference: torch.Tensor | None = None
        for rows, cols in tiles:
            with tile(None if rows_kernel else kernel, rows, cols):
                calls = [functools.partial(product, each, x, gated) for each in layers]
                out = calls[0]().float()
                if reference is None:
                    reference = out
                else:
                    torch.testing.assert_close(out, reference, rtol=1e-2, atol=1e-2)
                times[name][1][(rows, cols)] = seconds_per_call(calls, device)
        if rows_kernel:
            act = kernels.silu_mul(x) if gated else x
            times[name][1][TORCH] = seconds_per_call(
                [functools.partial(each, act) for each in layers], device
            )
        del layer, layers
    return times


def table(
    label: str,
    tiles: list[tuple[int, int]],
    times: dict[str, tuple[int, dict[tuple[int, int], float]]],
    current: tuple[int, int],
) -> tuple[str, tuple[int, int]]:
    """A Markdown table of GB/s (weight bytes / time) per tile and product, and the tile with
    the least total time of the block's products."""
    names = list(times)
    lines = [
        f"{label}: GB/s of weight read",
        "| tile (rows x cols) | " + " | ".join(names) + " | block µs |",
        "|---|" + "---:|" * (len(names) + 1),
    ]
    totals = {}
    with_torch = all(TORCH in times[name][1] for name in names)
    for t in [*tiles, TORCH] if with_torch else tiles:
        cells = []
        total = 0.0
        for name in names:
            nbytes, seconds = times[name][0], times[name][1][t]
            total += seconds
            cells.append(f"{nbytes / seconds / 1e9:,.0f}")
        mark = " (current)" if t == current else ""
        label = "torch's own product" if t == TORCH else f"{t[0]} x {t[1]}{mark}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {total * 1e6:,.1f} |")
        if t != TORCH:
            totals[t] = total
    best = min(totals, key=lambda t: totals[t])
    summary = f"best: {best[0]} x {best[1]}"
    if current in totals:
        summary += (
            f", {totals[best] * 1e6:,.1f} µs a block "
            f"({totals[current] / totals[best]:.2f}x faster than the current tile)"
        )
    if with_torch:
        torch_total = sum(times[name][1][TORCH] for name in names)
        summary += f"; torch's own product / best: {torch_total / totals[best]:.2f}"
    lines.append(summary)
    return "\n".join(lines), best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated")
    parser.add_argument(
        "--rows", help=f"comma-separated; default {ROWS}, with --tokens above 1 {ROW_TILE_OUTS}"
    )
    parser.add_argument(
        "--cols", help=f"comma-separated; default {COLS}, with --tokens above 1 {ROW_TILE_INS}"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=1,
        help="input rows; above 1 the row-tile kernel of prefill and verify is swept",
    )
    record.add_flag(parser)
    args = parser.parse_args(argv)
    names = args.formats.split(",")
    unknown = sorted(set(names) - set(FORMATS))
    if unknown:
        parser.error(f"unknown format(s) {unknown}; known: {', '.join(FORMATS)}")
    if not 1 <= args.tokens <= fused.FUSED_ROWS:
        parser.error(f"--tokens takes 1 to {fused.FUSED_ROWS} (the most rows of a fused step)")
    rows_kernel = args.tokens > 1
    try:
        rows = [int(v) for v in args.rows.split(",")] if args.rows else None
        cols = [int(v) for v in args.cols.split(",")] if args.cols else None
    except ValueError:
        parser.error("--rows and --cols take comma-separated integers")
    rows = rows or list(ROW_TILE_OUTS if rows_kernel else ROWS)
    cols = cols or list(ROW_TILE_INS if rows_kernel else COLS)
    if any(v <= 0 or v & (v - 1) for v in rows + cols):
        parser.error("--rows and --cols take powers of two")
    if rows_kernel and (min(rows) < 16 or min(cols) < 32):
        parser.error("with --tokens above 1, --rows take at least 16 and --cols at least 32")
    try:
        device = enter_device(args.device)
    except (RuntimeError, ValueError) as exc:
        print(f"bench.matvec_tiles: {exc}", file=sys.stderr)
        return 2
    problem = kernels.triton_problem(device)
    if problem is not None:
        print(f"bench.matvec_tiles: {problem}", file=sys.stderr)
        return 2
    products = block_products(args.shape)
    tiles = [t for t in itertools.product(rows, cols) if t[0] * t[1] <= MAX_TILE]
    if not tiles:
        parser.error(f"no tile of --rows x --cols holds at most {MAX_TILE} values")
    with record.recording(
        "matvec_tiles", record.record_dir(args), None if argv is None else list(argv)
    ) as run:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        print(
            f"{args.shape} block products on {name}; {len(tiles)} tiles; {args.tokens} tokens",
            flush=True,
        )
        for label in names:
            fmt, kernel = FORMATS[label]
            current = current_tile(None if args.tokens > 1 else kernel)
            times = sweep_format(fmt, kernel, products, tiles, device, tokens=args.tokens)
            text, best = table(label, tiles, times, current)
            print(text + "\n", flush=True)
            run.results[label] = {"best": list(best), "current": list(current)}
            run.checkpoint()  # a device call's timeout keeps the formats swept so far
    return 0


if __name__ == "__main__":
    sys.exit(main())
