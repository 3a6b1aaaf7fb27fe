"""A tiny random-weight Llama checkpoint and the model repository that serves it, built offline.

Tests, the demo and CI need a real model directory (real tokenizer, real safetensors, real
config.pbtxt) on hosts with no network and no GPU. Everything here is derived from a seed and
the corpus shipped in appliance/data, and the checkpoint is written byte-for-byte
deterministically; its repository comes from engine_build's writer, like any other model's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from appliance.tools.model_store import ensure_model
from engine_build.hf_config import parse_config

__all__ = [
    "CHAT_TEMPLATE",
    "TINY_CONFIG",
    "build_tokenizer",
    "ensure_tiny_model",
    "write_tiny_model",
]

CORPUS = Path(__file__).parents[1] / "data" / "corpus.txt"

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
}

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
BYTE_TOKENS = tuple(f"<0x{i:02X}>" for i in range(256))

# Zephyr-like layout. Newlines are written as string literals rather than template text so the
# result does not depend on the renderer's trim_blocks/lstrip_blocks settings.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + message['role'] "
    "+ '; use system, user or assistant') }}"
    "{% endif %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message may only come first') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

CHECKPOINT_FILES = (
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "special_tokens_map.json",
)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def _training_lines() -> list[str]:
    """Corpus lines restricted to Latin script, so CJK, emoji, Greek etc. stay out of the vocab
    and always reach the model through byte fallback, which is what the tests want exercised."""
    text = CORPUS.read_text(encoding="utf-8")
    return ["".join(ch for ch in line if ord(ch) <= 0x24F) for line in text.splitlines()]


def build_tokenizer(vocab_size: int = 2048) -> Tokenizer:
    """Train a Llama-2-style byte-fallback BPE on the shipped corpus (deterministic).

    Training uses a Metaspace split so merges never cross word boundaries, exactly as
    SentencePiece does; the served tokenizer then drops the pre-tokenizer like HF's converted
    Llama-2 tokenizer.json. The 256 byte tokens are passed to the trainer as specials only to pin
    them to ids 3..258; in the final tokenizer they are ordinary vocabulary entries (so
    `skip_special_tokens` does not drop them when decoding).
    """
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainee = Tokenizer(BPE(unk_token=UNK, byte_fallback=True))
    trainee.normalizer = normalizer
    trainee.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="never", split=True
    )
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[UNK, BOS, EOS, *BYTE_TOKENS],
        show_progress=False,
    )
    trainee.train_from_iterator(_training_lines(), trainer=trainer)
    trained = json.loads(trainee.to_str())["model"]
    vocab: dict[str, int] = trained["vocab"]
    if len(vocab) != vocab_size:
        # A random model samples every id in its vocab; each must decode to something.
        raise RuntimeError(
            f"tokenizer training produced {len(vocab)} tokens, not {vocab_size}; "
            f"{CORPUS} is too small for this vocab size"
        )
    merges = [tuple(m) for m in trained["merges"]]
    tok = Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=UNK, byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (UNK, BOS, EOS)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, 1)]
    )
    return tok


def _random_weights(seed: int) -> dict[str, torch.Tensor]:
    # Imported here so the tokenizer half of this module does not pull in the engine.
    from appliance.engine.llama import LlamaModel

    c = TINY_CONFIG
    config = parse_config(c, Path("TINY_CONFIG"))
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(LlamaModel.expected_shapes(config).items()):
        if len(shape) == 1:  # norm weights: near 1 so activations keep a sane scale
            tensors[name] = 1.0 + 0.02 * torch.randn(shape, generator=gen)
        else:
            tensors[name] = c["initializer_range"] * torch.randn(shape, generator=gen)
    # A larger lm_head gives logits a spread of about one unit: sampling then visibly depends
    # on temperature/top-k/top-p instead of being near-uniform over 2048 tokens.
    tensors["lm_head.weight"] *= 5.0
    return tensors


def write_tiny_model(dest: Path, name: str = "model", seed: int = 0) -> Path:
    """Write the checkpoint into dest/name and return that directory.

    Same seed, same bytes: the weights come from a seeded CPU generator, JSON is written with
    sorted keys, and the tokenizer training is deterministic.
    """
    model_dir = Path(dest) / name
    model_dir.mkdir(parents=True, exist_ok=True)
    _write_json(model_dir / "config.json", TINY_CONFIG)
    weights = model_dir / "model.safetensors"
    save_file(_random_weights(seed), str(weights), metadata={"format": "pt"})
    # safetensors writes 0600; a service running as another user must be able to read the model.
    weights.chmod(0o644)
    tok = build_tokenizer(TINY_CONFIG["vocab_size"])
    tok.save(str(model_dir / "tokenizer.json"))

    def added(content: str) -> dict[str, Any]:
        return {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }

    _write_json(
        model_dir / "tokenizer_config.json",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "added_tokens_decoder": {str(i): added(t) for i, t in enumerate((UNK, BOS, EOS))},
            "bos_token": BOS,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": EOS,
            "legacy": False,
            "model_max_length": TINY_CONFIG["max_position_embeddings"],
            "pad_token": None,
            "padding_side": "left",
            "tokenizer_class": "LlamaTokenizerFast",
            "unk_token": UNK,
        },
    )
    _write_json(
        model_dir / "special_tokens_map.json",
        {"bos_token": added(BOS), "eos_token": added(EOS), "unk_token": added(UNK)},
    )
    return model_dir


def ensure_tiny_model(root: Path, guided_decoding: bool = False) -> tuple[Path, Path]:
    """Return (root/model, root/repo), creating them unless a complete pair is already there (a
    repository whose guided decoding is not `guided_decoding` is written again).

    By default the repository has guided decoding off: tests start engine servers on it many
    times, and a model with guided decoding imports xgrammar at load (seconds). Tests of guided
    decoding write their own repository of the same checkpoint with it on; a host provisioned with
    the tiny model asks for it on where its venv has xgrammar.
    """
    return ensure_model(
        root,
        lambda d: write_tiny_model(d.parent, d.name),
        CHECKPOINT_FILES,
        guided_decoding=guided_decoding,
    )
