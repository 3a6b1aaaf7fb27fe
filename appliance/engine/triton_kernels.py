"""The Triton kernels of the fused decode and prefill steps; typed wrappers that launch them are
in `kernels`.

Each kernel rounds where the eager torch step rounds (a sum stored in the model dtype is rounded to
it before it is read again), and accumulates in float32, so its output stays within a few units
in the last place of the torch reference's.

Importing this module compiles nothing: `triton.jit` only records each function. Under
TRITON_INTERPRET=1 (read when this module is imported) the kernels run on the CPU through Triton's
interpreter, which is how the CPU test suite checks them against the torch reference.
"""

# The kernels' parameters are Triton types (pointers, constexprs): mypy does not check this module.
# mypy: ignore-errors

from __future__ import annotations

import triton
import triton.language as tl

# A kernel's PDL constexpr: 0, launched as usual; WAIT, launched early (programmatic dependent
# launch, Hopper on) and waiting first; EARLY_READ, the products also read their first weight
# tile before they wait (the others wait first).
WAIT = tl.constexpr(1)
EARLY_READ = tl.constexpr(2)


@triton.jit
def _enter(PDL: tl.constexpr):
    """A kernel's first step when launched early (PDL not 0): wait until the kernel launched
    before it has finished and its writes are visible (it may still be running when this one
    starts), then let the kernel after this one launch, so that its programs are resident and
    waiting when this one ends instead of launched after it. Every kernel so launched calls this
    before it reads or writes memory another kernel writes or reads."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_cols,
    eps,
    idx_ptr,
    HAS_RES: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row: s = x (+ res), rounded to the dtype and stored in sum_ptr when HAS_RES;
    out = w * (s * rsqrt(mean(s^2) + eps)) with the normalised value rounded before the product.
    GATHER: output row r reads row idx[r] of x (an embedding table) and stores it in sum_ptr."""
    _enter(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    live = cols < n_cols
    src = tl.load(idx_ptr + row).to(tl.int64) if GATHER else row
    x = tl.load(x_ptr + src * n_cols + cols, mask=live, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * n_cols + cols, mask=live, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    if HAS_RES or GATHER:
        tl.store(sum_ptr + row * n_cols + cols, x, mask=live)
    s = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / n_cols + eps)
    y = (s * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * y).to(x.dtype), mask=live)


@triton.jit
def rope_kv_write_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cache_head_stride,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    PDL: tl.constexpr,
):
    """One head (program_id(0)) of token row r = program_id(1) of fused qkv rows (q heads, then
    k heads, then v heads), at position pos + r, pos read from pos_ptr.

    A q head is rotated into row r of q_out (rows, HEADS, D); a k head is rotated and a v head
    copied into the layer's cache (KV_HEADS, max_seq_len, D) at the row's position. RoPE follows
    the rotate-half convention: the two halves of a head are the real and imaginary parts.
    """
    _enter(PDL)
    head = tl.program_id(0)
    row = tl.program_id(1)
    half = tl.arange(0, D // 2)
    pos = tl.load(pos_ptr) + row
    base = qkv_ptr + (row * (HEADS + 2 * KV_HEADS) + head) * D
    x1 = tl.load(base + half)
    x2 = tl.load(base + D // 2 + half)
    if head < HEADS + KV_HEADS:
        cos = tl.load(cos_ptr + pos * D + half).to(tl.float32)
        sin = tl.load(sin_ptr + pos * D + half).to(tl.float32)
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        y1 = (a * cos - b * sin).to(x1.dtype)
        y2 = (b * cos + a * sin).to(x1.dtype)
        if head < HEADS:
            q_row = q_out_ptr + (row * HEADS + head) * D
            tl.store(q_row + half, y1)
            tl.store(q_row + D // 2 + half, y2)
        else:
            dst = k_cache_ptr + (head - HEADS) * cache_head_stride + pos * D
            tl.store(dst + half, y1)
            tl.store(dst + D // 2 + half, y2)
    else:
        dst = v_cache_ptr + (head - HEADS - KV_HEADS) * cache_head_stride + pos * D
        tl.store(dst + half, x1)
        tl.store(dst + D // 2 + half, x2)


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, n_inner, BLOCK: tl.constexpr):
    """out[row] = silu(gate) * up, where a row of gate_up is gate then up (n_inner each)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < n_inner
    g = tl.load(gate_up_ptr + row * 2 * n_inner + cols, mask=live, other=0.0)
    u = tl.load(gate_up_ptr + row * 2 * n_inner + n_inner + cols, mask=live, other=0.0)
    g32 = g.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)
    out = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    tl.store(out_ptr + row * n_inner + cols, out, mask=live)


@triton.jit
def _input(x_ptr, offs, mask, n_in, GATED: tl.constexpr):
    """The float32 inputs of a matrix-vector product at `offs` of a row at x_ptr: the row's own
    values, or SiLU(gate) * up of a row holding gate then up (n_in each) when GATED, rounded to
    the dtype where `silu_mul_kernel` rounds, so a gated product equals the two launches'."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if GATED:
        u = tl.load(x_ptr + n_in + offs, mask=mask, other=0.0)
        g32 = x.to(tl.float32)
        act = (g32 / (1.0 + tl.exp(-g32))).to(x.dtype)
        x = (act.to(tl.float32) * u.to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _norm_scale(sq_ptr, n_sq, width, eps, NORM: tl.constexpr, SQ_BLOCK: tl.constexpr):
    """1 / RMS of a residual row of `width` values (a float: no conversion on the device) from
    the float32 sums of its squares by the tile of the product that wrote it (`_store_sum`);
    1.0 without NORM."""
    inv = 1.0
    if NORM:
        i = tl.arange(0, SQ_BLOCK)
        total = tl.sum(tl.load(sq_ptr + i, mask=i < n_sq, other=0.0), axis=0)
        inv = tl.rsqrt(total / width + eps)
    return inv


@triton.jit
def _normed_input(x_ptr, offs, mask, g_ptr, inv):
    """The float32 inputs at `offs` of RMSNorm(x) * g for a residual row x whose 1 / RMS is
    `inv`, rounded to the dtype where `rms_norm_kernel` rounds, so a product of it equals the
    norm's launch followed by the product's."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return (g * y).to(x.dtype).to(tl.float32)


@triton.jit
def _product_input(x_ptr, offs, mask, n_in, g_ptr, inv, GATED: tl.constexpr, NORM: tl.constexpr):
    """A one-token product's float32 inputs at `offs`: RMSNorm(x) * g (NORM), SiLU(gate) * up
    (GATED) or x itself."""
    if NORM:
        x = _normed_input(x_ptr, offs, mask, g_ptr, inv)
    else:
        x = _input(x_ptr, offs, mask, n_in, GATED)
    return x


@triton.jit
def _tile_rows(pid, BLOCK_N: tl.constexpr, ROPE: tl.constexpr, D: tl.constexpr):
    """The output rows of product tile `pid`: BLOCK_N consecutive rows, or with ROPE pairs of a
    head's rows i and i + D / 2 side by side (BLOCK_N / 2 pairs; BLOCK_N divides D), so that the
    epilogue rotates them (`_store_rope`)."""
    j = tl.arange(0, BLOCK_N)
    if ROPE:
        TILES: tl.constexpr = D // BLOCK_N
        rows = (pid // TILES) * D + (pid % TILES) * (BLOCK_N // 2) + j // 2 + (j % 2) * (D // 2)
    else:
        rows = pid * BLOCK_N + j
    return rows


@triton.jit
def _store_sum(out, rows, row_live, out_ptr, res_ptr, sq_ptr, pid):
    """The residual add after a product: s = res + out, rounded to the dtype as the eager add is,
    stored at `rows` of out_ptr, and the float32 sum of s^2 over the tile at sq_ptr[pid], which
    the next product's norm reads (`_norm_scale`)."""
    r = tl.load(res_ptr + rows, mask=row_live, other=0.0)
    s = (out.to(tl.float32) + r.to(tl.float32)).to(out.dtype)
    tl.store(out_ptr + rows, s, mask=row_live)
    s32 = s.to(tl.float32)
    tl.store(sq_ptr + pid, tl.sum(s32 * s32, axis=0))


@triton.jit
def _store_rope(
    out,
    pid,
    q_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cache_head_stride,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """`rope_kv_write_kernel` for the rows of qkv product tile `pid` (`_tile_rows` with ROPE):
    a q head's pairs rotated into q_ptr (HEADS, D), a k head's rotated and a v head's copied
    into the layer's cache at the token's position."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    TILES: tl.constexpr = D // BLOCK_N
    head = pid // TILES
    at = (pid % TILES) * PAIRS + tl.arange(0, PAIRS)
    x1, x2 = tl.split(tl.reshape(out, (PAIRS, 2)))
    pos = tl.load(pos_ptr)
    if head < HEADS + KV_HEADS:
        cos = tl.load(cos_ptr + pos * D + at).to(tl.float32)
        sin = tl.load(sin_ptr + pos * D + at).to(tl.float32)
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        y1 = (a * cos - b * sin).to(x1.dtype)
        y2 = (b * cos + a * sin).to(x1.dtype)
        if head < HEADS:
            dst = q_ptr + head * D
        else:
            dst = k_cache_ptr + (head - HEADS) * cache_head_stride + pos * D
        tl.store(dst + at, y1)
        tl.store(dst + D // 2 + at, y2)
    else:
        dst = v_cache_ptr + (head - HEADS - KV_HEADS) * cache_head_stride + pos * D
        tl.store(dst + at, x1)
        tl.store(dst + D // 2 + at, x2)


@triton.jit
def _store_product(
    out,
    rows,
    row_live,
    pid,
    out_ptr,
    res_ptr,
    sq_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cache_head_stride,
    RESIDUAL: tl.constexpr,
    ROPE: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A one-token product's epilogue for its rows' values `out` (rounded to the model dtype):
    RoPE with the KV write (ROPE), the residual add (RESIDUAL), or a store in out's dtype."""
    if ROPE:
        _store_rope(
            out,
            pid,
            out_ptr,
            cos_ptr,
            sin_ptr,
            pos_ptr,
            k_cache_ptr,
            v_cache_ptr,
            cache_head_stride,
            HEADS,
            KV_HEADS,
            D,
            BLOCK_N,
        )
    elif RESIDUAL:
        _store_sum(out, rows, row_live, out_ptr, res_ptr, sq_out_ptr, pid)
    else:
        tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_live)


@triton.jit
def _int4_minus_8(v):
    """v - 8 as float32 for int32 values v in [0, 15], with no int-to-float conversion (a GPU
    converts 16 values a clock per SM, a quarter of its integer rate and an eighth of its FMA
    rate): v OR'd into the mantissa of 2^23 is the float 2^23 + v exactly, and 2^23 + v minus
    2^23 + 8 is exact."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _int8_value(q):
    """An int8 tensor's values as float32 with no int-to-float conversion: q + 128 is in
    [0, 255], so 2^23 + 128 + q is a float whose bits are those of 2^23 plus that integer."""
    return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _dense_weights(w_rows, k0, n_in, row_live, BLOCK_K: tl.constexpr):
    """`matvec_kernel`'s weight tile at input k0: its rows' BLOCK_K inputs from k0. With the
    `_dense_partial` of it, the kernel loop's body with the weights read first (the loop itself
    reads the inputs first: 48 registers a thread instead of 64 for bf16 on sm_90)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    live = row_live[:, None] & (cols < n_in)[None, :]
    return tl.load(w_rows + cols[None, :], mask=live, other=0.0)


@triton.jit
def _dense_partial(
    w, x_ptr, k0, n_in, g_ptr, inv, GATED: tl.constexpr, NORM: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The tile's rows' float32 sums of weight tile w times the inputs from k0."""
    cols = k0 + tl.arange(0, BLOCK_K)
    x = _product_input(x_ptr, cols, cols < n_in, n_in, g_ptr, inv, GATED, NORM)
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _int8_weights(w_rows, s_rows, g0, n_groups, row_live, GROUP: tl.constexpr, NG: tl.constexpr):
    """`int8_matvec_kernel`'s tile of NG groups from group g0: q (rows, NG, GROUP) and the
    scales (rows, NG)."""
    g = g0 + tl.arange(0, NG)
    live = row_live[:, None] & (g < n_groups)[None, :]
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    q = tl.load(w_rows + cols[None, :, :], mask=live[:, :, None], other=0)
    return q, tl.load(s_rows + g[None, :], mask=live, other=0.0)


@triton.jit
def _int8_partial(
    q,
    s,
    x_row,
    g0,
    n_groups,
    n_in,
    g_ptr,
    inv,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
):
    """The rows' float32 sums of the INT8 tile (q, s) from group g0 times its inputs."""
    g = g0 + tl.arange(0, NG)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # (NG, GROUP)
    x = _product_input(x_row, cols, (g < n_groups)[:, None], n_in, g_ptr, inv, GATED, NORM)
    w = _int8_value(q) * s.to(tl.float32)[:, :, None]
    return tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)


@triton.jit
def _int4_weights(
    w_rows, sz_ptr, rows, g0, n_out, n_groups, row_live, GROUP: tl.constexpr, NG: tl.constexpr
):
    """`int4_matvec_kernel`'s tile of NG groups from group g0: the packed bytes (rows, NG,
    GROUP / 2) and the scales and zero points (rows, NG)."""
    g = g0 + tl.arange(0, NG)
    live = row_live[:, None] & (g < n_groups)[None, :]
    byte = g[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]  # (NG, HALF)
    p = tl.load(w_rows + byte[None, :, :], mask=live[:, :, None], other=0)
    sz = sz_ptr + (g[None, :].to(tl.int64) * n_out + rows[:, None]) * 2  # (BLOCK_N, NG)
    return p, tl.load(sz, mask=live, other=0.0), tl.load(sz + 1, mask=live, other=0.0)


@triton.jit
def _int4_partial(
    p,
    s,
    z,
    x_row,
    g0,
    n_groups,
    n_in,
    g_ptr,
    inv,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    GROUP: tl.constexpr,
    NG: tl.constexpr,
):
    """The rows' float32 sums of the INT4 tile (p, s, z) from group g0 times its inputs."""
    g = g0 + tl.arange(0, NG)
    g_live = (g < n_groups)[:, None]
    byte = g[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
    x_even = _product_input(x_row, 2 * byte, g_live, n_in, g_ptr, inv, GATED, NORM)
    x_odd = _product_input(x_row, 2 * byte + 1, g_live, n_in, g_ptr, inv, GATED, NORM)
    p = p.to(tl.int32)
    scale = s.to(tl.float32)[:, :, None]
    zero = z.to(tl.float32)[:, :, None]
    w_even = _int4_minus_8(p >> 4) * scale + zero
    w_odd = _int4_minus_8(p & 15) * scale + zero
    part = w_even * x_even[None, :, :] + w_odd * x_odd[None, :, :]
    return tl.sum(tl.sum(part, axis=2), axis=1)


@triton.jit
def matvec_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    n_out,
    n_in,
    g_ptr,
    sq_in_ptr,
    n_sq,
    width,
    eps,
    res_ptr,
    sq_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cache_head_stride,
    SCALE: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ROPE: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    SQ_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = (x @ W.T) * scale, rounded to x's dtype, for one token x (n_in,) and a weight W
    (n_out, n_in) of any float dtype (the model dtype, or E4M3 with its scales).

    The weight is widened to float32 in registers, so its bytes are read once and nothing is
    quantised per call. SCALE: 0 none, 1 one for the tensor, 2 one per output row. GATED: x is a
    row of gate then up (2 * n_in) and the input is SiLU(gate) * up (`_input`).

    The folds of the decode step, here and in the group-wise kernels (one token): NORM, the input
    is RMSNorm(x) * g for a residual row x of `width` values whose squares a product summed by
    tile (n_sq sums at sq_in_ptr, `_normed_input`); RESIDUAL, out is res + the product and each
    tile's sum of squares goes to sq_out_ptr (`_store_sum`); ROPE, the weight is the fused qkv
    projection and q goes to out_ptr, k and v into the layer's cache (`_store_rope`). PDL
    EARLY_READ: the first weight tile is read before the kernel waits on the one before it
    (`_enter`; no kernel writes a weight), the loop's first pass run apart on it.
    """
    pid = tl.program_id(0)
    rows = _tile_rows(pid, BLOCK_N, ROPE, D)
    row_live = rows < n_out
    # int64 row offsets: an output head (128256, 4096) holds 5.3e8 elements.
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * n_in
    if PDL == EARLY_READ:  # the first weights come in while the kernel before ends
        w0 = _dense_weights(w_rows, 0, n_in, row_live, BLOCK_K)
        _enter(PDL)
        inv = _norm_scale(sq_in_ptr, n_sq, width, eps, NORM, SQ_BLOCK)
        acc = _dense_partial(w0, x_ptr, 0, n_in, g_ptr, inv, GATED, NORM, BLOCK_K)
        start = BLOCK_K
    else:
        _enter(PDL)
        inv = _norm_scale(sq_in_ptr, n_sq, width, eps, NORM, SQ_BLOCK)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        start = 0
    for k0 in range(start, n_in, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_live = cols < n_in
        x = _product_input(x_ptr, cols, col_live, n_in, g_ptr, inv, GATED, NORM)
        w = tl.load(
            w_rows + cols[None, :], mask=row_live[:, None] & col_live[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    if SCALE == 2:
        acc = acc * tl.load(scale_ptr + rows, mask=row_live, other=0.0)
    elif SCALE == 1:
        acc = acc * tl.load(scale_ptr)
    # Rounded to x's dtype first: a float32 out holds the values a model-dtype product gives.
    out = acc.to(x_ptr.dtype.element_ty)
    _store_product(
        out,
        rows,
        row_live,
        pid,
        out_ptr,
        res_ptr,
        sq_out_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        k_cache_ptr,
        v_cache_ptr,
        cache_head_stride,
        RESIDUAL,
        ROPE,
        HEADS,
        KV_HEADS,
        D,
        BLOCK_N,
    )


@triton.jit
def int8_matvec_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    n_out,
    n_in,
    g_ptr,
    sq_in_ptr,
    n_sq,
    width,
    eps,
    res_ptr,
    sq_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cache_head_stride,
    GROUP: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ROPE: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    SQ_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = x[t] @ W.T for token row t = program_id(1) of x (tokens, n_in) and an INT8 weight
    W = q * scale: q (n_out, n_in), scale (n_out, n_in / GROUP) in the model dtype. GATED: x's
    rows are gate then up (tokens, 2 * n_in) and the input is SiLU(gate) * up (`_input`).

    A tile is BLOCK_N rows by BLOCK_K // GROUP whole groups (n_in is a multiple of GROUP; the
    groups past n_in are masked). Each weight is dequantised to float32 in registers and the sum
    is float32, so the weight's bytes and its scales are read once and nothing is written but out.
    """
    NG: tl.constexpr = BLOCK_K // GROUP
    pid = tl.program_id(0)
    rows = _tile_rows(pid, BLOCK_N, ROPE, D)
    token = tl.program_id(1)
    row_live = rows < n_out
    n_groups = n_in // GROUP
    x_row = x_ptr + token * (2 * n_in if GATED else n_in)
    # int64 row offsets: a (128256, 4096) head is 5.3e8 bytes, within int32 today, not by much.
    w_rows = w_ptr + rows.to(tl.int64)[:, None, None] * n_in
    s_rows = scale_ptr + rows.to(tl.int64)[:, None] * n_groups
    if PDL == EARLY_READ:  # the first weights come in while the kernel before ends
        q0, s0 = _int8_weights(w_rows, s_rows, 0, n_groups, row_live, GROUP, NG)
        _enter(PDL)
        inv = _norm_scale(sq_in_ptr, n_sq, width, eps, NORM, SQ_BLOCK)
        acc = _int8_partial(q0, s0, x_row, 0, n_groups, n_in, g_ptr, inv, GATED, NORM, GROUP, NG)
        start = NG
    else:
        _enter(PDL)
        inv = _norm_scale(sq_in_ptr, n_sq, width, eps, NORM, SQ_BLOCK)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        start = 0
    for g0 in range(start, n_groups, NG):
        q, s = _int8_weights(w_rows, s_rows, g0, n_groups, row_live, GROUP, NG)
        acc += _int8_partial(q, s, x_row, g0, n_groups, n_in, g_ptr, inv, GATED, NORM, GROUP, NG)
    out = acc.to(out_ptr.dtype.element_ty)
    _store_product(
        out,
        rows,
        row_live,
        pid,
        out_ptr + token * n_out,
        res_ptr,
        sq_out_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        k_cache_ptr,
        v_cache_ptr,
        cache_head_stride,
        RESIDUAL,
        ROPE,
        HEADS,
        KV_HEADS,
        D,
        BLOCK_N,
    )


@triton.jit
def int4_matvec_kernel(
    x_ptr,
    w_ptr,
    sz_ptr,
    out_ptr,
    n_out,
    n_in,
    g_ptr,
    sq_in_ptr,
    n_sq,
    width,
    eps,
    res_ptr,
    sq_out_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cache_head_stride,
    GROUP: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ROPE: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    SQ_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = x[t] @ W.T for token row t = program_id(1) of x (tokens, n_in) and an INT4 weight
    W = (q - 8) * scale + zero per group of GROUP inputs; GATED as in `int8_matvec_kernel`.

    q is packed two per byte, uint8 (n_out, n_in / 2): byte j of a row holds input 2j in its high
    nibble and input 2j + 1 in its low one. sz is (n_in / GROUP, n_out, 2) in the model dtype: the
    scale then the zero point of each group of each row. Tiles, masking and float32 arithmetic as
    in `int8_matvec_kernel`; the nibbles are dequantised in registers.
    """
    NG: tl.constexpr = BLOCK_K // GROUP
    pid = tl.program_id(0)
    rows = _tile_rows(pid, BLOCK_N, ROPE, D)
    token = tl.program_id(1)
    row_live = rows < n_out
    n_groups = n_in // GROUP
    x_row = x_ptr + token * (2 * n_in if GATED else n_in)
    w_rows = w_ptr + rows.to(tl.int64)[:, None, None] * (n_in // 2)
    if PDL == EARLY_READ:  # the first weights come in while the kernel before ends
        p0, s0, z0 = _int4_weights(w_rows, sz_ptr, rows, 0, n_out, n_groups, row_live, GROUP, NG)
        _enter(PDL)
        inv = _norm_scale(sq_in_ptr, n_sq, width, eps, NORM, SQ_BLOCK)
        acc = _int4_partial(
            p0, s0, z0, x_row, 0, n_groups, n_in, g_ptr, inv, GATED, NORM, GROUP, NG
        )
        start = NG
    else:
        _enter(PDL)
        inv = _norm_scale(sq_in_ptr, n_sq, width, eps, NORM, SQ_BLOCK)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        start = 0
    for g0 in range(start, n_groups, NG):
        p, s, z = _int4_weights(w_rows, sz_ptr, rows, g0, n_out, n_groups, row_live, GROUP, NG)
        acc += _int4_partial(p, s, z, x_row, g0, n_groups, n_in, g_ptr, inv, GATED, NORM, GROUP, NG)
    out = acc.to(out_ptr.dtype.element_ty)
    _store_product(
        out,
        rows,
        row_live,
        pid,
        out_ptr + token * n_out,
        res_ptr,
        sq_out_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        k_cache_ptr,
        v_cache_ptr,
        cache_head_stride,
        RESIDUAL,
        ROPE,
        HEADS,
        KV_HEADS,
        D,
        BLOCK_N,
    )


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """a @ b accumulated in float32; WIDEN: the operands as float32 first (the same values)."""
    if WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


# The row count takes no specialisation (divisible by 16, equal to 1): a prefill of any length
# runs the kernels its bucket's capture compiled, and none compiles at request time.
@triton.jit(do_not_specialize=["n_rows"])
def rows_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    n_rows,
    n_out,
    n_in,
    FORMAT: tl.constexpr,
    SCALE: tl.constexpr,
    GROUP: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """out = x @ W.T for a few token rows x (n_rows, n_in) in the model dtype: one tile of BLOCK_M
    rows by BLOCK_N outputs, the weight dequantised to x's dtype in registers and multiplied on
    tensor cores (`tl.dot`, float32 accumulation), so its bytes are read once per row tile and
    nothing is quantised or widened in memory.

    FORMAT 0: W (n_out, n_in) in a float dtype (the model's, or E4M3), times a float32 scale per
    output (SCALE 2), per tensor (SCALE 1) or none (0) applied to the sum. FORMAT 1: INT8, W = q *
    scale with scale (n_out, n_in / GROUP) in the model dtype (`Int8Linear`). FORMAT 2: INT4 in
    `int4_matvec_kernel`'s layout, W = (q - 8) * scale + zero. A dequantised weight is rounded to
    the model dtype where the eager layer's dequantisation rounds; for the group formats a K tile
    lies within one group (GROUP is a multiple of BLOCK_K). GATED: x's rows are gate then up and
    the input is SiLU(gate) * up (`_input`). The result is rounded to x's dtype, then stored in
    out's (n_rows, n_out).
    """
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_live = outs < n_out
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_live = rows < n_rows
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * (2 * n_in if GATED else n_in)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FORMAT == 2:
        HALF: tl.constexpr = BLOCK_K // 2
        w_rows = w_ptr + outs.to(tl.int64)[:, None] * (n_in // 2)
        for k0 in range(0, n_in, BLOCK_K):
            byte = k0 // 2 + tl.arange(0, HALF)
            p = tl.load(w_rows + byte[None, :], mask=out_live[:, None], other=0).to(tl.int32)
            sz = scale_ptr + ((k0 // GROUP) * n_out + outs.to(tl.int64)) * 2
            s = tl.load(sz, mask=out_live, other=0.0).to(tl.float32)[:, None]
            z = tl.load(sz + 1, mask=out_live, other=0.0).to(tl.float32)[:, None]
            w_even = ((_int4_minus_8(p >> 4) * s).to(dtype).to(tl.float32) + z).to(dtype)
            w_odd = ((_int4_minus_8(p & 15) * s).to(dtype).to(tl.float32) + z).to(dtype)
            x_even = _input(x_rows, 2 * byte[None, :], row_live[:, None], n_in, GATED).to(dtype)
            x_odd = _input(x_rows, 2 * byte[None, :] + 1, row_live[:, None], n_in, GATED).to(dtype)
            acc += _dot(x_even, tl.trans(w_even), PRECISION, WIDEN)
            acc += _dot(x_odd, tl.trans(w_odd), PRECISION, WIDEN)
    else:
        w_rows = w_ptr + outs.to(tl.int64)[:, None] * n_in
        for k0 in range(0, n_in, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_live = cols < n_in
            w_live = out_live[:, None] & col_live[None, :]
            if FORMAT == 1:
                q = tl.load(w_rows + cols[None, :], mask=w_live, other=0)
                s_at = scale_ptr + outs.to(tl.int64) * (n_in // GROUP) + k0 // GROUP
                s = tl.load(s_at, mask=out_live, other=0.0).to(tl.float32)
                w = (_int8_value(q) * s[:, None]).to(dtype)
            else:
                w = tl.load(w_rows + cols[None, :], mask=w_live, other=0.0).to(tl.float32).to(dtype)
            live = row_live[:, None] & col_live[None, :]
            x = _input(x_rows, cols[None, :], live, n_in, GATED).to(dtype)
            acc += _dot(x, tl.trans(w), PRECISION, WIDEN)
    if SCALE == 2:
        acc = acc * tl.load(scale_ptr + outs, mask=out_live, other=0.0)[None, :]
    elif SCALE == 1:
        acc = acc * tl.load(scale_ptr)
    out = acc.to(dtype).to(out_ptr.dtype.element_ty)
    at = out_ptr + rows.to(tl.int64)[:, None] * n_out + outs[None, :]
    tl.store(at, out, mask=row_live[:, None] & out_live[None, :])


@triton.jit(do_not_specialize=["n_rows"])  # as `rows_matmul_kernel`
def prefill_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    start_ptr,
    out_ptr,
    n_rows,
    cache_head_stride,
    scale,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """Causal attention of BLOCK_M query rows of one query head (program_id(0)) over the layer's
    cache (flash attention): q and out are (n_rows, HEADS, D), row r at position start + r (start
    read from start_ptr), whose K/V the cache already holds at every position up to the last row's.

    Row r sees the cache positions 0..start + r. Only positions up to the tile's last row are
    loaded (masked loads read nothing past them), so what an unwritten position holds never enters
    the result. Rounding as in `decode_attention_split_kernel`.
    """
    head = tl.program_id(0)
    kv_head = head // GROUP
    first = tl.program_id(1) * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    row_live = rows < n_rows
    dims = tl.arange(0, D)
    at = (rows[:, None] * HEADS + head) * D + dims[None, :]
    q = tl.load(q_ptr + at, mask=row_live[:, None], other=0.0)
    start = tl.load(start_ptr)
    q_pos = start + rows
    stop = start + tl.minimum(first + BLOCK_M, n_rows)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    head_k = k_ptr + kv_head * cache_head_stride
    head_v = v_ptr + kv_head * cache_head_stride
    for block in range(0, stop, BLOCK):
        offs = block + tl.arange(0, BLOCK)
        live = offs < stop
        # Position 0 is in the first block and every row sees it, so each row's max is finite.
        seen = live[None, :] & (offs[None, :] <= q_pos[:, None])
        m, total, acc = _attend_block(
            q, head_k, head_v, offs, live, seen, m, total, acc, scale, D, PRECISION, WIDEN
        )
    out = acc / total[:, None]
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=row_live[:, None])


@triton.jit
def _attend_block(
    q, head_k, head_v, offs, live, seen, m, total, acc, scale, D: tl.constexpr, PRECISION, WIDEN
):
    """One block of cache positions `offs` of a head's K and V through flash attention's online
    softmax: (running max, exp-sum, unnormalised output) of the query rows q after it. Only the
    `live` positions are loaded (the others read nothing); `seen` (rows, positions), within
    them, says which positions each row attends to."""
    dims = tl.arange(0, D)
    k = tl.load(head_k + offs[:, None] * D + dims[None, :], mask=live[:, None], other=0.0)
    v = tl.load(head_v + offs[:, None] * D + dims[None, :], mask=live[:, None], other=0.0)
    scores = _dot(q, tl.trans(k), PRECISION, WIDEN) * scale  # (rows, positions)
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN)
    return m_new, total, acc


@triton.jit
def decode_attention_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    cache_head_stride,
    scale,
    N_SPLITS: tl.constexpr,
    SPLIT: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
    PDL: tl.constexpr,
):
    """One KV head's query group over one split of SPLIT cache positions (flash-decoding).

    Only positions at or before the step's own are loaded (others are masked loads that read
    nothing), so what an unwritten position holds never enters the result. Writes the split's
    unnormalised output (GROUP, D), running max and exp-sum (GROUP,) in float32; a split wholly
    after the position writes max -inf, sum 0 and output 0.

    Both products are `tl.dot`s over ROWS query rows (GROUP padded with zero rows to at least
    16, the least M of older Triton releases' tl.dot): a broadcast product of (rows, BLOCK, D)
    would hold BLOCK * D values per row in registers and spill. Scores accumulate in float32; the softmax weights enter the second
    product in the cache's dtype (flash attention's rounding; float32 stays float32 with
    PRECISION "ieee"). WIDEN multiplies the operands as float32 holding the same values: Triton's
    interpreter multiplies bfloat16 dot operands as their raw bits.
    """
    _enter(PDL)
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    pos = tl.load(pos_ptr)
    rows = tl.arange(0, ROWS)
    row_live = rows < GROUP
    dims = tl.arange(0, D)
    q = tl.load(
        q_ptr + (kv_head * GROUP + rows)[:, None] * D + dims[None, :],
        mask=row_live[:, None],
        other=0.0,
    )
    m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, D), dtype=tl.float32)
    start = split * SPLIT
    stop = tl.minimum(start + SPLIT, pos + 1)
    head_k = k_ptr + kv_head * cache_head_stride
    head_v = v_ptr + kv_head * cache_head_stride
    for block in range(start, stop, BLOCK):
        offs = block + tl.arange(0, BLOCK)
        live = offs < stop
        m, total, acc = _attend_block(
            q, head_k, head_v, offs, live, live[None, :], m, total, acc, scale, D, PRECISION, WIDEN
        )
    out = (kv_head * GROUP + rows) * N_SPLITS + split
    tl.store(acc_ptr + out[:, None] * D + dims[None, :], acc, mask=row_live[:, None])
    tl.store(max_ptr + out, m, mask=row_live)
    tl.store(sum_ptr + out, total, mask=row_live)


@triton.jit
def decode_attention_combine_kernel(
    acc_ptr,
    max_ptr,
    sum_ptr,
    out_ptr,
    N_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    D: tl.constexpr,
    PDL: tl.constexpr,
):
    """One query head's output from its splits: sum(w * acc) / sum(w * total), w = exp(m - max m).

    Split 0 always holds position 0, so the largest max is finite and an empty split weighs 0.
    """
    _enter(PDL)
    head = tl.program_id(0)
    splits = tl.arange(0, SPLITS_P2)  # N_SPLITS rounded up to a power of two; the rest masked
    live = splits < N_SPLITS
    dims = tl.arange(0, D)
    m = tl.load(max_ptr + head * N_SPLITS + splits, mask=live, other=float("-inf"))
    w = tl.exp(m - tl.max(m, axis=0))
    total = tl.sum(w * tl.load(sum_ptr + head * N_SPLITS + splits, mask=live, other=0.0), axis=0)
    acc = tl.load(
        acc_ptr + (head * N_SPLITS + splits)[:, None] * D + dims[None, :],
        mask=live[:, None],
        other=0.0,
    )
    out = tl.sum(w[:, None] * acc, axis=0) / total
    tl.store(out_ptr + head * D + dims, out.to(out_ptr.dtype.element_ty))
