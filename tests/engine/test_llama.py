"""The decoder: KV-cache equivalence, GQA shapes, HF parity, and checkpoint diagnostics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from appliance.engine.linear import PlainLinear
from appliance.engine.llama import CheckpointError, LlamaModel, load_config
from appliance.tools.tiny_model import write_tiny_model
from tests.engine.conftest import MICRO_CONFIG, write_micro_checkpoint

TOKENS = [1, 5, 17, 42, 3, 88, 60, 7, 7, 19, 33, 96]


def test_config_reads_gqa_and_head_dim(micro_dir: Path) -> None:
    config = load_config(micro_dir)
    assert config.num_attention_heads == 6
    assert config.num_key_value_heads == 2
    assert config.head_dim == 8
    assert config.eos_token_ids == (2,)
    assert config.rope_scaling is None


def test_gqa_cache_shapes_and_logits(micro_model: LlamaModel) -> None:
    cache = micro_model.new_cache(16)
    assert cache.k.shape == (2, 2, 16, 8)
    assert cache.v.shape == cache.k.shape
    layer = micro_model.layers[0]
    assert isinstance(layer.wqkv, PlainLinear)
    assert layer.wqkv.weight.shape == ((6 + 2 * 2) * 8, 48)
    logits = micro_model.forward(TOKENS[:4], cache, 0)
    assert logits.shape == (97,)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_incremental_decode_matches_full_prefill(micro_model: LlamaModel) -> None:
    cache = micro_model.new_cache(len(TOKENS))
    incremental = [micro_model.forward(TOKENS[:1], cache, 0)]
    incremental += [micro_model.forward([t], cache, i) for i, t in enumerate(TOKENS[1:], start=1)]
    for i, got in enumerate(incremental):
        full = micro_model.forward(TOKENS[: i + 1], micro_model.new_cache(len(TOKENS)), 0)
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-5)


def test_chunked_prefill_matches_single_prefill(micro_model: LlamaModel) -> None:
    whole = micro_model.forward(TOKENS, micro_model.new_cache(32), 0)
    cache = micro_model.new_cache(32)
    micro_model.forward(TOKENS[:5], cache, 0)
    micro_model.forward(TOKENS[5:9], cache, 5)
    chunked = micro_model.forward(TOKENS[9:], cache, 9)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-5)


def test_forward_rejects_overflow_and_bad_ids(micro_model: LlamaModel) -> None:
    cache = micro_model.new_cache(4)
    with pytest.raises(ValueError, match="do not fit"):
        micro_model.forward(TOKENS[:5], cache, 0)
    with pytest.raises(ValueError, match="token ids"):
        micro_model.forward([97], cache, 0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        micro_model.new_cache(65)


def test_bfloat16_load_returns_float32_logits(micro_dir: Path, micro_model: LlamaModel) -> None:
    model = LlamaModel.load(micro_dir, dtype=torch.bfloat16)
    logits = model.forward(TOKENS, model.new_cache(16), 0)
    assert logits.dtype == torch.float32
    reference = micro_model.forward(TOKENS, micro_model.new_cache(16), 0)
    assert torch.corrcoef(torch.stack([logits, reference]))[0, 1] > 0.99


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
        "tiny-model",
    ],
    ids=["plain-rope", "llama3-rope", "tiny-model"],
)
def test_logits_match_transformers(
    tmp_path: Path, rope_scaling: dict[str, object] | str | None
) -> None:
    """Parity with the reference implementation; the llama3 case uses a short original context
    so the scaled and smoothed frequency bands are all exercised, and the shipped tiny
    checkpoint is checked as written."""
    from transformers import LlamaForCausalLM

    if rope_scaling == "tiny-model":
        model_dir = write_tiny_model(tmp_path)
    else:
        model_dir = write_micro_checkpoint(tmp_path / "m", {"rope_scaling": rope_scaling})
    ours = LlamaModel.load(model_dir)
    hf = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([TOKENS])).logits[0]
    cache = ours.new_cache(len(TOKENS))
    ours.forward(TOKENS[:6], cache, 0)
    for pos in range(6, len(TOKENS)):
        got = ours.forward([TOKENS[pos]], cache, pos)
        torch.testing.assert_close(got, expected[pos], rtol=1e-4, atol=1e-4)


# --- checkpoint diagnostics -------------------------------------------------------------------


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="checkpoint directory missing"):
        LlamaModel.load(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"checkpoint config\.json missing"):
        LlamaModel.load(tmp_path)


def test_missing_weight_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MICRO_CONFIG), encoding="utf-8")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors.*convert them"):
        LlamaModel.load(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    config = {**MICRO_CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"unsupported architecture.*MistralForCausalLM"):
        LlamaModel.load(tmp_path)


def test_unsupported_rope_scaling(tmp_path: Path) -> None:
    config = {**MICRO_CONFIG, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(CheckpointError, match="rope_scaling type 'yarn' is not supported"):
        load_config(tmp_path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    write_micro_checkpoint(tmp_path, drop=(name,))
    with pytest.raises(CheckpointError, match=re.escape(f"tensor '{name}' is missing")):
        LlamaModel.load(tmp_path)


def test_shape_mismatch_is_named(tmp_path: Path) -> None:
    write_micro_checkpoint(tmp_path)
    config = {**MICRO_CONFIG, "intermediate_size": 96}
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(
        CheckpointError, match=r"gate_proj\.weight' has shape \(80, 48\).*\(96, 48\)"
    ):
        LlamaModel.load(tmp_path)


def test_tied_embeddings_and_sharded_index(tmp_path: Path, micro_dir: Path) -> None:
    """Shards found via model.safetensors.index.json; tied checkpoints carry no lm_head."""
    from safetensors.torch import load_file

    tensors = load_file(str(micro_dir / "model.safetensors"))
    del tensors["lm_head.weight"]
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard))
    weight_map = {n: shard for shard, ns in shards.items() for n in ns}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map}), encoding="utf-8"
    )
    config = {**MICRO_CONFIG, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    model = LlamaModel.load(tmp_path)
    assert model.lm_head is model.embed
    assert model.forward(TOKENS, model.new_cache(16), 0).shape == (97,)


def test_transformers_v5_rope_parameters_are_read(tmp_path: Path) -> None:
    """transformers >= 5 nests rope_theta and the scaling type under rope_parameters."""
    config = {k: v for k, v in MICRO_CONFIG.items() if k != "rope_theta"}
    config["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    parsed = load_config(tmp_path)
    assert parsed.rope_theta == 500000.0
    assert parsed.rope_scaling is not None
    assert parsed.rope_scaling.original_max_position_embeddings == 8192


def test_config_reader_and_shared_fixtures_do_not_import_torch() -> None:
    """torch lives only in the engine: the config reader, engine_build and the root conftest
    (imported by every suite) must not pull it in."""
    import subprocess
    import sys

    code = (
        "import sys, tests.conftest, engine_build.hf_config, engine_build.repo, "
        "appliance.tools.model_store, appliance.backends.wire; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
