"""bench/fp8_agreement.py on the tiny random shape (its figure on SmolLM2 is in
docs/PERFORMANCE.md): the scoring it relies on, and that a difference is counted."""

from __future__ import annotations

import torch

from appliance.engine.linear import Fp8Linear, Scaling
from appliance.engine.llama import LlamaModel
from appliance.engine.random_weights import random_model
from bench import fp8_agreement

CPU = torch.device("cpu")


def test_sequence_logits_are_the_per_position_forward_logits() -> None:
    model = random_model("tiny", CPU, torch.float32, seed=2)
    seq = [5, 99, 3, 400, 17, 250]
    logits = model.sequence_logits(seq)
    assert logits.shape == (6, model.config.vocab_size) and logits.dtype == torch.float32
    cache = model.new_cache(6)
    for pos, token in enumerate(seq):
        torch.testing.assert_close(logits[pos], model.forward([token], cache, pos))


def test_top1_agreement_counts_positions_whose_argmax_differs() -> None:
    ref = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]])
    other = ref.clone()
    other[2] = torch.tensor([5.0, 0.0, 3.0])  # a different top token at one position of four
    assert fp8_agreement.top1_agreement(ref, ref) == 1.0
    assert fp8_agreement.top1_agreement(ref, other) == 0.75


def test_agreement_reports_every_fp8_form_on_the_tiny_model() -> None:
    def load(dtype: torch.dtype, fp8: Scaling | None) -> LlamaModel:
        return random_model("tiny", CPU, dtype, fp8=fp8, seed=2)

    seqs = [[7, 300, 42, 11, 5, 9, 100, 3], [1, 2, 3, 4, 5, 6]]
    result = fp8_agreement.agreement(load, seqs)
    assert result["positions"] == 14
    forms = result["top1_agreement_with_bf16"]
    assert set(forms) == {"float32", "fp8 channel W8A8", "fp8 tensor W8A8", "fp8 channel W8A16"}
    assert all(0.0 <= value <= 1.0 for value in forms.values())
    assert forms["float32"] >= 0.9  # bf16 rounding rarely changes the top token


def test_weight_only_form_computes_with_unquantised_activations() -> None:
    model = fp8_agreement.weight_only(random_model("tiny", CPU, torch.bfloat16, fp8="channel"))
    layer = model.layers[0].wqkv
    assert isinstance(layer, fp8_agreement.WeightOnlyFp8)
    assert isinstance(layer.layer, Fp8Linear)
    x = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    w = layer.layer.weight.float() * layer.layer.scale
    torch.testing.assert_close(layer(x).float(), (x.float() @ w.t()).to(torch.bfloat16).float())


def test_emulated_w8a8_is_the_scaled_mm_product() -> None:
    for scaling in ("channel", "tensor"):
        model = random_model("tiny", CPU, torch.bfloat16, fp8=scaling, seed=3)
        layer = model.layers[0].w13
        assert isinstance(layer, Fp8Linear)
        x = torch.randn(5, model.config.hidden_size).to(torch.bfloat16)
        want = layer(x)  # torch._scaled_mm
        got = fp8_agreement.EmulatedW8A8(layer)(x)
        assert got.dtype == want.dtype == torch.bfloat16
        # One bf16 rounding apart at most (the float32 sums run in another order).
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-5)
        assert float((got == want).float().mean()) > 0.99


def test_agreement_through_scaled_mm_matches_the_emulation_on_the_tiny_model() -> None:
    def load(dtype: torch.dtype, fp8: Scaling | None) -> LlamaModel:
        return random_model("tiny", CPU, dtype, fp8=fp8, seed=2)

    seqs = [[7, 300, 42, 11, 5, 9, 100, 3]]
    lines: list[str] = []
    emulated = fp8_agreement.agreement(load, seqs, progress=lines.append)
    real = fp8_agreement.agreement(load, seqs, scaled_mm=True)
    assert emulated["w8a8_product"] == "float32 emulation"
    assert real["w8a8_product"] == "torch._scaled_mm"
    assert emulated["top1_agreement_with_bf16"] == real["top1_agreement_with_bf16"]
    assert len(lines) == 5 and lines[0].startswith("bf16: document 1/1, 8 tokens")
