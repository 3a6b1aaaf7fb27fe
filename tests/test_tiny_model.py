"""The generated tiny checkpoint, its tokenizer, and the model repository that points at it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jinja2
import pytest
import torch
from google.protobuf import text_format
from tokenizers import Tokenizer
from tritonclient.grpc import model_config_pb2 as mc

from appliance.engine.llama import LlamaModel
from appliance.text.tokenizer import chat_environment
from appliance.tools.model_store import ensure_model
from appliance.tools.tiny_model import (
    CHAT_TEMPLATE,
    CHECKPOINT_FILES,
    ensure_tiny_model,
    write_tiny_model,
)
from engine_build.pbtxt import GUIDED_DECODING_INPUTS
from engine_build.repo import hf_fingerprint
from engine_build.tokenizer_info import TOKENIZER_INFO_FILE

ROUND_TRIPS = [
    "Hello world, the KV cache is fast.",
    "def f(x: int) -> int:\n\treturn x ** 2  # squares",
    "café naïve Zürich crème brûlée Łódź",
    "推理服务器的延迟很低。東京のテキスト",
    "ship it 🚀⚡ now ✅",
    "  two leading spaces and a trailing one ",
    "",
]


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(pair: tuple[Path, Path]) -> Tokenizer:
    return Tokenizer.from_file(str(pair[0] / "tokenizer.json"))


def test_rewrite_is_byte_identical(pair: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "again")
    assert _files(model_dir) == _files(pair[0])
    other = write_tiny_model(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (
        model_dir / "model.safetensors"
    ).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def test_checkpoint_shape_and_size(pair: tuple[Path, Path]) -> None:
    model_dir = pair[0]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"], config["intermediate_size"]) == (
        2048,
        128,
        352,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert 1_000_000 < (model_dir / "model.safetensors").stat().st_size < 8_000_000
    model = LlamaModel.load(model_dir)
    logits = model.forward([1, 300, 301], model.new_cache(8), 0)
    assert logits.shape == (2048,)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_tokenizer_round_trips(tokenizer: Tokenizer, text: str) -> None:
    encoding = tokenizer.encode(text)
    assert encoding.ids[0] == 1  # <s> from the post-processor
    assert tokenizer.decode(encoding.ids, skip_special_tokens=True) == text


def test_tokenizer_layout_is_llama2(tokenizer: Tokenizer) -> None:
    assert tokenizer.get_vocab_size() == 2048
    assert [tokenizer.id_to_token(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    assert [tokenizer.id_to_token(3 + b) for b in range(256)] == [
        f"<0x{b:02X}>" for b in range(256)
    ]
    # Non-Latin text is spelled in UTF-8 bytes: 推 is E6 8E A8.
    assert tokenizer.encode("推").tokens[-3:] == ["<0xE6>", "<0x8E>", "<0xA8>"]
    assert "▁the" in tokenizer.get_vocab()  # a word-initial merge learned from the corpus
    assert tokenizer.encode("</s>", add_special_tokens=False).ids == [2]


def test_chat_template_ends_with_assistant_prompt(pair: tuple[Path, Path]) -> None:
    config = json.loads((pair[0] / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (config["bos_token"], config["eos_token"], config["model_max_length"]) == (
        "<s>",
        "</s>",
        2048,
    )

    template = chat_environment().from_string(config["chat_template"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = template.render(
        messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
    )
    assert text.startswith("<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n")
    assert text.endswith("<|user|>\nBye</s>\n<|assistant|>\n")
    no_prompt = template.render(messages=messages[:2], bos_token="<s>", eos_token="</s>")
    assert not no_prompt.endswith("<|assistant|>\n")
    with pytest.raises(ValueError, match="unsupported role tool"):
        template.render(messages=[{"role": "tool", "content": "x"}], eos_token="</s>")
    with pytest.raises((ValueError, jinja2.TemplateError), match="system message"):
        template.render(messages=messages[1:2] + messages[:1], eos_token="</s>")


def test_config_pbtxt_parses_back(pair: tuple[Path, Path]) -> None:
    model_dir, repo = pair
    model_root = repo / "tensorrt_llm"
    cfg = text_format.Parse((model_root / "config.pbtxt").read_text(), mc.ModelConfig())
    assert (cfg.name, cfg.backend, cfg.max_batch_size) == ("tensorrt_llm", "tensorrtllm", 1)
    assert cfg.model_transaction_policy.decoupled is True
    inputs = {t.name: t for t in cfg.input}
    assert [n for n, t in inputs.items() if not t.optional] == [
        "input_ids",
        "input_lengths",
        "request_output_len",
    ]
    # The input names of the TensorRT-LLM 1.2 template, as a GPU host's repository has them.
    assert inputs["seed"].data_type == mc.TYPE_UINT64
    assert inputs["min_tokens"].data_type == mc.TYPE_INT32
    assert "random_seed" not in inputs and "min_length" not in inputs
    assert inputs["streaming"].data_type == mc.TYPE_BOOL
    assert list(inputs["input_ids"].dims) == [-1]
    outputs = {t.name: list(t.dims) for t in cfg.output}
    assert outputs["output_ids"] == [-1, -1] and outputs["sequence_length"] == [-1]
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["cancellation_check_period_ms"] == "10"
    assert params["exclude_input_in_output"] == "true"
    assert (params["max_seq_len"], params["max_input_len"]) == ("2048", "2047")
    assert "gpt_model_path" not in params and "engine_dir" not in params
    assert Path(params["hf_model_dir"]) == model_dir.resolve()
    assert (model_root / "1").is_dir()
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
        "special_tokens_map.json",
    ):
        assert (model_root / "tokenizer" / name).read_bytes() == (model_dir / name).read_bytes()
    fingerprint = (model_root / "engine_fingerprint").read_text()
    assert fingerprint == hf_fingerprint(model_dir) + "\n"
    assert len(fingerprint.strip()) == 64


def test_ensure_reuses_a_complete_pair_and_rebuilds_a_broken_one(tmp_path: Path) -> None:
    model_dir, repo = ensure_tiny_model(tmp_path)
    weights = model_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path) == (model_dir, repo)
    assert weights.stat().st_mtime_ns == stamp  # untouched

    # A crash between the two steps leaves a model without a repository: only that is written.
    shutil.rmtree(repo)
    ensure_tiny_model(tmp_path)
    assert (repo / "tensorrt_llm" / "engine_fingerprint").is_file()
    assert weights.stat().st_mtime_ns == stamp

    # A checkpoint that no longer matches its fingerprint is rebuilt, not served.
    weights.write_bytes(b"truncated")
    ensure_tiny_model(tmp_path)
    assert weights.stat().st_size > 1_000_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "repo"]  # no staging left


def test_the_tiny_repository_has_guided_decoding_off(pair: tuple[Path, Path]) -> None:
    """Engine servers start on it many times in tests; guided decoding would import xgrammar."""
    model_root = pair[1] / "tensorrt_llm"
    cfg = text_format.Parse((model_root / "config.pbtxt").read_text(), mc.ModelConfig())
    assert cfg.parameters["guided_decoding_backend"].string_value == ""
    assert not {t.name for t in cfg.input} & set(GUIDED_DECODING_INPUTS)
    assert not (model_root / "tokenizer" / TOKENIZER_INFO_FILE).exists()


def test_ensure_rewrites_a_repository_whose_guided_decoding_differs(tmp_path: Path) -> None:
    model_dir, repo = ensure_tiny_model(tmp_path)
    weights = model_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    info = repo / "tensorrt_llm" / "tokenizer" / TOKENIZER_INFO_FILE

    def make(dest: Path) -> None:
        raise AssertionError("the checkpoint is complete; only its repository is rewritten")

    assert ensure_model(tmp_path, make, CHECKPOINT_FILES, guided_decoding=True) == (model_dir, repo)
    assert info.is_file()
    ensure_tiny_model(tmp_path)
    assert not info.exists()
    assert weights.stat().st_mtime_ns == stamp


def test_make_tiny_model_writes_guided_decoding_on_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the ansible role runs on a host whose venv has xgrammar (and, without the option, on
    one without it): the repository is written again when the option changes."""
    from appliance.cli import main

    info = tmp_path / "repo" / "tensorrt_llm" / "tokenizer" / TOKENIZER_INFO_FILE
    assert main(["make-tiny-model", "--dest", str(tmp_path), "--guided-decoding"]) == 0
    config = (tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    cfg = text_format.Parse(config, mc.ModelConfig())
    assert cfg.parameters["guided_decoding_backend"].string_value == "xgrammar"
    assert info.is_file()
    assert main(["make-tiny-model", "--dest", str(tmp_path)]) == 0
    assert not info.exists()
    assert f"repository: {tmp_path / 'repo'}" in capsys.readouterr().out


def test_weights_are_readable_by_other_users(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path)
    assert (model_dir / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_the_same_checkpoint_on_two_hosts_has_one_cache_identity(tmp_path: Path) -> None:
    """Gateways on different hosts share cache entries only if their fingerprints agree: copies
    made at other times, under other paths, agree; a change of content, even one that keeps
    the file's size and modification time, does not."""
    first, _ = ensure_tiny_model(tmp_path / "host-a")
    copy = tmp_path / "host-b" / "model"
    shutil.copytree(first, copy)  # new mtimes, another path
    assert hf_fingerprint(copy) == hf_fingerprint(first)
    weights = copy / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert hf_fingerprint(copy) != hf_fingerprint(first)
