"""The Triton kernels against torch at random shapes: head groups that are not powers of two,
lengths and spans that are not multiples of the kernels' blocks, one row, one position (on the
CPU through Triton's interpreter, TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.engine import kernels
from appliance.engine.llama import LlamaModel

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FUZZ = settings(max_examples=12, deadline=None, derandomize=True)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-4, atol=1e-4)


heads_layouts = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3, 5, 8, 17]))


@FUZZ
@given(
    layout=heads_layouts,
    d=st.sampled_from([16, 32]),
    span=st.integers(1, 300),
    data=st.data(),
)
def test_decode_attention_at_any_span_and_position(
    layout: tuple[int, int], d: int, span: int, data: st.DataObject
) -> None:
    kv, group = layout
    heads, seq = kv * group, 320
    pos = data.draw(st.integers(0, span - 1))
    q = torch.randn(heads, d, generator=_gen(1)).to(DEVICE)
    k = torch.randn(kv, seq, d, generator=_gen(2)).to(DEVICE)
    v = torch.randn(kv, seq, d, generator=_gen(3)).to(DEVICE)
    k[:, pos + 1 :] = float("nan")
    v[:, pos + 1 :] = float("nan")
    got = kernels.decode_attention(q, k, v, torch.tensor([pos], device=DEVICE), span)
    ref = F.scaled_dot_product_attention(
        q.view(kv, group, d), k[:, : pos + 1], v[:, : pos + 1]
    ).view(heads, d)
    _close(got, ref)


@FUZZ
@given(
    layout=heads_layouts,
    d=st.sampled_from([16, 32]),
    rows=st.integers(1, 40),
    start=st.integers(0, 150),
)
def test_prefill_attention_at_any_start_and_row_count(
    layout: tuple[int, int], d: int, rows: int, start: int
) -> None:
    kv, group = layout
    heads, seq = kv * group, 200
    end = start + rows
    q = torch.randn(rows, heads, d, generator=_gen(4)).to(DEVICE)
    k = torch.randn(kv, seq, d, generator=_gen(5)).to(DEVICE)
    v = torch.randn(kv, seq, d, generator=_gen(6)).to(DEVICE)
    k[:, end:] = float("nan")
    v[:, end:] = float("nan")
    got = kernels.prefill_attention(q, k, v, torch.tensor([start], device=DEVICE))
    positions = torch.arange(end, device=DEVICE)
    visible = positions[None, :] <= positions[start:end, None]
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k[:, :end].unsqueeze(0),
        v[:, :end].unsqueeze(0),
        attn_mask=visible,
        enable_gqa=True,
    )
    _close(got, ref.squeeze(0).transpose(0, 1))


@FUZZ
@given(
    rows=st.integers(1, 70),
    n_out=st.integers(1, 150),
    n_in=st.integers(1, 150),
    gated=st.booleans(),
)
def test_rows_matmul_at_any_shape(rows: int, n_out: int, n_in: int, gated: bool) -> None:
    width = 2 * n_in if gated else n_in
    x = torch.randn(rows, width, generator=_gen(7)).to(DEVICE)
    w = torch.randn(n_out, n_in, generator=_gen(8)).to(DEVICE)
    got = kernels.rows_matmul(x, w, gated=gated)
    inner = F.silu(x[:, :n_in]) * x[:, n_in:] if gated else x
    _close(got, F.linear(inner, w))


@FUZZ
@given(n=st.integers(1, 5), hidden=st.integers(1, 200), residual=st.booleans())
def test_rms_norm_at_any_width(n: int, hidden: int, residual: bool) -> None:
    x = torch.randn(n, hidden, generator=_gen(9)).to(DEVICE)
    r = torch.randn(n, hidden, generator=_gen(10)).to(DEVICE)
    w = torch.randn(hidden, generator=_gen(11)).to(DEVICE)
    got, total = kernels.rms_norm(x, w, 1e-5, r if residual else None)
    s = x + r if residual else x
    _close(total, s)
    _close(got, w * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5))


@FUZZ
@given(n=st.integers(1, 3), inner=st.integers(1, 3000))
def test_silu_mul_at_any_width(n: int, inner: int) -> None:
    x = torch.randn(n, 2 * inner, generator=_gen(12)).to(DEVICE)
    _close(kernels.silu_mul(x), F.silu(x[:, :inner]) * x[:, inner:])


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize(("rows", "pos"), [(1, 0), (3, 61), (1, 63)])
def test_rope_kv_write_at_the_last_positions(d: int, rows: int, pos: int) -> None:
    heads, kv, seq = 3, 1, 64
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    qkv = torch.randn(rows, (heads + 2 * kv) * d, generator=_gen(13)).to(DEVICE)
    k_cache = torch.full((kv, seq, d), float("nan"), device=DEVICE)
    v_cache = torch.full((kv, seq, d), float("nan"), device=DEVICE)
    q = kernels.rope_kv_write(
        qkv, cos, sin, torch.tensor([pos], device=DEVICE), k_cache, v_cache, heads
    )
    parts = qkv.view(rows, heads + 2 * kv, d).transpose(0, 1)
    c, s = cos[pos : pos + rows], sin[pos : pos + rows]
    _close(q, LlamaModel._rope(parts[:heads], c, s).transpose(0, 1))
    _close(k_cache[:, pos : pos + rows], LlamaModel._rope(parts[heads : heads + kv], c, s))
    _close(v_cache[:, pos : pos + rows], parts[heads + kv :])
    assert torch.isnan(k_cache[:, :pos]).all() and torch.isnan(k_cache[:, pos + rows :]).all()
