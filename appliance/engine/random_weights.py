"""Seeded random weights of a real model's shape, made on the device: latency work without a download.

Decode speed at batch 1 depends on the shape and the bytes per weight, not on the values, so an
8B-shaped model of random weights times like the real one while nothing of 16 GB is downloaded or
carried to the GPU host. Each tensor is drawn where it will live, one at a time as the model asks
for it, from a generator seeded by (seed, tensor name): the same seed gives the same model whatever
the load order. Initialisation follows torch's own modules: Linear weights uniform in
±1/sqrt(fan_in), Embedding normal(0, 1), RMSNorm weights one.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from appliance.engine.linear import WeightQuant
from appliance.engine.llama import LlamaConfig, LlamaModel
from engine_build.hf_config import parse_config

__all__ = ["SHAPES", "RandomTensors", "random_config", "random_model"]

# config.json contents of the shapes `--random-weights` offers.
SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B's config.json numbers.
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    # The same layout at a size a CPU test runs in milliseconds: GQA, llama3 RoPE scaling, and every
    # linear dimension divisible by 16 so FP8 weights apply.
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def random_config(shape: str) -> LlamaConfig:
    """The config of a named shape; KeyError-free: an unknown name is a ValueError listing them."""
    raw = SHAPES.get(shape)
    if raw is None:
        raise ValueError(f"unknown random-weights shape {shape!r}; known: {', '.join(SHAPES)}")
    return parse_config(raw, Path(f"<random-weights {shape}>"))


class RandomTensors(Mapping[str, torch.Tensor]):
    """HF-named tensors of `config`'s checkpoint, each drawn on `device` when it is looked up."""

    def __init__(self, config: LlamaConfig, device: torch.device, seed: int = 0) -> None:
        self.shapes = LlamaModel.expected_shapes(config)
        self.device = device
        self.seed = seed

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        generator = torch.Generator(device=self.device)
        # 32 bits: the CPU generator (mt19937) keeps only those of a seed.
        generator.manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
        with torch.inference_mode():
            if len(shape) == 1:
                return torch.ones(shape, device=self.device)
            if name == "model.embed_tokens.weight":
                return torch.randn(shape, generator=generator, device=self.device)
            bound = shape[1] ** -0.5
            weight = torch.rand(shape, generator=generator, device=self.device)
            return weight.mul_(2 * bound).sub_(bound)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def random_model(
    shape: str | LlamaConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    fp8: WeightQuant | None = None,
    seed: int = 0,
) -> LlamaModel:
    """A model of a named shape (or a config) with seeded random weights, built on `device`."""
    config = random_config(shape) if isinstance(shape, str) else shape
    device = torch.device(device)
    return LlamaModel(config, RandomTensors(config, device, seed), device, dtype, fp8)
