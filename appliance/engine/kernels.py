"""Typed launches of the fused decode and prefill steps' Triton kernels (`triton_kernels`), and
when they apply.

Each function takes and returns torch tensors and does what a few eager torch calls of
`LlamaModel` do, in one launch (two for decode attention): RMSNorm with the residual add before
it (or the embedding lookup), RoPE on q and k with the KV-cache write, SiLU(gate) * up,
matrix-vector products (one token) and tiled products (a few token rows) of dense (model dtype)
and weight-only FP8, INT8 and INT4 weights (each can take SiLU(gate) * up as its input),
attention of one query over the live cache positions split across programs, and causal
attention of a few query rows. A one-token product also takes the folded decode step's extra work
(`token_product`, `token_product_add`): its input normed as it loads, the residual add after it,
or RoPE with the KV write. The eager torch step stays the reference they are tested against.

Triton is imported only when a kernel is first launched, so hosts without it (CPU hosts) never
import it. The kernels run on CUDA devices; under TRITON_INTERPRET=1 they also run on the CPU (the
tests), much slower.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch

__all__ = [
    "KernelChoice",
    "MatvecKernel",
    "Norm",
    "PdlMode",
    "Residual",
    "Rope",
    "TokenWeight",
    "build_problem",
    "decode_attention",
    "embed_rms_norm",
    "int4_matvec",
    "int4_rows_matmul",
    "int8_matvec",
    "int8_rows_matmul",
    "interpreting",
    "matvec",
    "model_problem",
    "prefill_attention",
    "resolve_kernels",
    "rms_norm",
    "rope_kv_write",
    "rows_matmul",
    "silu_mul",
    "token_product",
    "token_product_add",
    "triton_problem",
]

KernelChoice = Literal["auto", "triton", "torch"]
# Programs per KV head that attention splits the span across (flash-decoding), at most.
ATTENTION_SPLITS = 16
# Cache positions one attention program loads at a time.
ATTENTION_BLOCK = 64
# Output rows x input columns of one matrix-vector tile, per kernel: "matvec" (model dtype and
# FP8), "int8" and "int4" (a tile holds whole groups, so it is at least one group wide). Each is
# the fastest tile of `bench.matvec_tiles` on an H100 (docs/runs/2026-11-26-h100-matvec_tiles.md);
# at one token a product is a read of its weight, and the tile sets the bytes each program keeps
# in flight.
MatvecKernel = Literal["matvec", "int8", "int4"]
MATVEC_TILES: dict[MatvecKernel, tuple[int, int]] = {
    "matvec": (8, 2048),
    "int8": (8, 1024),
    "int4": (16, 1024),
}
# Rows (at most) x outputs x inputs of one `rows_matmul` tile: a tile's rows share each weight
# load, so a prefill of up to 64 rows reads its weight once; the group formats narrow the inputs
# to one group. Not yet swept on a GPU.
ROWS_TILE = (64, 64, 64)
# Query rows of one `prefill_attention` program (tl.dot takes at least 16).
PREFILL_ATTENTION_ROWS = 16
# Programmatic dependent launch (compute capability 9.0 on) for the decode step's kernels: each
# starts while the one before it ends and waits on the device for its results, so a launch's
# latency overlaps the kernel before it. "early-read": the products also read their first weight
# tile before they wait (more registers a thread: bf16 152-192 instead of 48-71 on sm_90, as
# `python -m bench.kernel_resources` reports them).
# Off until a GPU run has measured it; the interpreter never takes it.
PdlMode = Literal["off", "wait", "early-read"]
PDL: PdlMode = "off"
# The kernels' PDL constexpr for each mode: triton_kernels.WAIT and EARLY_READ, not imported
# here because triton is imported only when a kernel first launches.
_PDL_CONSTEXPR: dict[PdlMode, int] = {"off": 0, "wait": 1, "early-read": 2}


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` (None: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed; use --kernels torch"
    if device.type != "cuda" and not interpreting():
        return "Triton kernels need a CUDA device; use --kernels torch"
    if device.type == "cuda":
        return build_problem()
    return None


def build_problem() -> str | None:
    """Why Triton could not build its launchers here (None: it can). On an NVIDIA GPU Triton
    compiles a small C module per kernel signature at its first launch: it needs a C compiler
    (CC, else gcc or clang on the PATH) and Python's headers."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return (
            "Triton builds its kernel launchers with a C compiler and found none (CC, gcc, "
            "clang): install gcc, or use --kernels torch"
        )
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        return (
            f"Triton builds its kernel launchers against Python's headers and {headers} is "
            "missing: install python3-dev, or use --kernels torch"
        )
    return None


def model_problem(head_dim: int) -> str | None:
    """Why the kernels cannot run a model whose heads are `head_dim` wide (None: they can): a
    head is one power-of-two tile, and a GPU's tl.dot takes at least 16 values per product."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim}: the Triton kernels take a power of two of at least 16"
    return None


def resolve_kernels(choice: KernelChoice, device: torch.device) -> Literal["triton", "torch"]:
    """`auto` is triton on a CUDA device where triton imports, torch elsewhere."""
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_problem(device) is None else "torch"
    return choice


def _pdl() -> dict[str, int | bool]:
    """The PDL constexpr of a kernel that takes it, and Triton's launch option with it."""
    if PDL != "off" and not interpreting():
        return {"PDL": _PDL_CONSTEXPR[PDL], "launch_pdl": True}
    return {"PDL": 0}


def _tk() -> ModuleType:
    from appliance.engine import triton_kernels

    return triton_kernels


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s) * weight, s) for rows x (n, hidden), where s = x + residual (or x)."""
    x = x.contiguous()
    n, hidden = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    res = residual.contiguous() if residual is not None else x
    _tk().rms_norm_kernel[(n,)](
        x,
        res,
        weight,
        out,
        total,
        hidden,
        eps,
        x,  # no gather
        HAS_RES=residual is not None,
        GATHER=False,
        BLOCK=_pow2(hidden),
        **_pdl(),
    )
    return out, total


def embed_rms_norm(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(e) * weight, e) for the rows e = table[ids] (ids a (n,) long tensor on the
    device): an embedding lookup and the first norm in one launch. Ids are not checked here: the
    caller has bounded them by the table's rows."""
    n, hidden = ids.shape[0], table.shape[1]
    out = torch.empty(n, hidden, dtype=table.dtype, device=table.device)
    rows = torch.empty_like(out)
    _tk().rms_norm_kernel[(n,)](
        table,
        table,  # no residual
        weight,
        out,
        rows,
        hidden,
        eps,
        ids,
        HAS_RES=False,
        GATHER=True,
        BLOCK=_pow2(hidden),
        **_pdl(),
    )
    return out, rows


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """Rotated q (rows, heads, head_dim) of fused qkv rows (rows, (heads + 2 kv) * head_dim) of
    tokens at positions pos, pos + 1, ... (`pos` a (1,) long tensor on the device); their rotated
    k and their v are written into the layer's cache (kv_heads, max_seq_len, head_dim) there."""
    kv_heads, _, head_dim = k_cache.shape
    rows = qkv.shape[0]
    q = torch.empty(rows, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _tk().rope_kv_write_kernel[(heads + 2 * kv_heads, rows)](
        qkv.contiguous(),
        cos,
        sin,
        pos,
        q,
        k_cache,
        v_cache,
        k_cache.stride(0),
        HEADS=heads,
        KV_HEADS=kv_heads,
        D=head_dim,
        **_pdl(),
    )
    return q


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """SiLU(gate) * up for rows (n, 2 * inner) holding gate then up; returns (n, inner)."""
    gate_up = gate_up.contiguous()
    n, two_inner = gate_up.shape
    inner = two_inner // 2
    out = torch.empty(n, inner, dtype=gate_up.dtype, device=gate_up.device)
    block = min(block, _pow2(inner))
    _tk().silu_mul_kernel[(n, -(-inner // block))](gate_up, out, inner, BLOCK=block)
    return out


def matvec(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """(x @ W.T) * scale for one token x (1, in) and a weight (out, in) in a float dtype (the
    model's, or E4M3 with float32 scales (out, 1) per output row or () per tensor), widened in
    registers (FP8: W8A16). `out` (1, out), contiguous, receives the result rounded to x's dtype
    and stored in its own (float32 logits hold the model-dtype values the eager output head
    gives); default: a new tensor in x's dtype. `gated`: x is (1, 2 * in), gate then up, and the
    product takes SiLU(gate) * up (`silu_mul`) without a launch of its own."""
    return token_product(x, TokenWeight.dense(weight, scale), gated=gated, out=out)


@dataclass(frozen=True, slots=True)
class TokenWeight:
    """A weight as the one-token product kernels take it: `kind` names the kernel ("matvec":
    the model dtype or E4M3 with `scales` per output row or per tensor, or none; "int8": q with
    model-dtype `scales` per group; "int4": the packed nibbles with scales and zero points per
    group, `int4_matvec`'s layout) and `group` its inputs per group (0: none)."""

    kind: MatvecKernel
    weight: torch.Tensor
    scales: torch.Tensor | None
    n_out: int
    n_in: int
    group: int = 0

    @staticmethod
    def dense(weight: torch.Tensor, scale: torch.Tensor | None = None) -> TokenWeight:
        return TokenWeight("matvec", weight, scale, weight.shape[0], weight.shape[1])

    @staticmethod
    def int8(weight: torch.Tensor, scale: torch.Tensor) -> TokenWeight:
        n_out, n_in = weight.shape
        return TokenWeight("int8", weight, scale, n_out, n_in, n_in // scale.shape[1])

    @staticmethod
    def int4(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> TokenWeight:
        n_out, n_in = packed.shape[0], 2 * packed.shape[1]
        return TokenWeight("int4", packed, scales_and_zeros, n_out, n_in, group)

    def tiles(self) -> int:
        """Programs of one token's product: one per tile of output rows."""
        return -(-self.n_out // MATVEC_TILES[self.kind][0])


@dataclass(frozen=True, slots=True)
class Residual:
    """A token's residual-stream row (1, hidden) as a product's residual add wrote it, with the
    float32 sums of its squares by that product's output tile: the statistic of the RMSNorm that
    follows, so the norm runs inside the next product (`Norm`), not in a launch of its own."""

    values: torch.Tensor
    squares: torch.Tensor


@dataclass(frozen=True, slots=True)
class Norm:
    """A product's input RMSNorm(residual) * weight, normed as the product loads it."""

    residual: Residual
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True, slots=True)
class Rope:
    """`rope_kv_write` as the epilogue of the fused qkv product of one token at `pos` (a (1,)
    long tensor on the device): q rotated into the product's output, k rotated and v copied
    into the layer's cache (kv_heads, max_seq_len, head_dim)."""

    cos: torch.Tensor
    sin: torch.Tensor
    pos: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    heads: int


def token_product(
    x: torch.Tensor | Norm,
    weight: TokenWeight,
    *,
    gated: bool = False,
    out: torch.Tensor | None = None,
    rope: Rope | None = None,
) -> torch.Tensor:
    """x @ W.T for one token: x a row (1, in), or `Norm` of a residual row; `gated` as in
    `matvec`; `out` as in `matvec`. With `rope`: W is the fused qkv projection, and the result
    is q (1, heads, head_dim), rotated, with k and v written into the cache."""
    if rope is not None:
        if out is not None:
            raise ValueError("a product with RoPE writes q into a tensor of its own: give no out")
        _check_rope(rope, weight)
        _, _, head_dim = rope.k_cache.shape
        row = x.residual.values if isinstance(x, Norm) else x
        out = torch.empty(1, rope.heads, head_dim, dtype=row.dtype, device=row.device)
    return _launch(x, weight, gated, out, None, rope)


def _check_rope(rope: Rope, weight: TokenWeight) -> None:
    """ValueError unless `rope` fits the qkv weight and the layout the epilogue writes."""
    kv_heads, _, head_dim = rope.k_cache.shape
    if weight.n_out != (rope.heads + 2 * kv_heads) * head_dim:
        raise ValueError(
            f"a qkv weight of {weight.n_out} outputs for {rope.heads} heads and "
            f"{kv_heads} KV heads of {head_dim}"
        )
    if rope.cos.shape[-1] != head_dim or rope.sin.shape != rope.cos.shape:
        raise ValueError(f"RoPE tables of {tuple(rope.cos.shape)} for heads of {head_dim}")
    k, v = rope.k_cache, rope.v_cache
    if v.shape != k.shape or v.stride() != k.stride() or k.stride()[1:] != (head_dim, 1):
        raise ValueError("the K and V caches need one layout, each head's positions contiguous")


def token_product_add(
    x: torch.Tensor | Norm,
    weight: TokenWeight,
    add_to: torch.Tensor | Residual,
    *,
    gated: bool = False,
) -> Residual:
    """The residual stream after a product: add_to + x @ W.T (rounded to the dtype, as the eager
    add), with its squares summed by tile for the next `Norm`."""
    base = add_to.values if isinstance(add_to, Residual) else add_to
    if base.shape != (1, weight.n_out):
        raise ValueError(f"a residual row of shape {tuple(base.shape)} for {weight.n_out} outputs")
    row = x.residual.values if isinstance(x, Norm) else x
    if base.dtype != row.dtype:
        raise ValueError(f"a residual row in {base.dtype} for a product in {row.dtype}")
    squares = torch.empty(weight.tiles(), dtype=torch.float32, device=base.device)
    return Residual(_launch(x, weight, gated, None, (base.contiguous(), squares), None), squares)


def _check_norm(norm: Norm, n_in: int, gated: bool) -> None:
    """ValueError unless `norm` can be a product's input of `n_in` values."""
    if gated:
        raise ValueError("a normed input is not gate and up: a gated product takes a plain row")
    if norm.weight.shape != (n_in,):
        raise ValueError(f"a norm weight of shape {tuple(norm.weight.shape)} for {n_in} inputs")
    squares = norm.residual.squares
    if squares.dim() != 1 or squares.dtype != torch.float32 or squares.device != norm.weight.device:
        raise ValueError("a residual's squares are float32 sums by tile on its device")


def _launch(
    x: torch.Tensor | Norm,
    weight: TokenWeight,
    gated: bool,
    out: torch.Tensor | None,
    add: tuple[torch.Tensor, torch.Tensor] | None,
    rope: Rope | None,
) -> torch.Tensor:
    """Launches `weight`'s one-token kernel with its folds: the input normed (`Norm`), the
    residual add (`add`: the row added to, the squares' buffer) or RoPE (`rope`; `out` is q).
    Returns the output: `out`, else a new row in the input's dtype."""
    norm, row = (x, x.residual.values) if isinstance(x, Norm) else (None, x)
    row = row.contiguous()
    _check_width(row, weight.n_in, gated)
    if norm is not None:
        _check_norm(norm, weight.n_in, gated)
    if weight.group and weight.n_in % weight.group:
        raise ValueError(f"{weight.n_in} inputs do not split into groups of {weight.group}")
    tokens = row.shape[0]
    if tokens != 1 and (weight.kind == "matvec" or norm or add or rope):
        raise ValueError(f"{tokens} token rows: this product takes one")
    if rope is None:
        out = _output(out, row, tokens, weight.n_out)
    assert out is not None
    rows, cols = MATVEC_TILES[weight.kind]
    tk = _tk()
    # The folds' arguments (`matvec_kernel`'s, after n_in): the norm's weight, squares, their
    # count, the row's width and eps; the row added to and the squares written; RoPE's tables,
    # position and cache.
    n_sq = norm.residual.squares.shape[0] if norm is not None else 0
    norm_args = (
        (norm.weight, norm.residual.squares, n_sq, float(weight.n_in), norm.eps)
        if norm is not None
        else (row, row, 0, 1.0, 0.0)
    )
    add_args = add if add is not None else (row, row)
    rope_args: tuple[object, ...] = (row, row, row, row, row, 0)
    consts: dict[str, object] = {
        "NORM": norm is not None, "RESIDUAL": add is not None, "ROPE": rope is not None,
        "HEADS": 1, "KV_HEADS": 1, "D": 2, "SQ_BLOCK": _pow2(n_sq),
    }  # fmt: skip
    if rope is not None:
        kv_heads, _, head_dim = rope.k_cache.shape
        rows = min(rows, head_dim)  # a tile holds pairs of one head's rows
        rope_args = (rope.cos, rope.sin, rope.pos, rope.k_cache, rope.v_cache)
        rope_args += (rope.k_cache.stride(0),)
        consts |= {"HEADS": rope.heads, "KV_HEADS": kv_heads, "D": head_dim}
    folds = (*norm_args, *add_args, *rope_args)
    scales = weight.scales if weight.scales is not None else weight.weight  # not read without
    grid: tuple[int, ...]
    if weight.kind == "matvec":  # one token: the grid has no token axis
        kernel, grid = tk.matvec_kernel, (-(-weight.n_out // rows),)
        scale = 0 if weight.scales is None else 2 if weight.scales.dim() > 0 else 1
        consts |= {"SCALE": scale, "BLOCK_K": min(cols, _pow2(weight.n_in))}
    else:
        kernel = getattr(tk, f"{weight.kind}_matvec_kernel")
        grid = (-(-weight.n_out // rows), tokens)
        block_k = max(weight.group, min(cols, _pow2(weight.n_in)))
        consts |= {"GROUP": weight.group, "BLOCK_K": block_k}
    kernel[grid](
        row,
        weight.weight,
        scales,
        out,
        weight.n_out,
        weight.n_in,
        *folds,
        GATED=gated,
        BLOCK_N=rows,
        **consts,
        **_pdl(),
    )
    return out


def _output(out: torch.Tensor | None, x: torch.Tensor, rows: int, n_out: int) -> torch.Tensor:
    """`out` when it is a contiguous (rows, n_out), else ValueError; None: a new one in x's
    dtype."""
    if out is None:
        return torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    if out.shape != (rows, n_out) or not out.is_contiguous():
        raise ValueError(f"out of shape {tuple(out.shape)}: needs a contiguous ({rows}, {n_out})")
    return out


def _check_width(x: torch.Tensor, n_in: int, gated: bool) -> None:
    """ValueError unless x's rows hold the weight's `n_in` inputs (gate and up: twice that)."""
    width = 2 * n_in if gated else n_in
    if x.dim() != 2 or x.shape[1] != width:
        what = f"gate and up rows of {width}" if gated else f"rows of {width}"
        raise ValueError(
            f"input of shape {tuple(x.shape)} for a weight of {n_in} inputs: needs {what}"
        )


def int8_matvec(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, gated: bool = False
) -> torch.Tensor:
    """x @ W.T for a few tokens x (tokens, in) and an INT8 weight (out, in) with model-dtype
    scales (out, in / group) per group (W = q * scale, `Int8Linear`'s layout), dequantised in
    registers; the result is in x's dtype; `gated` as in `matvec`. Each token reads the weight
    again: meant for one token."""
    return token_product(x, TokenWeight.int8(weight, scale), gated=gated)


def int4_matvec(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    gated: bool = False,
) -> torch.Tensor:
    """x @ W.T for a few tokens x (tokens, in) and an INT4 weight in `Int4Linear`'s "dequantize"
    layout: uint8 (out, in / 2), input 2j in byte j's high nibble and 2j + 1 in its low one, and
    (in / group, out, 2) model-dtype scales and zero points (W = (q - 8) * scale + zero),
    dequantised in registers; the result is in x's dtype; `gated` as in `matvec`. Meant for one
    token, as `int8_matvec`."""
    return token_product(x, TokenWeight.int4(packed, scales_and_zeros, group_size), gated=gated)


def _dot_settings(dtype: torch.dtype) -> dict[str, object]:
    """`_dot`'s constexprs for operands of `dtype`: float32 products exact ("ieee", not TF32);
    bfloat16 on tensor cores, except under the interpreter, which multiplies bfloat16 dot
    operands as their raw bits (WIDEN)."""
    return {
        "PRECISION": "ieee" if dtype == torch.float32 or interpreting() else "tf32",
        "WIDEN": interpreting() and dtype != torch.float32,
    }


def _rows_matmul(
    fmt: Literal[0, 1, 2],
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    n_out: int,
    n_in: int,
    group_size: int,
    gated: bool,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Launches `rows_matmul_kernel` (format `fmt`) over tiles of `ROWS_TILE`; see `rows_matmul`."""
    _check_width(x, n_in, gated)
    x = x.contiguous()
    n_rows = x.shape[0]
    out = _output(out, x, n_rows, n_out)
    max_m, block_n, block_k = ROWS_TILE
    block_m = min(max_m, max(16, _pow2(n_rows)))
    if fmt:
        if n_in % group_size:
            raise ValueError(f"{n_in} inputs do not split into groups of {group_size}")
        block_k = min(block_k, group_size)  # a K tile within one group
    else:
        block_k = min(block_k, max(16, _pow2(n_in)))
    _tk().rows_matmul_kernel[(-(-n_out // block_n), -(-n_rows // block_m))](
        x,
        weight,
        scale if scale is not None else weight,  # not read without a scale
        out,
        n_rows,
        n_out,
        n_in,
        FORMAT=fmt,
        SCALE=0 if fmt or scale is None else 2 if scale.dim() > 0 else 1,
        GROUP=group_size,
        GATED=gated,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **_dot_settings(x.dtype),
    )
    return out


def rows_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """`matvec` for a few token rows x (rows, in): (x @ W.T) * scale with the weight (out, in) in
    the model dtype or E4M3 (float32 scales (out, 1) or ()) widened to x's dtype in registers
    and multiplied on tensor cores; `out` (rows, out) or a new tensor in x's dtype; `gated` as
    in `matvec`. Meant for a short prefill or a verify step, where the weight's bytes, not the
    arithmetic, set the time."""
    n_out, n_in = weight.shape
    return _rows_matmul(0, x, weight, scale, n_out, n_in, 1, gated, out)


def int8_rows_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, gated: bool = False
) -> torch.Tensor:
    """`int8_matvec` for a few token rows, each dequantised weight rounded to x's dtype as
    `Int8Linear` rounds it; the rows share one read of the weight (`rows_matmul`)."""
    n_out, n_in = weight.shape
    group = n_in // scale.shape[1]
    return _rows_matmul(1, x, weight, scale, n_out, n_in, group, gated, None)


def int4_rows_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    gated: bool = False,
) -> torch.Tensor:
    """`int4_matvec` for a few token rows, dequantised with `Int4Linear`'s rounding; the rows
    share one read of the weight (`rows_matmul`)."""
    n_out, n_in = packed.shape[0], 2 * packed.shape[1]
    return _rows_matmul(2, x, packed, scales_and_zeros, n_out, n_in, group_size, gated, None)


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """Causal attention output (rows, heads, head_dim) of query rows q (rows, heads, head_dim) at
    positions start, start + 1, ... (`start` a (1,) long tensor on the device) over the layer's
    cache (kv_heads, max_seq_len, head_dim), which holds their K/V and everything before them.

    The launch grid depends on the row count only, so the same launch serves every start (a CUDA
    graph replays it); positions after a row's own are never loaded.
    """
    rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    out = torch.empty_like(q)
    _tk().prefill_attention_kernel[(heads, -(-rows // PREFILL_ATTENTION_ROWS))](
        q.contiguous(),
        k_cache,
        v_cache,
        start,
        out,
        rows,
        k_cache.stride(0),
        head_dim**-0.5,
        HEADS=heads,
        GROUP=heads // kv_heads,
        D=head_dim,
        BLOCK_M=PREFILL_ATTENTION_ROWS,
        BLOCK=ATTENTION_BLOCK,
        **_dot_settings(q.dtype),
    )
    return out


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, span: int
) -> torch.Tensor:
    """Attention output (heads, head_dim) of one query (heads, head_dim) at position `pos` over
    the layer's cache positions 0..pos (of (kv_heads, max_seq_len, head_dim)).

    `span` (> pos) fixes the launch grid, so the same launch serves every position below it (a
    CUDA graph replays it); positions after `pos` are never loaded.
    """
    heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    split = max(ATTENTION_BLOCK, -(-span // ATTENTION_SPLITS))
    n_splits = -(-span // split)
    acc = torch.empty(heads, n_splits, head_dim, dtype=torch.float32, device=q.device)
    best = torch.empty(heads, n_splits, dtype=torch.float32, device=q.device)
    total = torch.empty(heads, n_splits, dtype=torch.float32, device=q.device)
    tk = _tk()
    tk.decode_attention_split_kernel[(kv_heads, n_splits)](
        q.contiguous(),
        k_cache,
        v_cache,
        pos,
        acc,
        best,
        total,
        k_cache.stride(0),
        head_dim**-0.5,
        N_SPLITS=n_splits,
        SPLIT=split,
        GROUP=group,
        ROWS=max(16, _pow2(group)),
        D=head_dim,
        BLOCK=ATTENTION_BLOCK,
        **_dot_settings(q.dtype),
        **_pdl(),
    )
    out = torch.empty_like(q)
    tk.decode_attention_combine_kernel[(heads,)](
        acc,
        best,
        total,
        out,
        N_SPLITS=n_splits,
        SPLITS_P2=_pow2(n_splits),
        D=head_dim,
        **_pdl(),
    )
    return out
