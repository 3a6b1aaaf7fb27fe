"""AWQ checkpoints: unpacking to the engine's INT4 layers, the refusals, and serving one.

The AWQ checkpoints here are built by the test's own packer, written from the format (eight 4-bit
values per int32, value i of a word in bits 4i..4i+3 holding column 8c + AWQ_ORDER[i]) from known
INT4 weights, zero points and scales, beside a float checkpoint of the weights they stand for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from tritonclient.grpc import model_config_pb2 as mc

from appliance.engine import awq
from appliance.engine.llama import CheckpointError, LlamaModel, load_config
from appliance.engine.loading import load_model
from appliance.engine.options import EngineOptions, check_fit
from appliance.engine.quantized import Int4Linear, dequantize_int4
from appliance.engine.repository import KvCacheParams, ModelEntry
from appliance.tools.tiny_model import TINY_CONFIG
from engine_build.hf_config import parse_config

CPU = torch.device("cpu")
GROUP = 32  # divides every input width of the tiny model (128, 352)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """(rows, cols) ints in [0, 15] -> (rows, cols / 8) int32 in AWQ's packed order."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i in range(8):
            words[:, c] |= values[:, 8 * c + awq.AWQ_ORDER[i]].long() << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_tensors(
    prefix: str, out_features: int, in_features: int, group: int, gen: torch.Generator
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One layer's AWQ tensors and the float32 (out, in) weight they stand for."""
    groups = in_features // group
    q = torch.randint(0, 16, (out_features, in_features), generator=gen)
    z = torch.randint(0, 16, (out_features, groups), generator=gen)
    s = (0.002 + 0.01 * torch.rand(out_features, groups, generator=gen)).half()
    weight = (q - z.repeat_interleave(group, dim=1)).float() * s.float().repeat_interleave(
        group, dim=1
    )
    tensors = {
        prefix + ".qweight": pack_awq(q.t()),  # (in, out / 8)
        prefix + ".qzeros": pack_awq(z.t()),  # (groups, out / 8)
        prefix + ".scales": s.t().contiguous(),  # (groups, out)
    }
    return tensors, weight


def write_pair(
    root: Path, group: int = GROUP, config_changes: dict[str, Any] | None = None
) -> tuple[Path, Path]:
    """(float checkpoint, AWQ checkpoint) of the same tiny model; layers whose inputs the group
    does not divide are left out of the AWQ one."""
    config = dict(TINY_CONFIG) | (config_changes or {})
    shapes = LlamaModel.expected_shapes(parse_config(config, Path("config.json")))
    gen = torch.Generator().manual_seed(7)
    plain: dict[str, torch.Tensor] = {}
    packed: dict[str, torch.Tensor] = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("_proj.weight"):
            out_features, in_features = shape
            if in_features % group:
                continue
            tensors, weight = awq_tensors(
                name.removesuffix(".weight"), out_features, in_features, group, gen
            )
            packed.update(tensors)
            plain[name] = weight
        elif len(shape) == 1:  # float16 values, so that both checkpoints hold the same ones
            plain[name] = (1.0 + 0.02 * torch.randn(shape, generator=gen)).half().float()
        else:
            plain[name] = (0.1 * torch.randn(shape, generator=gen)).half().float()
    float_dir, awq_dir = root / "float", root / "awq"
    for directory, tensors, extra in (
        (float_dir, plain, {}),
        (
            awq_dir,
            {**{k: v.half() for k, v in plain.items() if not k.endswith("_proj.weight")}, **packed},
            {
                "quantization_config": {
                    "quant_method": "awq",
                    "bits": 4,
                    "group_size": group,
                    "zero_point": True,
                    "version": "gemm",
                }
            },
        ),
    ):
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(config | extra))
        save_file(tensors, str(directory / "model.safetensors"))
    return float_dir, awq_dir


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_pair(tmp_path_factory.mktemp("awq"))


def test_unpacking_recovers_the_packed_values_in_the_engine_form() -> None:
    gen = torch.Generator().manual_seed(1)
    tensors, weight = awq_tensors("p", 32, 64, GROUP, gen)
    q, scale, zero = awq.unpack_awq(
        tensors["p.qweight"], tensors["p.qzeros"], tensors["p.scales"], GROUP
    )
    assert q.shape == (32, 64) and scale.shape == zero.shape == (32, 2)
    torch.testing.assert_close(dequantize_int4(q, scale, zero, torch.float32), weight)


def test_unpacking_uses_the_awq_order_not_the_natural_one() -> None:
    values = torch.arange(8).view(1, 8)  # column j holds j
    word = int(pack_awq(values)[0, 0])
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == list(awq.AWQ_ORDER)
    q, _, _ = awq.unpack_awq(
        pack_awq(values.repeat(32, 1)),  # 32 inputs, 8 outputs: output j is j everywhere
        pack_awq(torch.zeros(1, 8, dtype=torch.long)),
        torch.ones(1, 8, dtype=torch.float16),
        32,
    )
    assert q[:, 0].tolist() == list(range(8))


def test_awq_layers_are_the_packed_weights(pair: tuple[Path, Path]) -> None:
    float_dir, awq_dir = pair
    target = load_config(float_dir)
    model = awq.load_awq_model(awq_dir, target, CPU, torch.float32)
    reference = LlamaModel.load(float_dir, CPU, torch.float32)
    for mine, theirs in zip(model.layers, reference.layers, strict=True):
        for name in ("wqkv", "wo", "w13", "w2"):
            layer = getattr(mine, name)
            assert isinstance(layer, Int4Linear) and layer.group_size == GROUP
            torch.testing.assert_close(
                layer.dequantized(torch.float32), getattr(theirs, name).weight, rtol=1e-6, atol=1e-6
            )
    # Three tokens: the CPU INT4 kernel computes in float32 (longer inputs run it in bfloat16).
    ids = [5, 300, 17]
    got = model.forward(ids, model.new_cache(3), 0)
    torch.testing.assert_close(got, reference.forward(ids, reference.new_cache(3), 0))
    assert model.weight_bytes < reference.weight_bytes


def test_awq_model_of_another_model_is_refused(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    _, awq_dir = write_pair(tmp_path, config_changes={"vocab_size": 1024})
    target = load_config(pair[0])
    with pytest.raises(
        CheckpointError, match=r"another model: vocab_size 1024, .* has 2048"
    ) as err:
        awq.load_awq_model(awq_dir, target, CPU, torch.float32)
    assert "\n" not in str(err.value)


def test_layer_whose_inputs_the_group_does_not_divide_is_refused_by_name(tmp_path: Path) -> None:
    float_dir, awq_dir = write_pair(tmp_path, group=64)  # down_proj has 352 inputs
    with pytest.raises(
        CheckpointError, match=r"model.layers.0.mlp.down_proj: shape \(128, 352\) .* group 64"
    ):
        awq.load_awq_model(awq_dir, load_config(float_dir), CPU, torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 8}, "AWQ bits 8 is not supported"),
        ({"version": "gemv"}, "AWQ version 'gemv' is not supported"),
        ({"zero_point": False}, "AWQ zero_point False is not supported"),
        ({"group_size": -1}, "AWQ group_size -1 is not one of 32, 64, 128, 256"),
        ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
    ],
)
def test_awq_variants_the_engine_cannot_load_are_refused(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    quant = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True} | change
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG | {"quantization_config": quant}))
    with pytest.raises(CheckpointError, match=message):
        awq.read_awq_format(tmp_path)


def _entry(directory: Path, hf_dir: Path, awq_dir: Path | None) -> ModelEntry:
    config = mc.ModelConfig(name="m", max_batch_size=1)
    config.parameters["hf_model_dir"].string_value = str(hf_dir)
    if awq_dir is not None:
        config.parameters["awq_checkpoint"].string_value = str(awq_dir)
    return ModelEntry("m", directory, config, hf_dir)


def test_awq_checkpoint_needs_int4_and_sets_its_group(
    tmp_path: Path, pair: tuple[Path, Path]
) -> None:
    float_dir, awq_dir = pair
    entry = _entry(tmp_path, float_dir, awq_dir)
    assert awq.awq_source(entry) == awq_dir.resolve()
    assert awq.awq_source(_entry(tmp_path, float_dir, None)) is None
    assert awq.awq_source(_entry(tmp_path, awq_dir, None)) == awq_dir  # hf_model_dir is AWQ
    options = awq.awq_options(awq_dir, EngineOptions(weights="int4", weight_group=128))
    assert options.weight_group == GROUP and options.weights_label == "int4 (group 32)"
    with pytest.raises(CheckpointError, match="serve it with --weights int4, not dtype"):
        awq.awq_options(awq_dir, EngineOptions())


def test_engine_loads_the_awq_checkpoint_a_model_names(
    tmp_path: Path, pair: tuple[Path, Path]
) -> None:
    float_dir, awq_dir = pair
    entry = _entry(tmp_path, float_dir, awq_dir)
    model, runner = load_model(entry, EngineOptions(weights="int4", cuda_graph="off"))
    try:
        layer = model.layers[0].w2
        assert isinstance(layer, Int4Linear) and layer.group_size == GROUP
        direct = awq.load_awq_model(awq_dir, load_config(float_dir), CPU, torch.float32)
        ids = [3, 1, 4, 1, 5, 9, 2, 6]
        torch.testing.assert_close(model.sequence_logits(ids), direct.sequence_logits(ids))
    finally:
        runner.close()


def test_fit_check_counts_the_awq_layers_bytes(pair: tuple[Path, Path]) -> None:
    float_dir, awq_dir = pair
    config = load_config(float_dir)
    options = awq.awq_options(awq_dir, EngineOptions(weights="int4"))
    kv = KvCacheParams(None, 32, False, None, 0.9)
    plan = check_fit(config, options, kv, 256, 64, 0, free_bytes=8 << 30)
    model = awq.load_awq_model(awq_dir, config, CPU, torch.float32)
    c = config
    embedding = c.vocab_size * c.hidden_size * 4  # read one row per token: not in weight_bytes
    assert plan.weight_bytes == model.weight_bytes + embedding
