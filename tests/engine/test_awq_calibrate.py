"""The AWQ calibrator: its checkpoint loads as AWQ, alpha 0 is round-to-nearest, scale folding
keeps the float model's function, and on a model with outlier activation channels it beats
round-to-nearest.

The float models are small random ones (the tiny model's shape, group 32). "Outlier channels" are
planted without changing the model's function: a few channels of each RMSNorm weight are
multiplied by 30 and the same input columns of the linears after it divided by 30 (and likewise
some up_proj rows against down_proj's columns), so those activations are large and their weights
small, the case AWQ is for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from appliance.engine import awq
from appliance.engine import awq_calibrate as ac
from appliance.engine.llama import LlamaConfig, LlamaModel, load_config
from appliance.engine.quantized import GroupQuant, Int4Linear
from appliance.tools.tiny_model import TINY_CONFIG
from engine_build.hf_config import parse_config
from tests.conftest import Tiny
from tests.engine.conftest import random_tensors

CPU = torch.device("cpu")
GROUP = 32
OUTLIERS = [3, 40, 77, 101]
SCALE = 30.0


def float_tensors(config: LlamaConfig, outliers: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    tensors = random_tensors(config, scale=0.05, seed=seed)
    if outliers:
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            for norm, linears in (
                ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
            ):
                tensors[p + norm + ".weight"][OUTLIERS] *= SCALE
                for lin in linears:
                    tensors[p + lin + ".weight"][:, OUTLIERS] /= SCALE
            tensors[p + "mlp.up_proj.weight"][OUTLIERS] *= SCALE
            tensors[p + "mlp.down_proj.weight"][:, OUTLIERS] /= SCALE
    return tensors


def tiny_config(**changes: object) -> tuple[dict[str, object], LlamaConfig]:
    raw = dict(TINY_CONFIG) | changes
    return raw, parse_config(raw, Path("config.json"))


def samples(config: LlamaConfig, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, config.vocab_size, (4, 48), generator=gen)


def write_awq(
    root: Path,
    raw: dict[str, object],
    config: LlamaConfig,
    tensors: dict[str, torch.Tensor],
    grid: int,
    clip: bool,
) -> tuple[Path, list[ac.LayerPlan]]:
    plans = ac.calibrate(config, tensors, samples(config), GROUP, grid, clip)
    packed = ac.quantize_tensors(config, ac.fold(config, tensors, plans), GROUP, torch.float32)
    ac.write_checkpoint(root, raw, packed, GROUP)
    return root, plans


def float_model(config: LlamaConfig, tensors: dict[str, torch.Tensor]) -> LlamaModel:
    return LlamaModel(config, tensors, CPU, torch.float32)


IDS = [5, 300, 17, 9, 1200, 44, 8, 600, 2000, 31, 77, 150]


def logits(model: LlamaModel) -> torch.Tensor:
    return model.sequence_logits(IDS)


def test_calibrated_checkpoint_loads_as_awq_int4_layers(tmp_path: Path) -> None:
    raw, config = tiny_config()
    tensors = float_tensors(config, outliers=True)
    awq_dir, plans = write_awq(tmp_path / "awq", raw, config, tensors, ac.DEFAULT_GRID, True)
    assert awq.read_awq_format(awq_dir) == awq.AwqFormat(GROUP)
    model = awq.load_awq_model(awq_dir, config, CPU, torch.float32)
    for layer in model.layers:
        for name in ("wqkv", "wo", "w13", "w2"):
            linear = getattr(layer, name)
            assert isinstance(linear, Int4Linear) and linear.group_size == GROUP
    # The packed weights are the folded (and clipped) ones quantized.
    folded = ac.fold(config, tensors, plans)
    w = folded["model.layers.1.mlp.down_proj.weight"]
    q, z, s = ac.rtn_int4(w, GROUP)
    want = (q - z.repeat_interleave(GROUP, 1)).float() * s.float().repeat_interleave(GROUP, 1)
    down = model.layers[1].w2
    assert isinstance(down, Int4Linear)
    torch.testing.assert_close(down.dequantized(torch.float32), want)
    reference = logits(float_model(config, tensors))
    got = logits(model)
    assert torch.isfinite(got).all()
    assert (got - reference).pow(2).mean() < 0.1 * reference.pow(2).mean()


def test_alpha_zero_without_clip_is_round_to_nearest(tmp_path: Path) -> None:
    raw, config = tiny_config()
    tensors = float_tensors(config, outliers=True)
    awq_dir, plans = write_awq(tmp_path / "awq", raw, config, tensors, 1, False)
    assert all(set(p.alphas.values()) == {0.0} for p in plans)
    model = awq.load_awq_model(awq_dir, config, CPU, torch.float32)

    def rtn(w: torch.Tensor) -> torch.Tensor:  # AutoAWQ's zero-point RTN, float16 scales
        g = w.reshape(w.shape[0], -1, GROUP)
        s = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)).clamp(min=1e-5) / 15).half()
        s32 = s.float()
        z = (-torch.round(g.amin(-1, keepdim=True) / s32)).clamp(0, 15)
        q = (torch.round(g / s32) + z).clamp(0, 15)
        return ((q - z) * s32).reshape(w.shape)

    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        parts = {
            "wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "wo": ("self_attn.o_proj",),
            "w13": ("mlp.gate_proj", "mlp.up_proj"),
            "w2": ("mlp.down_proj",),
        }
        for name, hf in parts.items():
            want = torch.cat([rtn(tensors[p + h + ".weight"]) for h in hf])
            got = getattr(layer, name).dequantized(torch.float32)
            assert torch.equal(got, want), name
        assert torch.equal(layer.attn_norm, tensors[p + "input_layernorm.weight"])
        assert torch.equal(layer.mlp_norm, tensors[p + "post_attention_layernorm.weight"])


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_folding_the_scales_keeps_the_float_model(kv_heads: int) -> None:
    _, config = tiny_config(num_key_value_heads=kv_heads)
    tensors = float_tensors(config, outliers=True)
    plans = ac.calibrate(config, tensors, samples(config), GROUP, ac.DEFAULT_GRID, clip=False)
    # With grouped-query attention o_proj is not scaled into v_proj (as AutoAWQ).
    assert all(("vo" in p.scales) == (kv_heads == 4) for p in plans)
    assert any(alpha > 0 for p in plans for alpha in p.alphas.values())
    folded = ac.fold(config, tensors, plans)
    changed = "model.layers.0.input_layernorm.weight"
    assert not torch.allclose(folded[changed], tensors[changed])
    torch.testing.assert_close(
        logits(float_model(config, folded)),
        logits(float_model(config, tensors)),
        rtol=1e-4,
        atol=1e-4,
    )


def test_awq_beats_round_to_nearest_on_outlier_channels(tmp_path: Path) -> None:
    raw, config = tiny_config()
    tensors = float_tensors(config, outliers=True)
    reference = logits(float_model(config, tensors))

    def error(model: LlamaModel) -> float:
        return float((logits(model) - reference).pow(2).mean())

    awq_dir, _ = write_awq(tmp_path / "awq", raw, config, tensors, ac.DEFAULT_GRID, True)
    rtn_dir, _ = write_awq(tmp_path / "rtn", raw, config, tensors, 1, False)
    calibrated = error(awq.load_awq_model(awq_dir, config, CPU, torch.float32))
    rtn = error(awq.load_awq_model(rtn_dir, config, CPU, torch.float32))
    engine_rtn = error(LlamaModel(config, tensors, CPU, torch.float32, GroupQuant(4, GROUP)))
    assert calibrated < 0.5 * rtn
    assert calibrated < 0.5 * engine_rtn


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance", "awq-quantize", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_cli_writes_a_checkpoint_the_engine_loads(tiny: Tiny, tmp_path: Path) -> None:
    out = tmp_path / "awq"
    text = Path(ac.__file__).parents[1] / "data" / "calibration.txt"
    done = _cli(
        "--model", str(tiny.model_dir), "--text", str(text), "--out", str(out),
        "--group", "32", "--samples", "2", "--tokens", "64", "--grid", "4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "layer 1: alpha" in done.stdout
    model = awq.load_awq_model(out, load_config(tiny.model_dir), CPU, torch.float32)
    assert isinstance(model.layers[0].w2, Int4Linear)
    assert (out / "tokenizer.json").is_file()
    assert json.loads((out / "awq_calibration.json").read_text())["samples"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--group", "64"], r"down_proj.weight \(128, 352\).*group 64.*use --group 32"),
        (["--group", "48"], "--group 48: expected one of 32, 64, 128, 256"),
        (["--samples", "0"], "--samples 0: expected 1..256"),
        (["--tokens", "100000"], "--tokens 100000: expected 2..2048"),
        (["--samples", "200", "--tokens", "2048"], "at most 131072 calibration tokens"),
        (["--samples", "256", "--tokens", "512"], r"tokens, --samples 256 x --tokens 512 needs"),
        (["--text", "/nonexistent.txt"], "--text /nonexistent.txt: .*No such file"),
    ],
)
def test_cli_refuses_bad_inputs_in_one_line(
    tiny: Tiny, tmp_path: Path, args: list[str], message: str
) -> None:
    base = {"--text": str(Path(ac.__file__).parents[1] / "data" / "calibration.txt")}
    base |= {"--group": "32", "--samples": "2", "--tokens": "32"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    flat = [x for kv in base.items() for x in kv]
    done = _cli("--model", str(tiny.model_dir), "--out", str(tmp_path / "o"), *flat)
    assert done.returncode == 2
    line = done.stderr.strip()
    assert "\n" not in line and line.startswith("appliance awq-quantize: ")
    import re

    assert re.search(message, line), line
    assert not (tmp_path / "o").exists()


def test_cli_refuses_a_non_empty_out_directory(tiny: Tiny, tmp_path: Path) -> None:
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep").write_text("x")
    done = _cli(
        "--model", str(tiny.model_dir), "--text", str(tiny.model_dir / "config.json"),
        "--out", str(tmp_path / "o"), "--group", "32",
    )  # fmt: skip
    assert done.returncode == 2 and "exists and is not an empty directory" in done.stderr
