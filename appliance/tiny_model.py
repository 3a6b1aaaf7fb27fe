"""A tiny random-weight Llama checkpoint and the model repository that serves it, built offline.

Tests, the demo and CI need a real model directory (real tokenizer, real safetensors, real
config.pbtxt) on hosts with no network and no GPU. Everything here is derived from a seed and
the corpus shipped in appliance/data, and written byte-for-byte deterministically, so the
repository's engine_fingerprint (and every cache key built on it) is stable across machines.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from google.protobuf import text_format
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from tritonclient.grpc import model_config_pb2 as mc

__all__ = [
    "CHAT_TEMPLATE",
    "TINY_CONFIG",
    "build_tokenizer",
    "ensure_tiny_model",
    "fingerprint_checkpoint",
    "model_config",
    "write_model_repository",
    "write_tiny_model",
]

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
MODEL_NAME = "tensorrt_llm"

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

# What the gateway needs from a checkpoint, copied into the repository's tokenizer/ directory.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "special_tokens_map.json",
)
CHECKPOINT_FILES = ("model.safetensors", *TOKENIZER_FILES)


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
    from appliance.engine.llama import LlamaConfig, LlamaModel

    c = TINY_CONFIG
    config = LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        max_position_embeddings=c["max_position_embeddings"],
    )
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


def write_tiny_model(dest: Path, seed: int = 0) -> Path:
    """Write the checkpoint into dest/model and return that directory.

    Same seed, same bytes: the weights come from a seeded CPU generator, JSON is written with
    sorted keys, and the tokenizer training is deterministic.
    """
    model_dir = Path(dest) / "model"
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


def fingerprint_checkpoint(hf_model_dir: Path) -> str:
    """sha256 over every file of the checkpoint (relative name and content), in name order."""
    h = hashlib.sha256()
    root = Path(hf_model_dir)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


# (name, type, dims, optional); dims [1] tensors get an empty reshape, as in the TRT-LLM template.
_INPUTS: tuple[tuple[str, int, tuple[int, ...], bool], ...] = (
    ("input_ids", mc.TYPE_INT32, (-1,), False),
    ("input_lengths", mc.TYPE_INT32, (1,), False),
    ("request_output_len", mc.TYPE_INT32, (1,), False),
    ("end_id", mc.TYPE_INT32, (1,), True),
    ("pad_id", mc.TYPE_INT32, (1,), True),
    ("temperature", mc.TYPE_FP32, (1,), True),
    ("runtime_top_k", mc.TYPE_INT32, (1,), True),
    ("runtime_top_p", mc.TYPE_FP32, (1,), True),
    ("random_seed", mc.TYPE_UINT64, (1,), True),
    ("min_length", mc.TYPE_INT32, (1,), True),
    ("streaming", mc.TYPE_BOOL, (1,), True),
    ("stop", mc.TYPE_BOOL, (1,), True),
    ("exclude_input_in_output", mc.TYPE_BOOL, (1,), True),
)
_OUTPUTS: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("output_ids", mc.TYPE_INT32, (-1, -1)),
    ("sequence_length", mc.TYPE_INT32, (-1,)),
)


def model_config(hf_model_dir: str, max_seq_len: int) -> mc.ModelConfig:
    """The full `tensorrt_llm` ModelConfig: every parameter literal, none left to defaults.

    The TensorRT-LLM parameters are what a real GPU repository would carry, so the same file
    also passes `engine-build verify`; the appliance engine server reads hf_model_dir and the
    few parameters docs/MODEL_REPOSITORY.md lists, and ignores the rest.
    """
    cfg = mc.ModelConfig(name=MODEL_NAME, backend="tensorrtllm", max_batch_size=1)
    cfg.model_transaction_policy.decoupled = True
    for name, dtype, dims, optional in _INPUTS:
        tensor = cfg.input.add(name=name, data_type=dtype, dims=list(dims), optional=optional)
        if name == "input_ids":
            tensor.allow_ragged_batch = True
        if dims == (1,):
            tensor.reshape.SetInParent()
    for name, dtype, dims in _OUTPUTS:
        cfg.output.add(name=name, data_type=dtype, dims=list(dims))
    cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    params = {
        "hf_model_dir": hf_model_dir,
        "cancellation_check_period_ms": "10",
        "exclude_input_in_output": "true",
        "max_beam_width": "1",
        "gpt_model_type": "inflight_fused_batching",
        "batch_scheduler_policy": "guaranteed_no_evict",
        "kv_cache_free_gpu_mem_fraction": "0.9",
        "enable_kv_cache_reuse": "false",
        "enable_chunked_context": "false",
        "cuda_graph_mode": "true",
        "cuda_graph_cache_size": "1",
        "gpu_device_ids": "0",
        "max_input_len": str(max_seq_len - 1),
        "max_seq_len": str(max_seq_len),
        "max_attention_window_size": str(max_seq_len),
    }
    for key, value in params.items():
        cfg.parameters[key].string_value = value
    return cfg


def write_model_repository(repo: Path, hf_model_dir: Path) -> Path:
    """Write the docs/MODEL_REPOSITORY.md layout for `hf_model_dir` into `repo`; return `repo`.

    hf_model_dir is recorded relative to repo/tensorrt_llm so the pair can be moved together.
    """
    repo = Path(repo)
    hf_model_dir = Path(hf_model_dir)
    model_root = repo / MODEL_NAME
    (model_root / "1").mkdir(parents=True, exist_ok=True)
    (model_root / "1" / ".keep").write_bytes(b"")
    tokenizer_dir = model_root / "tokenizer"
    tokenizer_dir.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(hf_model_dir / name, tokenizer_dir / name)
    relative = os.path.relpath(hf_model_dir.resolve(), model_root.resolve())
    hf_config = json.loads((hf_model_dir / "config.json").read_text(encoding="utf-8"))
    cfg = model_config(Path(relative).as_posix(), int(hf_config["max_position_embeddings"]))
    (model_root / "config.pbtxt").write_text(text_format.MessageToString(cfg), encoding="utf-8")
    (model_root / "engine_fingerprint").write_text(
        fingerprint_checkpoint(hf_model_dir) + "\n", encoding="utf-8"
    )
    return repo


def _complete(model_dir: Path, repo: Path) -> bool:
    """Both halves present and the repository's fingerprint matches the checkpoint on disk."""
    model_root = repo / MODEL_NAME
    needed = [model_dir / n for n in CHECKPOINT_FILES]
    needed += [model_root / "config.pbtxt", model_root / "engine_fingerprint"]
    needed += [model_root / "tokenizer" / n for n in TOKENIZER_FILES]
    if not all(p.is_file() for p in needed) or not (model_root / "1").is_dir():
        return False
    recorded = (model_root / "engine_fingerprint").read_text(encoding="utf-8").strip()
    return recorded == fingerprint_checkpoint(model_dir)


def ensure_tiny_model(root: Path) -> tuple[Path, Path]:
    """Return (root/model, root/repo), creating them unless a complete pair is already there.

    Both are built in a temporary sibling and renamed into place, model first and repository
    last, so a crash leaves either nothing, or a model without a repository, which the next call
    detects (the fingerprint check) and rebuilds; a half-written file is never visible.
    """
    root = Path(root)
    model_dir, repo = root / "model", root / "repo"
    if _complete(model_dir, repo):
        return model_dir, repo
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
    try:
        built_model = write_tiny_model(staging)
        # Same relative layout as the final one, so the recorded "../../model" stays valid.
        built_repo = write_model_repository(staging / "repo", built_model)
        for stale in (repo, model_dir):
            if stale.exists():
                shutil.rmtree(stale)
        os.replace(built_model, model_dir)
        os.replace(built_repo, repo)
    except OSError:
        # Another process may have finished the same pair first; theirs is as good as ours.
        if not _complete(model_dir, repo):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model_dir, repo
