"""The fused decode step's Triton kernels against the eager torch reference, on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py; on a CUDA host they run compiled). Shapes are tiny: the interpreter runs each
program in numpy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode
from tritonclient.grpc import model_config_pb2 as mc

from appliance.engine import fused, kernels, options, quantized
from appliance.engine.decode import EagerDecode, GraphDecode
from appliance.engine.linear import WeightQuant, dequantize, quantize
from appliance.engine.llama import LlamaModel
from appliance.engine.loading import load_model
from appliance.engine.options import EngineOptions
from appliance.engine.quantized import GroupQuant
from appliance.engine.random_weights import random_model
from appliance.engine.repository import ModelEntry, RepositoryError
from appliance.engine.sampling import SamplingParams, generate

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (rtol, atol) per dtype: float32 differs from torch only in summation order; bf16 by a rounding
# or two of the dtype (its unit in the last place is 2^-8 relative; the interpreter rounds bf16
# toward zero, where torch and compiled kernels round to nearest).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def tiny32() -> LlamaModel:
    return random_model("tiny", DEVICE, torch.float32, seed=5)


@DTYPES
def test_rms_norm_with_and_without_the_residual_add(tiny32: LlamaModel, dtype: torch.dtype) -> None:
    x = torch.randn(3, 96, generator=_gen(1)).to(DEVICE, dtype)  # 96: not a power of two
    r = torch.randn(3, 96, generator=_gen(2)).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(96, generator=_gen(3))).to(DEVICE, dtype)
    ref = tiny32._rms_norm
    out, same = kernels.rms_norm(x, w, tiny32.config.rms_norm_eps)
    assert same is x
    _close(out, ref(x, w), dtype)
    out, total = kernels.rms_norm(x, w, tiny32.config.rms_norm_eps, residual=r)
    # Rounded to the dtype as the eager add is; Triton's interpreter rounds bf16 toward zero
    # (compiled kernels to nearest), so there it may be one unit in the last place off.
    torch.testing.assert_close(total, r + x, rtol=2**-7 if dtype == torch.bfloat16 else 0, atol=0)
    _close(out, ref(r + x, w), dtype)


@DTYPES
def test_embed_rms_norm_gathers_the_rows_and_norms_them(
    tiny32: LlamaModel, dtype: torch.dtype
) -> None:
    table = torch.randn(50, 96, generator=_gen(11)).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(96, generator=_gen(3))).to(DEVICE, dtype)
    ids = torch.tensor([49, 0, 7], device=DEVICE)
    out, rows = kernels.embed_rms_norm(ids, table, w, tiny32.config.rms_norm_eps)
    assert torch.equal(rows, table[ids])
    _close(out, tiny32._rms_norm(table[ids], w), dtype)


@DTYPES
def test_rope_rotates_q_and_k_and_writes_k_and_v_at_the_position(
    tiny32: LlamaModel, dtype: torch.dtype
) -> None:
    c = tiny32.config
    heads, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    qkv = torch.randn(1, (heads + 2 * kv) * d, generator=_gen(4)).to(DEVICE, dtype)
    k_cache = torch.full((kv, 16, d), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full((kv, 16, d), float("nan"), dtype=dtype, device=DEVICE)
    pos = 11
    cos, sin = tiny32.cos.to(dtype), tiny32.sin.to(dtype)
    (q,) = kernels.rope_kv_write(
        qkv, cos, sin, torch.tensor([pos], device=DEVICE), k_cache, v_cache, heads
    )
    q_ref, k_ref, v_ref = torch.split(qkv, [heads * d, kv * d, kv * d], dim=1)
    rope = LlamaModel._rope
    _close(q, rope(q_ref.view(heads, d), cos[pos], sin[pos]), dtype)
    _close(k_cache[:, pos], rope(k_ref.view(kv, d), cos[pos], sin[pos]), dtype)
    assert torch.equal(v_cache[:, pos], v_ref.view(kv, d))
    others = torch.arange(16) != pos
    assert torch.isnan(k_cache[:, others]).all() and torch.isnan(v_cache[:, others]).all()


@DTYPES
def test_silu_mul(dtype: torch.dtype) -> None:
    gate_up = (3 * torch.randn(2, 2 * 80, generator=_gen(5))).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(kernels.silu_mul(gate_up, block=32), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("scaling", ["channel", "tensor"])
def test_fp8_matvec_equals_the_dequantized_product(scaling: str) -> None:
    w = torch.randn(40, 96, generator=_gen(6)) * torch.logspace(-2, 1, 40).unsqueeze(1)
    q, scale = quantize(w, scaling)  # type: ignore[arg-type]
    x = torch.randn(1, 96, generator=_gen(7)).to(torch.bfloat16)
    got = kernels.matvec(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE))
    assert got.shape == (1, 40) and got.dtype == torch.bfloat16
    ref = x.float() @ dequantize(q, scale).t()  # weight-only: x is not quantised
    # float32 accumulation of exact products; the only rounding is the bf16 output's: half a unit
    # in the last place (2^-8) compiled, one (2^-7) in the interpreter, which rounds toward zero.
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2**-7, atol=1e-3)


@DTYPES
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_a_dense_matvec_equals_f_linear(dtype: torch.dtype, gated: bool) -> None:
    w = (torch.randn(40, 96, generator=_gen(12)) / 10).to(DEVICE, dtype)
    x = torch.randn(1, 2 * 96 if gated else 96, generator=_gen(13)).to(DEVICE, dtype)
    got = kernels.matvec(x, w, gated=gated)
    assert got.shape == (1, 40) and got.dtype == dtype
    act = kernels.silu_mul(x) if gated else x
    torch.testing.assert_close(got.float(), F.linear(act.float(), w.float()), rtol=2**-7, atol=1e-3)
    # A float32 result written in place (the output head's logits): the same values as `got`.
    logits = torch.full((1, 40), float("nan"), device=DEVICE)
    assert kernels.matvec(act, w, out=logits) is logits
    assert torch.equal(logits, kernels.matvec(act, w).float())
    with pytest.raises(ValueError, match=r"shape \(1, 95\) for a weight of 96 inputs"):
        kernels.matvec(x[:, :95], w)


@DTYPES
@pytest.mark.parametrize(("pos", "span"), [(0, 8), (5, 8), (70, 128), (200, 256)])
def test_decode_attention_reads_only_the_live_positions(
    dtype: torch.dtype, pos: int, span: int
) -> None:
    heads, kv, d, seq = 6, 2, 16, 256  # a group of 3: not a power of two
    q = torch.randn(heads, d, generator=_gen(8)).to(DEVICE, dtype)
    k = torch.randn(kv, seq, d, generator=_gen(9)).to(DEVICE, dtype)
    v = torch.randn(kv, seq, d, generator=_gen(10)).to(DEVICE, dtype)
    k[:, pos + 1 :] = float("nan")  # unwritten positions may hold anything
    v[:, pos + 1 :] = float("nan")
    got = kernels.decode_attention(q, k, v, torch.tensor([pos], device=DEVICE), span)
    ref = F.scaled_dot_product_attention(
        q.view(kv, heads // kv, d).float(), k[:, : pos + 1].float(), v[:, : pos + 1].float()
    ).view(heads, d)
    assert torch.isfinite(got).all()
    _close(got, ref, dtype)


FORMATS = pytest.mark.parametrize(
    "weights",
    [None, "channel", GroupQuant(8, 32), GroupQuant(4, 32)],
    ids=["bf16", "fp8", "int8", "int4"],
)


@FORMATS
def test_a_folded_product_equals_its_launches_one_after_the_other(
    weights: WeightQuant | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode step's folds against the unfolded launches, each format's kernel: the residual
    add in a product (with the squares by tile), RMSNorm in the product after it, and RoPE with
    the KV write in the qkv product."""
    monkeypatch.setattr(quantized, "_int4_kernel", lambda weight: "dequantize")
    model = random_model("tiny", DEVICE, torch.bfloat16, weights, seed=5)
    c, layer = model.config, model.layers[1]
    eps, heads, pos = c.rms_norm_eps, c.num_attention_heads, 13
    wqkv, wo, w13 = (fused._token_weight(w) for w in (layer.wqkv, layer.wo, layer.w13))
    assert wqkv is not None and wo is not None and w13 is not None
    attn = torch.randn(1, heads * c.head_dim, generator=_gen(21)).to(DEVICE, torch.bfloat16)
    x = torch.randn(1, c.hidden_size, generator=_gen(22)).to(DEVICE, torch.bfloat16)

    residual = kernels.token_product_add(attn, wo, x)
    # s = x + attn @ Wo.T, rounded as the eager add (one unit in the last place in the
    # interpreter, which rounds bf16 toward zero).
    product = fused.matvec(layer.wo, attn)
    torch.testing.assert_close(residual.values, x + product, rtol=2**-7, atol=0)
    assert residual.squares.shape == (wo.tiles(),)
    torch.testing.assert_close(
        residual.squares.sum(), residual.values.float().square().sum(), rtol=1e-5, atol=0
    )

    normed, _ = kernels.rms_norm(residual.values, layer.mlp_norm, eps)
    got = kernels.token_product(kernels.Norm(residual, layer.mlp_norm, eps), w13)
    torch.testing.assert_close(got, fused.matvec(layer.w13, normed), rtol=2**-7, atol=1e-3)

    caches = [torch.full((2, c.num_key_value_heads, 32, c.head_dim), float("nan"),
                         dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]  # fmt: skip
    at = torch.tensor([pos], device=DEVICE)
    q = kernels.token_product(
        kernels.Norm(residual, layer.attn_norm, eps),
        wqkv,
        rope=kernels.Rope(model.cos, model.sin, at, caches[0][0], caches[0][1], heads),
    )
    normed, _ = kernels.rms_norm(residual.values, layer.attn_norm, eps)
    q_ref = kernels.rope_kv_write(
        fused.matvec(layer.wqkv, normed),
        model.cos,
        model.sin,
        at,
        caches[1][0],
        caches[1][1],
        heads,
    )
    torch.testing.assert_close(q, q_ref, rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(caches[0], caches[1], rtol=2**-7, atol=1e-3, equal_nan=True)
    assert not caches[0][:, :, pos].isnan().any()  # the position was written, nothing else
    assert caches[0][:, :, :pos].isnan().all() and caches[0][:, :, pos + 1 :].isnan().all()


def test_a_folded_product_refuses_shapes_it_cannot_take(tiny32: LlamaModel) -> None:
    layer = tiny32.layers[0]
    wo, wqkv = fused._token_weight(layer.wo), fused._token_weight(layer.wqkv)
    assert wo is not None and wqkv is not None
    rows = torch.zeros(2, wo.n_in, device=DEVICE)
    with pytest.raises(ValueError, match="2 token rows: this product takes one"):
        kernels.token_product_add(rows, wo, torch.zeros(1, wo.n_out, device=DEVICE))
    with pytest.raises(ValueError, match=r"a residual row of shape \(1, 7\) for 128 outputs"):
        kernels.token_product_add(rows[:1], wo, torch.zeros(1, 7, device=DEVICE))
    cache = torch.zeros(1, 8, 32, device=DEVICE)  # one KV head where the weight has two
    rope = kernels.Rope(tiny32.cos, tiny32.sin, torch.tensor([0]), cache, cache, 4)
    with pytest.raises(ValueError, match="a qkv weight of 256 outputs for 4 heads and 1 KV heads"):
        kernels.token_product(torch.zeros(1, 128, device=DEVICE), wqkv, rope=rope)
    caches = torch.zeros(2, 2, 8, 32, device=DEVICE)
    rope = kernels.Rope(tiny32.cos, tiny32.sin, torch.tensor([0]), caches[0], caches[1], 4)
    with pytest.raises(ValueError, match="RoPE writes q into a tensor of its own"):
        kernels.token_product(
            torch.zeros(1, 128, device=DEVICE), wqkv, rope=rope, out=torch.empty(1, 256)
        )
    wide = kernels.Rope(tiny32.cos[:, :16], tiny32.sin[:, :16], rope.pos, caches[0], caches[1], 4)
    with pytest.raises(ValueError, match="RoPE tables of"):
        kernels.token_product(torch.zeros(1, 128, device=DEVICE), wqkv, rope=wide)
    strided = kernels.Rope(
        tiny32.cos,
        tiny32.sin,
        rope.pos,
        caches[0],
        caches[1].transpose(1, 2).contiguous().transpose(1, 2),
        4,
    )
    with pytest.raises(ValueError, match="K and V caches need one layout"):
        kernels.token_product(torch.zeros(1, 128, device=DEVICE), wqkv, rope=strided)
    x = torch.zeros(1, 128, device=DEVICE)
    residual = kernels.token_product_add(x, wo, x)
    w13 = fused._token_weight(layer.w13)
    assert w13 is not None
    with pytest.raises(ValueError, match=r"a norm weight of shape \(64,\) for 128 inputs"):
        kernels.token_product(kernels.Norm(residual, layer.mlp_norm[:64], 1e-5), w13)
    with pytest.raises(ValueError, match=r"a residual row in torch\.bfloat16 for a product in"):
        kernels.token_product_add(x, wo, x.bfloat16())


def _fused(model: LlamaModel) -> LlamaModel:
    model.kernels = "triton"
    return model


class Replay:
    """A capture that replays the body eagerly (the graph contract is tested in test_gpu_path)."""

    def __call__(self, body: object) -> object:
        return body


@pytest.fixture
def few_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 output rows a matvec program, not 8, for tests of whole steps: the interpreter's time
    goes per program, and which program sums a row does not change its sum (every input of the
    tiny shape is in one column tile)."""
    cols = kernels.MATVEC_TILES["matvec"][1]
    assert cols >= 256  # the tiny shape's widest input
    monkeypatch.setitem(kernels.MATVEC_TILES, "matvec", (64, cols))


FOLDED = pytest.mark.parametrize("folded", [False, True], ids=["nine", "folded"])


@FOLDED
@pytest.mark.usefixtures("few_programs")
def test_the_fused_step_gives_the_eager_tokens_over_64_steps_in_float32(
    folded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused, "FOLDED", folded)
    eager = random_model("tiny", DEVICE, torch.float32, seed=5)
    stepped = _fused(random_model("tiny", DEVICE, torch.float32, seed=5))
    prompt = [7, 300, 42, 11, 5]
    cache = stepped.new_cache(128)
    step = GraphDecode(stepped, cache, Replay(), smallest_span=32)  # type: ignore[arg-type]
    greedy = SamplingParams(top_k=1)
    got = list(generate(stepped, prompt, 64, None, greedy, cache=cache, decode=step))
    assert got == list(generate(eager, prompt, 64, None, greedy))
    # Logits along the same tokens, step by step.
    ref_cache = eager.new_cache(128)
    eager.forward(prompt, ref_cache, 0)
    seq = prompt + got
    for pos in range(len(prompt), len(prompt) + 8):
        expected = eager.forward([seq[pos]], ref_cache, pos)
        torch.testing.assert_close(step(seq[pos], pos), expected, rtol=1e-4, atol=1e-4)


@FOLDED
@pytest.mark.parametrize("fp8", [None, "channel"], ids=["bf16", "fp8-w8a16"])
def test_the_fused_step_stays_close_to_eager_in_bf16(
    fp8: str | None, folded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused, "FOLDED", folded)
    reference = random_model("tiny", DEVICE, torch.float32, seed=5)
    stepped = _fused(random_model("tiny", DEVICE, torch.bfloat16, fp8=fp8, seed=5))  # type: ignore[arg-type]
    prompt = [7, 300, 42, 11, 5, 9, 100]
    cache, ref_cache = stepped.new_cache(64), reference.new_cache(64)
    step = GraphDecode(stepped, cache, Replay(), smallest_span=16)  # type: ignore[arg-type]
    stepped.forward(prompt[:3], cache, 0)
    reference.forward(prompt[:3], ref_cache, 0)
    for pos in range(3, len(prompt)):
        got = step(prompt[pos], pos)
        ref = reference.forward([prompt[pos]], ref_cache, pos)
        err = float((got - ref).norm() / ref.norm())
        # bf16 alone is ~0.004 from float32 here; FP8 weights add ~0.01 (test_gpu_path's bound).
        assert err < (0.01 if fp8 is None else 0.03), (pos, err)


@pytest.mark.usefixtures("few_programs")
def test_without_graphs_the_decode_step_also_runs_on_the_fused_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--cuda-graph off` with `--kernels triton`: the eager step launches the same fused step."""
    eager = random_model("tiny", DEVICE, torch.float32, seed=5)
    fused = _fused(random_model("tiny", DEVICE, torch.float32, seed=5))
    spans: list[int] = []
    fused_step = fused.decode_static

    def spy(step_in: torch.Tensor, cache: object, span: int, out: torch.Tensor) -> None:
        spans.append(span)
        fused_step(step_in, cache, span, out)  # type: ignore[arg-type]

    monkeypatch.setattr(fused, "decode_static", spy)
    prompt = [7, 300, 42, 11, 5]
    cache = fused.new_cache(600)
    step = EagerDecode(fused, cache)
    greedy = SamplingParams(top_k=1)
    got = list(generate(fused, prompt, 12, None, greedy, cache=cache, decode=step))
    assert got == list(generate(eager, prompt, 12, None, greedy))
    assert spans == [256] * 11  # every decode step, over the smallest span above its position
    eager_cache = eager.new_cache(600)
    eager.forward([1] * 300, eager_cache, 0)
    fused.forward([1] * 300, cache, 0)
    torch.testing.assert_close(
        step(9, 300), eager.forward([9], eager_cache, 300), rtol=1e-4, atol=1e-4
    )
    assert spans[-1] == 512
    with pytest.raises(ValueError, match="outside the cache"):
        step(1, 600)
    with pytest.raises(ValueError, match="token id"):
        step(fused.config.vocab_size, 3)


class _Launches(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the Triton kernels launched through `kernels` and the torch operators called
    outside them; allocations and views launch no kernel on a GPU and are not counted."""

    FREE = frozenset({"empty", "empty_like", "view", "slice", "select", "alias", "as_strided"})

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.triton: list[str] = []
        self.torch: list[str] = []
        self.inside = False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = func.overloadpacket.__name__
        if not self.inside and name not in self.FREE:
            self.torch.append(name)
        return func(*args, **(kwargs or {}))

    def module(self) -> Any:
        """A stand-in for `triton_kernels` whose kernels count their launches."""
        from appliance.engine import triton_kernels

        counter = self

        class Kernel:
            def __init__(self, name: str) -> None:
                self.name = name

            def __getitem__(self, grid: Any) -> Any:
                def launch(*args: Any, **kwargs: Any) -> Any:
                    counter.triton.append(self.name)
                    counter.inside = True
                    try:
                        return getattr(triton_kernels, self.name)[grid](*args, **kwargs)
                    finally:
                        counter.inside = False

                return launch

        class Module:
            def __getattr__(self, name: str) -> Kernel:
                return Kernel(name)

        return Module()


def _a_step_to_take(
    weights: WeightQuant | None, monkeypatch: pytest.MonkeyPatch
) -> tuple[LlamaModel, Any, torch.Tensor, torch.Tensor]:
    """A tiny bf16 model on the fused kernels in `weights`' format (INT4 in the layout a CUDA
    device gets), its cache after a 3-token prompt, the next step's input and a logits buffer."""
    monkeypatch.setattr(quantized, "_int4_kernel", lambda weight: "dequantize")
    model = _fused(random_model("tiny", DEVICE, torch.bfloat16, weights, seed=5))
    cache = model.new_cache(64)
    model.forward([7, 300, 42], cache, 0)
    step_in = torch.tensor([9, 3], device=DEVICE)
    logits = torch.empty(model.config.vocab_size, dtype=torch.float32, device=DEVICE)
    return model, cache, step_in, logits


def _count_a_step(
    counter: _Launches,
    model: LlamaModel,
    cache: Any,
    step_in: torch.Tensor,
    logits: torch.Tensor,
) -> None:
    """One decode step (span 16) into `logits`, its launches counted afresh in `counter`."""
    counter.triton.clear()
    counter.torch.clear()
    with torch.inference_mode(), counter:
        model.decode_static(step_in, cache, 16, logits)


@FORMATS
def test_a_fused_step_launches_nine_kernels_a_block_and_nothing_else(
    weights: WeightQuant | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every format: 2 + 9 * layers launches a token, all of them Triton kernels. With the
    model-dtype products on cuBLAS: 1 + 6 * layers Triton kernels, 4 * layers + 1 products and
    the copy of the logits into float32."""
    model, cache, step_in, logits = _a_step_to_take(weights, monkeypatch)
    layers = model.config.num_hidden_layers
    counter = _Launches()
    monkeypatch.setattr(kernels, "_tk", counter.module)
    _count_a_step(counter, model, cache, step_in, logits)
    assert len(counter.triton) == 2 + 9 * layers and counter.torch == []
    per_block = counter.triton[1:10]
    assert per_block.count("rms_norm_kernel") == 2 and "silu_mul_kernel" not in per_block
    if weights is None:
        monkeypatch.setattr(fused, "DENSE_PRODUCTS", "torch")
        _count_a_step(counter, model, cache, step_in, torch.empty_like(logits))
        assert len(counter.triton) == 1 + 6 * layers
        products = ["mm" if op in ("linear", "addmm") else op for op in counter.torch]
        assert products == ["mm"] * (4 * layers + 1) + ["copy_"], counter.torch


@FORMATS
def test_a_folded_step_launches_six_kernels_a_block_and_nothing_else(
    weights: WeightQuant | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every format: 2 + 6 * layers launches a token (the norms and RoPE inside the products),
    and the same logits as the nine-launch step. With the model-dtype products on cuBLAS
    nothing folds: the nine-launch step runs."""
    model, cache, step_in, logits = _a_step_to_take(weights, monkeypatch)
    layers = model.config.num_hidden_layers
    model.decode_static(step_in, cache, 16, logits)
    monkeypatch.setattr(fused, "FOLDED", True)
    counter = _Launches()
    monkeypatch.setattr(kernels, "_tk", counter.module)
    folded = torch.empty_like(logits)
    _count_a_step(counter, model, cache, step_in, folded)
    assert len(counter.triton) == 2 + 6 * layers and counter.torch == []
    per_block = counter.triton[1:7]
    assert "rms_norm_kernel" not in per_block and "rope_kv_write_kernel" not in per_block
    # bf16 logits of the same step: a norm's statistic summed in another order may move a
    # rounding by one unit in the last place.
    torch.testing.assert_close(folded, logits, rtol=2e-2, atol=2e-2)
    if weights is None:
        monkeypatch.setattr(fused, "DENSE_PRODUCTS", "torch")
        _count_a_step(counter, model, cache, step_in, torch.empty_like(logits))
        assert len(counter.triton) == 1 + 6 * layers
        assert "rope_kv_write_kernel" in counter.triton


def test_a_head_the_kernels_cannot_tile_is_refused_or_decoded_on_torch(
    micro_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU's tl.dot takes at least 16 values a product and a head is one power-of-two tile:
    `--kernels triton` refuses such a model before its weights load, `auto` decodes it on torch."""
    assert kernels.model_problem(128) is None and kernels.model_problem(16) is None
    assert (
        kernels.model_problem(80)
        == "head_dim 80: the Triton kernels take a power of two of at least 16"
    )
    config = mc.ModelConfig(name="m", max_batch_size=1)
    config.parameters["hf_model_dir"].string_value = str(micro_dir)
    entry = ModelEntry("m", tmp_path, config, micro_dir)  # the micro model's heads are 8 wide
    with pytest.raises(RepositoryError) as refused:
        load_model(entry, EngineOptions(kernels="triton", cuda_graph="off"))
    assert str(refused.value) == (
        "--kernels triton: head_dim 8: the Triton kernels take a power of two of at least 16; "
        "use --kernels torch"
    )
    monkeypatch.setattr(options, "resolve_kernels", lambda choice, device: "triton")
    model, runner = load_model(entry, EngineOptions(cuda_graph="off"))
    try:
        assert model.kernels == "torch"
    finally:
        runner.close()


def test_the_output_head_writes_the_model_dtype_logits_widened() -> None:
    """Greedy decoding reads these logits: they hold what the eager bf16 output head gives (each
    a bf16 value), so near-ties break as in the eager and verify steps."""
    w = (torch.randn(300, 64, generator=_gen(14)) / 8).to(DEVICE, torch.bfloat16)
    h = torch.randn(1, 64, generator=_gen(15)).to(DEVICE, torch.bfloat16)
    logits = torch.empty(1, 300, device=DEVICE)
    kernels.matvec(h, w, out=logits)
    assert torch.equal(logits, logits.bfloat16().float())
    ref = F.linear(h, w).float()
    # Summation order may move a value by one bf16 unit in the last place, no more.
    assert float(((logits - ref).abs() / ref.abs().clamp(min=1e-3)).max()) <= 2**-7
    with pytest.raises(ValueError, match=r"out of shape \(300,\): needs a contiguous \(1, 300\)"):
        kernels.matvec(h, w, out=torch.empty(300, device=DEVICE))


def test_without_a_c_compiler_or_pythons_headers_auto_takes_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a GPU Triton compiles a C launcher per kernel signature at its first launch: a host
    without gcc (or clang, or CC) or Python.h would fail there, in the capture at start-up. Such
    a host decodes on torch under `auto` and is told what to install under `triton`."""
    import shutil
    import sysconfig

    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    why = kernels.triton_problem(cuda)
    assert why is not None and "install gcc, or use --kernels torch" in why
    assert kernels.resolve_kernels("auto", cuda) == "torch"
    monkeypatch.setenv("CC", "/usr/bin/cc")
    real_paths = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {**real_paths(), "include": str(tmp_path)})
    why = kernels.triton_problem(cuda)
    assert why is not None and f"{tmp_path / 'Python.h'} is missing: install python3-dev" in why
    (tmp_path / "Python.h").touch()
    assert kernels.triton_problem(cuda) is None
    assert kernels.resolve_kernels("auto", cuda) == "triton"


def test_programmatic_dependent_launch_is_asked_for_only_where_kernels_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `kernels.PDL` each step kernel takes PDL and Triton's launch option together; the
    interpreter has no grid dependency control, so it never does (bench.kernel_resources
    compiles the PDL kernels for sm_90 and checks that each waits)."""
    monkeypatch.setattr(kernels, "PDL", "early-read")
    assert kernels._pdl() == {"PDL": 0}  # the interpreter, as in this suite
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    assert kernels._pdl() == {"PDL": 2, "launch_pdl": True}
    monkeypatch.setattr(kernels, "PDL", "wait")
    assert kernels._pdl() == {"PDL": 1, "launch_pdl": True}
    monkeypatch.setattr(kernels, "PDL", "off")
    assert kernels._pdl() == {"PDL": 0}
    from appliance.engine import triton_kernels as tk

    assert {
        "off": 0,
        "wait": tk.WAIT.value,
        "early-read": tk.EARLY_READ.value,
    } == kernels._PDL_CONSTEXPR


@FORMATS
@pytest.mark.parametrize("tiles", ["small", "default"])
def test_a_step_launched_early_computes_what_it_computes_launched_as_usual(
    weights: WeightQuant | None, tiles: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With PDL every kernel of the folded step waits first, and with "early-read" a product
    reads its first weight tile before it waits (no kernel writes a weight), then the rest as
    launched as usual. The interpreter has no grid dependency control, so the wait itself is
    left out here; logits and cache must not change by a bit. Small tiles: several input tiles
    a product; default: one, so the loop after the early tile has no pass."""
    from appliance.engine import triton_kernels

    monkeypatch.setattr(quantized, "_int4_kernel", lambda weight: "dequantize")
    if tiles == "small":
        monkeypatch.setitem(kernels.MATVEC_TILES, "matvec", (8, 64))
        monkeypatch.setitem(kernels.MATVEC_TILES, "int8", (8, 32))
        monkeypatch.setitem(kernels.MATVEC_TILES, "int4", (16, 32))
    model = random_model("tiny", DEVICE, torch.bfloat16, weights, seed=5)
    cache = model.new_cache(64)
    model.forward([7, 300, 42], cache, 0)
    step_in = torch.tensor([9, 3], device=DEVICE)
    monkeypatch.setattr(fused, "FOLDED", True)
    results = []
    for pdl in (0, 1, 2):
        monkeypatch.setattr(triton_kernels, "_enter", _no_wait if pdl else triton_kernels._enter)
        monkeypatch.setattr(kernels, "_pdl", lambda pdl=pdl: {"PDL": pdl})
        step_cache = model.new_cache(64)
        logits = torch.empty(model.config.vocab_size, dtype=torch.float32, device=DEVICE)
        with torch.inference_mode():
            step_cache.k.copy_(cache.k)
            step_cache.v.copy_(cache.v)
            model.decode_static(step_in, step_cache, 16, logits)
        results.append((logits, step_cache.k, step_cache.v))
    for got in results[1:]:  # bit for bit; unwritten cache positions hold what they held
        for a, b in zip(got, results[0], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_a_partial_last_tile_adds_and_sums_only_its_live_rows() -> None:
    """100 outputs in tiles of 8: the last tile's 4 masked rows add nothing to the residual's
    squares, and the norm after it (13 sums) equals the norm's own launch."""
    w = (torch.randn(100, 96, generator=_gen(25)) / 10).to(DEVICE, torch.bfloat16)
    x = torch.randn(1, 96, generator=_gen(26)).to(DEVICE, torch.bfloat16)
    base = torch.randn(1, 100, generator=_gen(27)).to(DEVICE, torch.bfloat16)
    residual = kernels.token_product_add(x, kernels.TokenWeight.dense(w), base)
    torch.testing.assert_close(residual.values, base + kernels.matvec(x, w), rtol=2**-7, atol=0)
    assert residual.squares.shape == (13,)
    torch.testing.assert_close(
        residual.squares.sum(), residual.values.float().square().sum(), rtol=1e-5, atol=0
    )
    g = (1 + 0.1 * torch.randn(100, generator=_gen(28))).to(DEVICE, torch.bfloat16)
    w2 = (torch.randn(40, 100, generator=_gen(29)) / 10).to(DEVICE, torch.bfloat16)
    got = kernels.token_product(kernels.Norm(residual, g, 1e-5), kernels.TokenWeight.dense(w2))
    normed, _ = kernels.rms_norm(residual.values, g, 1e-5)
    torch.testing.assert_close(got, kernels.matvec(normed, w2), rtol=2**-7, atol=1e-3)


@triton.jit  # type: ignore[untyped-decorator]
def _no_wait(PDL: tl.constexpr) -> None:
    """`triton_kernels._enter` without its grid dependency control, which the interpreter lacks."""
    pass
