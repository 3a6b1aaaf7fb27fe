"""The fused prefill and verify steps (a few token rows on the Triton kernels) against the eager
torch reference, on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py;
on a CUDA host they run compiled). Shapes are tiny: the interpreter runs each program in numpy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from appliance.engine import fused, kernels, quantized
from appliance.engine.decode import GraphDecode
from appliance.engine.linear import WeightQuant, dequantize, quantize
from appliance.engine.llama import KVCache, LlamaModel
from appliance.engine.prefill import GraphPrefill
from appliance.engine.quantized import (
    GroupQuant,
    Int4Linear,
    Int8Linear,
    dequantize_int8,
    quantize_group_linear,
)
from appliance.engine.random_weights import random_model
from appliance.engine.runner import Runner
from appliance.engine.sampling import SamplingParams, generate
from tests.engine.test_kernels import _Launches

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
# float32 differs from torch only in summation order; bf16 by a rounding or two of the dtype
# (the interpreter rounds bf16 toward zero, torch and compiled kernels to nearest).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol)


@pytest.fixture
def small_row_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """16-row tiles, so 20 rows take two tiles, the second mostly past the last row."""
    monkeypatch.setattr(kernels, "ROWS_TILE", (16, 64, 64))


@pytest.fixture
def few_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests of whole steps, where the interpreter's time goes per program: 128 outputs a
    `rows_matmul` program and 64 a matvec program (which program sums an output does not change
    its sum)."""
    monkeypatch.setattr(kernels, "ROWS_TILE", (64, 128, 64))
    monkeypatch.setitem(kernels.MATVEC_TILES, "matvec", (64, kernels.MATVEC_TILES["matvec"][1]))


@DTYPES
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.usefixtures("small_row_tiles")
def test_rows_matmul_equals_f_linear(dtype: torch.dtype, gated: bool) -> None:
    # 40 outputs and 96 inputs: neither a multiple of the 64-wide tile.
    w = (torch.randn(40, 96, generator=_gen(1)) / 10).to(DEVICE, dtype)
    x = torch.randn(20, 2 * 96 if gated else 96, generator=_gen(2)).to(DEVICE, dtype)
    got = kernels.rows_matmul(x, w, gated=gated)
    assert got.shape == (20, 40) and got.dtype == dtype
    act = kernels.silu_mul(x) if gated else x
    _close(got, F.linear(act.float(), w.float()), dtype)
    # float32 out (the output head's logits) holds the values rounded to the model dtype.
    logits = torch.full((20, 40), float("nan"), device=DEVICE)
    assert kernels.rows_matmul(act, w, out=logits) is logits
    assert torch.equal(logits, kernels.rows_matmul(act, w).float())
    with pytest.raises(ValueError, match=r"out of shape \(1, 40\): needs a contiguous \(20, 40\)"):
        kernels.rows_matmul(act, w, out=logits[:1])
    with pytest.raises(ValueError, match=r"shape \(20, 95\) for a weight of 96 inputs"):
        kernels.rows_matmul(act[:, :95], w)


@pytest.mark.parametrize("scaling", ["channel", "tensor"])
def test_fp8_rows_matmul_is_weight_only(scaling: str) -> None:
    w = torch.randn(40, 96, generator=_gen(3)) * torch.logspace(-2, 1, 40).unsqueeze(1)
    q, scale = quantize(w, scaling)  # type: ignore[arg-type]
    x = torch.randn(5, 96, generator=_gen(4)).to(torch.bfloat16)
    got = kernels.rows_matmul(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE))
    assert got.shape == (5, 40) and got.dtype == torch.bfloat16
    ref = x.float() @ dequantize(q, scale).t()  # the activations are not quantised
    # E4M3 widens to bf16 exactly and the sum is float32: only the output's rounding differs.
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2**-7, atol=1e-3)


@DTYPES
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.usefixtures("small_row_tiles")
def test_group_rows_matmul_rounds_the_weight_as_the_layer_does(
    dtype: torch.dtype, bits: int
) -> None:
    """Each dequantised weight is rounded to the model dtype as the layer's eager call rounds it
    and the sum is float32, so compiled, only the output's rounding differs from the float32
    product of those weights. The interpreter rounds bf16 toward zero, a bias that adds up over
    an outlier group's large weights: bf16 is held to a few units in the last place of the
    largest output."""
    w = torch.randn(40, 128, generator=_gen(5)) / 10
    w[0, :32] *= 30  # one outlier group
    fmt = GroupQuant(8 if bits == 8 else 4, 32)
    layer = quantize_group_linear("w", w.to(DEVICE), fmt, dtype, int4_kernel="dequantize")
    if isinstance(layer, Int8Linear):
        weight = dequantize_int8(layer.weight, layer.scale, dtype)
    else:
        assert isinstance(layer, Int4Linear)
        weight = layer.dequantized(dtype)
    for gated in (False, True):
        x = torch.randn(20, 256 if gated else 128, generator=_gen(6)).to(DEVICE, dtype)
        if isinstance(layer, Int8Linear):
            got = kernels.int8_rows_matmul(x, layer.weight, layer.scale, gated)
        else:
            got = kernels.int4_rows_matmul(
                x, layer.packed, layer.scales_and_zeros, layer.group_size, gated
            )
        act = kernels.silu_mul(x) if gated else x
        ref = F.linear(act.float(), weight.float())
        if dtype == torch.bfloat16:
            assert float((got.float() - ref).abs().max()) <= 2**-6 * float(ref.abs().max())
        else:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@DTYPES
def test_rope_writes_every_row_at_its_own_position(dtype: torch.dtype) -> None:
    heads, kv, d, rows, start = 4, 2, 32, 3, 5
    model = random_model("tiny", DEVICE, dtype, seed=5)
    qkv = torch.randn(rows, (heads + 2 * kv) * d, generator=_gen(7)).to(DEVICE, dtype)
    k_cache = torch.full((kv, 16, d), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    start_at = torch.tensor([start], device=DEVICE)
    q = kernels.rope_kv_write(qkv, model.cos, model.sin, start_at, k_cache, v_cache, heads)
    assert q.shape == (rows, heads, d)
    q_ref, k_ref, v_ref = torch.split(qkv, [heads * d, kv * d, kv * d], dim=1)
    for r in range(rows):
        cos, sin = model.cos[start + r], model.sin[start + r]
        _close(q[r], LlamaModel._rope(q_ref[r].view(heads, d), cos, sin), dtype)
        _close(k_cache[:, start + r], LlamaModel._rope(k_ref[r].view(kv, d), cos, sin), dtype)
        assert torch.equal(v_cache[:, start + r], v_ref[r].view(kv, d))
    others = (torch.arange(16) < start) | (torch.arange(16) >= start + rows)
    assert torch.isnan(k_cache[:, others]).all() and torch.isnan(v_cache[:, others]).all()


@DTYPES
@pytest.mark.parametrize(("start", "rows"), [(0, 5), (3, 20), (100, 33)])
def test_prefill_attention_is_causal_and_reads_only_written_positions(
    dtype: torch.dtype, start: int, rows: int
) -> None:
    heads, kv, d, seq = 6, 2, 16, 256  # a group of 3: not a power of two
    q = torch.randn(rows, heads, d, generator=_gen(8)).to(DEVICE, dtype)
    k = torch.randn(kv, seq, d, generator=_gen(9)).to(DEVICE, dtype)
    v = torch.randn(kv, seq, d, generator=_gen(10)).to(DEVICE, dtype)
    end = start + rows
    k[:, end:] = float("nan")  # unwritten positions may hold anything
    v[:, end:] = float("nan")
    got = kernels.prefill_attention(q, k, v, torch.tensor([start], device=DEVICE))
    visible = (
        torch.arange(end, device=DEVICE)[None, :]
        <= torch.arange(start, end, device=DEVICE)[:, None]
    )
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1).float().unsqueeze(0),
        k[:, :end].float().unsqueeze(0),
        v[:, :end].float().unsqueeze(0),
        attn_mask=visible,
        enable_gqa=True,
    )
    assert torch.isfinite(got).all()
    _close(got, ref.squeeze(0).transpose(0, 1), dtype)


def _nan_cache(model: LlamaModel, prefix: list[int]) -> KVCache:
    """A cache whose positions past `prefix` hold NaN: nothing may read them."""
    cache = model.new_cache(64)
    with torch.inference_mode():
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
    if prefix:
        model.forward(prefix, cache, 0)
    return cache


def _static(
    model: LlamaModel, prefix: list[int], tokens: list[int], bucket: int
) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
    """(prefill_static's logits, verify_static's logits of the live rows, the prefill's cache) of
    `tokens` after `prefix`, padded to `bucket` rows, over a span of 64."""
    ids = torch.tensor(tokens + [0] * (bucket - len(tokens)), device=DEVICE)
    meta = torch.tensor([len(prefix), len(tokens)], device=DEVICE)
    vocab = model.config.vocab_size
    last = torch.empty(vocab, device=DEVICE)
    rows = torch.empty(bucket, vocab, device=DEVICE)
    cache = _nan_cache(model, prefix)
    with torch.inference_mode():
        model.prefill_static(ids, meta, cache, 64, last)
        model.verify_static(ids, meta, _nan_cache(model, prefix), 64, rows)
    return last, rows[: len(tokens)], cache


FORMATS: list[tuple[WeightQuant | None, torch.dtype, float]] = [
    # (format, dtype, most relative difference of the logits from the eager step's)
    (None, torch.float32, 1e-5),
    (None, torch.bfloat16, 0.03),
    ("channel", torch.bfloat16, 0.05),  # weight-only here, W8A8 in the eager layer
    (GroupQuant(8, 64), torch.bfloat16, 0.03),
    (GroupQuant(4, 64), torch.bfloat16, 0.03),
]


@pytest.mark.parametrize(
    ("fmt", "dtype", "most"), FORMATS, ids=["f32", "bf16", "fp8", "int8", "int4"]
)
@pytest.mark.usefixtures("few_programs")
def test_fused_prefill_and_verify_follow_the_eager_steps(
    fmt: WeightQuant | None, dtype: torch.dtype, most: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same weights, both steps, a prompt after a cached prefix (and in float32 one from position
    0 too): the logits, the argmax and the K/V of the live positions agree; nothing reads a NaN
    position."""
    monkeypatch.setattr(quantized, "_int4_kernel", lambda weight: "dequantize")  # CUDA's layout
    model = random_model("tiny", DEVICE, dtype, fmt, seed=5)
    calls: list[int] = []
    real = fused.static_rows

    def spy(
        model: LlamaModel, ids: torch.Tensor, meta: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        calls.append(ids.shape[0])
        return real(model, ids, meta, cache)

    monkeypatch.setattr(fused, "static_rows", spy)
    cases = [([7, 300, 42], [11, 5, 9])]
    if dtype == torch.float32:
        cases.append(([], [7, 300, 42, 11, 5]))
    for prefix, tokens in cases:
        model.kernels = "torch"
        ref, ref_rows, ref_cache = _static(model, prefix, tokens, 16)
        model.kernels = "triton"
        got, rows, cache = _static(model, prefix, tokens, 16)
        for a, b in ((got, ref), (rows, ref_rows)):
            assert torch.isfinite(a).all()
            assert float((a - b).norm() / b.norm()) < most
        assert torch.equal(got.argmax(), ref.argmax())
        assert torch.equal(rows.argmax(-1), ref_rows.argmax(-1))
        end = len(prefix) + len(tokens)
        for mine, theirs in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
            a, b = mine[:, :, :end].float(), theirs[:, :, :end].float()
            assert float((a - b).norm() / b.norm()) < most
    assert calls.count(16) == 2 * len(cases)  # each bucket of 16 rows, both steps


@pytest.mark.parametrize(("fmt", "dtype", "most"), [FORMATS[0], FORMATS[2]], ids=["f32", "fp8"])
@pytest.mark.usefixtures("few_programs")
def test_an_eager_prefill_on_the_kernels_follows_the_torch_one(
    fmt: WeightQuant | None, dtype: torch.dtype, most: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LlamaModel.forward` of several tokens on the Triton kernels: up to FUSED_ROWS tokens the
    fused rows (the row-tile products), past it the fused small steps with the layers' own
    products and torch's attention; from position 0 and after a cached prefix, with NaN in every
    unwritten position."""
    model = random_model("tiny", DEVICE, dtype, fmt, seed=5)
    row_tiles: list[int] = []
    real = kernels.rows_matmul

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        row_tiles.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(kernels, "rows_matmul", spy)
    for prefix, tokens in (([], [7, 300, 42, 11, 5, 9]), ([7, 300, 42], [11, 5, 9, 8, 100])):
        end = len(prefix) + len(tokens)
        model.kernels = "torch"
        ref_cache = _nan_cache(model, prefix)
        ref = model.forward(tokens, ref_cache, len(prefix))
        for most_rows, row_tile_products in ((4, False), (16, True)):
            monkeypatch.setattr(fused, "FUSED_ROWS", most_rows)
            model.kernels = "torch"
            cache = _nan_cache(model, prefix)
            model.kernels = "triton"
            row_tiles.clear()
            got = model.forward(tokens, cache, len(prefix))
            assert bool(row_tiles) == row_tile_products
            assert torch.isfinite(got).all() and torch.equal(got.argmax(), ref.argmax())
            assert float((got - ref).norm() / ref.norm()) < most
            for mine, theirs in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
                a, b = mine[:, :, :end].float(), theirs[:, :, :end].float()
                assert float((a - b).norm() / b.norm()) < most


def test_rows_past_fused_rows_take_the_torch_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model = random_model("tiny", DEVICE, torch.float32, seed=5)
    model.kernels = "triton"
    monkeypatch.setattr(fused, "FUSED_ROWS", 8)
    monkeypatch.setattr(kernels, "rows_matmul", lambda *a, **k: pytest.fail("fused rows"))
    got, _, _ = _static(model, [], [7, 300, 42], 16)
    model.kernels = "torch"
    ref, _, _ = _static(model, [], [7, 300, 42], 16)
    assert torch.equal(got, ref)


class Replay:
    """A capture that replays the body eagerly (the graph contract is tested in test_gpu_path)."""

    def __call__(self, body: Callable[[], Any]) -> Callable[[], Any]:
        return body


@pytest.mark.usefixtures("few_programs")
def test_captured_prefill_on_the_kernels_gives_the_eager_tokens() -> None:
    """The runner's path: a bucketed prefill and the decode steps after it, all fused, float32."""
    eager = random_model("tiny", DEVICE, torch.float32, seed=5)
    model = random_model("tiny", DEVICE, torch.float32, seed=5)
    model.kernels = "triton"
    cache = model.new_cache(128)
    prefill = GraphPrefill(model, cache, Replay(), (32,), (64, 128))
    step = GraphDecode(model, cache, Replay(), smallest_span=64, prefill=prefill)
    prompt = torch.randint(3, 512, (20,), generator=_gen(11)).tolist()
    greedy = SamplingParams(top_k=1)
    got = list(generate(model, prompt, 6, None, greedy, cache=cache, decode=step))
    assert got == list(generate(eager, prompt, 6, None, greedy))


@pytest.mark.usefixtures("few_programs")
def test_a_fused_prefill_launches_eight_kernels_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 + 8 * layers Triton launches (the embedding with the first norm; per block the qkv
    product, RoPE with the KV write, attention, the o product, a norm, gate-up, down and a norm;
    the output head) and two torch operators to pick the last live row; a verify step the same
    launches and no torch operator."""
    monkeypatch.setattr(quantized, "_int4_kernel", lambda weight: "dequantize")
    model = random_model("tiny", DEVICE, torch.bfloat16, GroupQuant(4, 64), seed=5)
    model.kernels = "triton"
    layers = model.config.num_hidden_layers
    ids = torch.tensor([7, 300, 42] + [0] * 13, device=DEVICE)
    meta = torch.tensor([0, 3], device=DEVICE)
    vocab = model.config.vocab_size
    counter = _Launches()
    monkeypatch.setattr(kernels, "_tk", counter.module)
    with torch.inference_mode(), counter:
        model.prefill_static(ids, meta, model.new_cache(64), 64, torch.empty(vocab, device=DEVICE))
    assert len(counter.triton) == 2 + 8 * layers
    assert counter.triton[1:9].count("rows_matmul_kernel") == 4
    assert counter.torch == ["sub", "index_select"]
    counter.triton.clear()
    counter.torch.clear()
    rows = torch.empty(16, vocab, device=DEVICE)
    with torch.inference_mode(), counter:
        model.verify_static(ids, meta, model.new_cache(64), 64, rows)
    assert len(counter.triton) == 2 + 8 * layers and counter.torch == []


@pytest.mark.parametrize("kernel_path", ["triton", "torch"])
def test_a_runner_on_the_kernels_compiles_the_long_prefill_at_start(
    kernel_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With graphs on the Triton kernels, the runner runs one prefill past FUSED_ROWS at start-up,
    so the kernel no capture launches (SiLU * up) compiles then, not at the first long prompt."""
    monkeypatch.setattr(fused, "FUSED_ROWS", 4)
    launched: list[int] = []
    real = kernels.silu_mul

    def spy(gate_up: torch.Tensor, *args: Any) -> torch.Tensor:
        launched.append(gate_up.shape[0])
        return real(gate_up, *args)

    monkeypatch.setattr(kernels, "silu_mul", spy)
    model = random_model("tiny", DEVICE, torch.float32, seed=5)
    model.kernels = kernel_path  # type: ignore[assignment]
    runner = Runner(model, 64, capture=Replay(), prefill_buckets=(16,))
    try:  # one launch a block, of five rows
        layers = model.config.num_hidden_layers
        assert launched == ([5] * layers if kernel_path == "triton" else [])
    finally:
        runner.close()
