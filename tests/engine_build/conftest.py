"""Fixtures: HF checkpoints made from the public config.json fixtures, spec files, and a fake
TensorRT-LLM installation (a real virtual environment whose package metadata says
``tensorrt_llm <version>`` and whose quantize.py / trtllm-build are the stand-ins in
fake_trtllm/)."""

from __future__ import annotations

import json
import shutil
import sys
import venv
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import byte_level_tokenizer

HERE = Path(__file__).parent
DATA = HERE / "data"
FAKE = HERE / "fake_trtllm"

EOS_TOKEN = "<|eot_id|>"
EOS_ID = 2
TOKENIZER_JSON = byte_level_tokenizer(
    {"a": 0, "b": 1},
    [
        {
            "id": EOS_ID,
            "content": EOS_TOKEN,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    ],
)


def make_checkpoint(root: Path, model: str = "llama-3.1-8b", **config_overrides: Any) -> Path:
    """A checkpoint directory: the public config.json, tokenizer files, a tiny weights file."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((DATA / model / "config.json").read_text())
    cfg.update(config_overrides)
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "tokenizer.json").write_text(json.dumps(TOKENIZER_JSON))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))
    (root / "model.safetensors").write_bytes(b"\0" * 64)
    return root


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)


def write_spec(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    lines: list[str] = []
    for section, table in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def spec_sections(
    checkpoint: Path, work: Path, venv_dir: Path, **overrides: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """A complete spec as nested dicts; ``overrides`` merges per section."""
    sections: dict[str, dict[str, Any]] = {
        "model": {"hf_model_dir": str(checkpoint), "work_dir": str(work)},
        "precision": {"dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "fp8"},
        "limits": {"max_input_len": 2048, "max_seq_len": 4096, "max_num_tokens": 2048},
        "trtllm": {
            "venv": str(venv_dir),
            "quantize_script": str(venv_dir / "examples" / "quantization" / "quantize.py"),
        },
    }
    for section, table in overrides.items():
        sections.setdefault(section, {}).update(table)
    return sections


def make_fake_trtllm(root: Path, version: str | None = "1.2.1") -> Path:
    """A venv with ``tensorrt_llm`` package metadata (``version`` None: no package at all)."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    site = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = site / "site-packages"
    if version is not None:
        dist = site / f"tensorrt_llm-{version}.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: {version}\n"
        )
    support = root / "fake_support"
    support.mkdir()
    shutil.copy(HERE / "recorded_cli.py", support / "recorded_cli.py")
    (support / "data").mkdir()
    shutil.copy(DATA / "trtllm_1_2_cli.json", support / "data" / "trtllm_1_2_cli.json")
    examples = root / "examples" / "quantization"
    examples.mkdir(parents=True)
    shutil.copy(FAKE / "quantize.py", examples / "quantize.py")
    build = root / "bin" / "trtllm-build"
    build.write_text(f"#!{root / 'bin' / 'python'}\n" + (FAKE / "trtllm_build.py").read_text())
    build.chmod(0o755)
    return root


@pytest.fixture(scope="session")
def fake_trtllm_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str | None], Path]:
    cache: dict[str | None, Path] = {}

    def get(version: str | None = "1.2.1") -> Path:
        if version not in cache:
            cache[version] = make_fake_trtllm(tmp_path_factory.mktemp(f"trtllm-{version}"), version)
        return cache[version]

    return get


@pytest.fixture
def fake_trtllm(fake_trtllm_factory: Callable[[str | None], Path]) -> Path:
    return fake_trtllm_factory("1.2.1")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "hf" / "Llama-3.1-8B")


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """File the fake tools append their argv to."""
    path = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_TRTLLM_CALLS", str(path))
    monkeypatch.delenv("FAKE_TRTLLM_FAIL", raising=False)
    return path


def read_calls(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]
