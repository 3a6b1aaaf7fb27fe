"""The model repository: written from a (fake-)built engine or an HF checkpoint, parsed back with
tritonclient's model_config_pb2, and hand edits caught by verify."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from engine_build import runner
from engine_build.errors import BuildError
from engine_build.pbtxt import GUIDED_DECODING_INPUTS, PERF_METRICS_INPUT, PERF_OUTPUTS
from engine_build.repo import write_hf_repository, write_repository
from engine_build.spec import BuildSpec, load_spec
from engine_build.tokenizer_info import TOKENIZER_INFO_FILE
from engine_build.verify import verify_repository

from .conftest import EOS_ID, EOS_TOKEN, make_checkpoint, read_calls, spec_sections, write_spec


def make_spec(
    tmp_path: Path, checkpoint: Path, venv: Path, **overrides: dict[str, Any]
) -> BuildSpec:
    sections = spec_sections(checkpoint, tmp_path / "work", venv, **overrides)
    return load_spec(write_spec(tmp_path / "spec.toml", sections))


def parse_config(repo: Path) -> model_config_pb2.ModelConfig:
    cfg = model_config_pb2.ModelConfig()
    text_format.Parse((repo / "tensorrt_llm" / "config.pbtxt").read_text(), cfg)
    return cfg


def params(cfg: model_config_pb2.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


@pytest.fixture
def built(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, calls: Path
) -> Callable[..., BuildSpec]:
    """Build with the fake installation and return the spec (overrides per section)."""

    def build(**overrides: dict[str, Any]) -> BuildSpec:
        spec = make_spec(tmp_path, checkpoint, fake_trtllm, **overrides)
        runner.BuildRunner(spec, quiet=True, out=io.StringIO()).run()
        return spec

    return build


def test_repository_from_engine_parses_and_carries_the_latency_settings(
    tmp_path: Path, built: Callable[..., BuildSpec]
) -> None:
    spec = built(runtime={"cuda_graph_cache_size": 4, "cancellation_check_period_ms": 5})
    repo = write_repository(spec, tmp_path / "repo")
    text = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "${" not in text
    cfg = parse_config(repo)
    assert cfg.name == "tensorrt_llm" and cfg.backend == "tensorrtllm"
    assert cfg.max_batch_size == 1
    assert cfg.model_transaction_policy.decoupled is True
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 0
    names = {i.name: i for i in cfg.input}
    assert names["input_ids"].data_type == model_config_pb2.TYPE_INT32
    assert list(names["input_ids"].dims) == [-1]
    assert not names["input_lengths"].optional and names["streaming"].optional
    assert list(names["stop_words_list"].dims) == [2, -1]
    assert names["seed"].data_type == model_config_pb2.TYPE_UINT64
    assert {o.name for o in cfg.output} >= {"output_ids", "sequence_length"}
    p = params(cfg)
    assert p["cuda_graph_mode"] == "true" and p["cuda_graph_cache_size"] == "4"
    assert p["enable_kv_cache_reuse"] == "false"  # engine built without paged context FMHA
    assert p["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert p["cancellation_check_period_ms"] == "5"
    assert p["gpu_device_ids"] == "0"
    assert p["gpt_model_path"] == p["engine_dir"] == str(spec.engine_dir)
    assert p["max_input_len"] == "2048" and p["max_seq_len"] == "4096"
    assert p["gpt_model_type"] == "inflight_fused_batching"
    tok = repo / "tensorrt_llm" / "tokenizer"
    assert (tok / "tokenizer.json").is_file() and (tok / "tokenizer_config.json").is_file()
    assert (tok / "config.json").is_file()
    assert (repo / "tensorrt_llm" / "1").is_dir()
    fp = (repo / "tensorrt_llm" / "engine_fingerprint").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}\n", fp)
    assert verify_repository(repo) == []


def test_kv_reuse_repository_needs_and_gets_a_paged_engine(
    tmp_path: Path, built: Callable[..., BuildSpec]
) -> None:
    spec = built(kv_cache={"enable_reuse": True})
    repo = write_repository(spec, tmp_path / "repo")
    assert params(parse_config(repo))["enable_kv_cache_reuse"] == "true"
    assert verify_repository(repo) == []


def test_every_model_declares_the_perf_metrics_of_the_backend_template(
    tmp_path: Path, built: Callable[..., BuildSpec], calls: Path
) -> None:
    """As the backend's template declares them on every model (a gateway asks for the KV-cache
    reuse outputs from what the config declares), with the block size the engine was built with."""
    spec = built(kv_cache={"enable_reuse": True, "tokens_per_block": 64})
    cfg = parse_config(write_repository(spec, tmp_path / "repo"))
    flag = next(i for i in cfg.input if i.name == PERF_METRICS_INPUT)
    assert flag.data_type == model_config_pb2.TYPE_BOOL and flag.optional
    assert list(flag.dims) == [1]
    outputs = {o.name: (o.data_type, list(o.dims)) for o in cfg.output}
    for name, dtype in PERF_OUTPUTS:
        assert outputs[name] == (dtype, [1]), name
    assert outputs["kv_cache_reused_blocks"][0] == model_config_pb2.TYPE_INT32
    argv = next(c["argv"] for c in read_calls(calls) if "--tokens_per_block" in c["argv"])
    built_with = argv[argv.index("--tokens_per_block") + 1]
    assert params(cfg)["tokens_per_block"] == built_with == "64"


def test_hf_only_repository_sets_hf_model_dir_for_the_engine_server(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path
) -> None:
    """What the appliance engine server needs (docs/MODEL_REPOSITORY.md): hf_model_dir pointing
    at a Llama checkpoint with config.json, weights and tokenizer.json; batch 1; no engine."""
    spec = make_spec(tmp_path, checkpoint, fake_trtllm)
    repo = write_repository(spec, tmp_path / "repo", hf_only=True)
    cfg = parse_config(repo)
    p = params(cfg)
    hf = Path(p["hf_model_dir"])
    assert hf.is_absolute() and hf == checkpoint.resolve()
    assert (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file()
    assert list(hf.glob("*.safetensors"))
    assert "gpt_model_path" not in p and "engine_dir" not in p
    assert cfg.max_batch_size == 1
    assert p["exclude_input_in_output"] == "true"
    assert verify_repository(repo) == []


def test_engine_repository_also_carries_hf_model_dir(
    tmp_path: Path, built: Callable[..., BuildSpec], checkpoint: Path
) -> None:
    repo = write_repository(built(), tmp_path / "repo")
    assert params(parse_config(repo))["hf_model_dir"] == str(checkpoint.resolve())


def test_fingerprint_follows_the_engine(
    tmp_path: Path, built: Callable[..., BuildSpec], checkpoint: Path, fake_trtllm: Path
) -> None:
    a = write_repository(built(), tmp_path / "a")
    b = write_repository(built(limits={"max_seq_len": 8192}), tmp_path / "b")
    fa = (a / "tensorrt_llm" / "engine_fingerprint").read_text()
    fb = (b / "tensorrt_llm" / "engine_fingerprint").read_text()
    assert fa != fb


def test_repo_refuses_engine_built_for_other_limits(
    tmp_path: Path, built: Callable[..., BuildSpec], checkpoint: Path, fake_trtllm: Path
) -> None:
    built()
    changed = make_spec(tmp_path, checkpoint, fake_trtllm, limits={"max_seq_len": 8192})
    with pytest.raises(BuildError, match="built with max_seq_len 4096 but the spec says 8192"):
        write_repository(changed, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_repo_refuses_missing_engine(tmp_path: Path, checkpoint: Path, fake_trtllm: Path) -> None:
    spec = make_spec(tmp_path, checkpoint, fake_trtllm)
    with pytest.raises(BuildError, match=r"no engine in .*run `engine-build build` first"):
        write_repository(spec, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_repo_refuses_to_overwrite_without_force(
    tmp_path: Path, built: Callable[..., BuildSpec]
) -> None:
    spec = built()
    repo = write_repository(spec, tmp_path / "repo")
    marker = repo / "tensorrt_llm" / "1" / "old"
    marker.write_text("x")
    with pytest.raises(BuildError, match="exists; pass --force"):
        write_repository(spec, repo)
    write_repository(spec, repo, force=True)
    assert not marker.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".repo")] == []


def test_a_missing_parent_folder_is_refused_and_not_created(
    tmp_path: Path, fake_trtllm: Path
) -> None:
    spec = make_spec(tmp_path, make_checkpoint(tmp_path / "hf"), fake_trtllm)
    out = tmp_path / "out" / "repo"
    with pytest.raises(BuildError, match=f"^{out}: the folder {out.parent} does not exist"):
        write_repository(spec, out, hf_only=True)
    assert not out.parent.exists()


def test_failure_midway_leaves_nothing(tmp_path: Path, fake_trtllm: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "hf")
    (ckpt / "tokenizer.json").unlink()
    spec = make_spec(tmp_path, ckpt, fake_trtllm)
    (tmp_path / "out").mkdir()
    with pytest.raises(BuildError, match="the gateway needs a fast tokenizer"):
        write_repository(spec, tmp_path / "out" / "repo", hf_only=True)
    assert list((tmp_path / "out").iterdir()) == []


def _edit_params(repo: Path, **changes: str | None) -> None:
    path = repo / "tensorrt_llm" / "config.pbtxt"
    cfg = parse_config(repo)
    for key, value in changes.items():
        if value is None:
            del cfg.parameters[key]
        else:
            cfg.parameters[key].string_value = value
    path.write_text(text_format.MessageToString(cfg))


def _edit_text(repo: Path, old: str, new: str) -> None:
    path = repo / "tensorrt_llm" / "config.pbtxt"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


TEXT_EDITS = [
    ("max_batch_size: 1", "max_batch_size: ${triton_max_batch_size}", "unfilled placeholder"),
    ("max_batch_size: 1", "max_batch_size: 4", "!= engine max_batch_size 1"),
    ("decoupled: true", "decoupled: false", "decoupled is not true"),
    (
        "preferred_batch_size: 1",
        "preferred_batch_size: 1\n  max_queue_delay_microseconds: 100",
        "max_queue_delay_microseconds is 100",
    ),
    ('backend: "tensorrtllm"', 'backend: "python"', "backend is 'python'"),
    ('name: "input_lengths"', 'name: "input_length"', "input input_lengths missing"),
    ("model_transaction_policy {", "model_transaction_policy {{", "does not parse"),
    # The gateway sends these tensors as the template declares them; another type or shape
    # loads, then Triton refuses every request.
    (
        'name: "input_ids"\n  data_type: TYPE_INT32',
        'name: "input_ids"\n  data_type: TYPE_INT64',
        "input input_ids is TYPE_INT64, expected TYPE_INT32",
    ),
    (
        'name: "input_ids"\n  data_type: TYPE_INT32\n  dims: -1',
        'name: "input_ids"\n  data_type: TYPE_INT32\n  dims: 1',
        "input input_ids has dims [1], expected [-1]",
    ),
    (
        'name: "temperature"\n  data_type: TYPE_FP32',
        'name: "temperature"\n  data_type: TYPE_FP16',
        "input temperature is TYPE_FP16, expected TYPE_FP32",
    ),
    (
        'name: "output_ids"\n  data_type: TYPE_INT32',
        'name: "output_ids"\n  data_type: TYPE_INT64',
        "output output_ids is TYPE_INT64, expected TYPE_INT32",
    ),
    (
        'name: "input_lengths"\n  data_type: TYPE_INT32',
        'name: "input_lengths"\n  data_type: 99',
        "input input_lengths is data_type 99, expected TYPE_INT32",
    ),
    # Each instance is an executor loading the whole engine and taking its own KV pool.
    (
        "instance_group {\n  count: 1",
        "instance_group {\n  count: 2",
        "instance_group declares 2 model instances",
    ),
    (
        "instance_group {\n  count: 1\n  kind: KIND_CPU\n}",
        "instance_group {\n  count: 1\n  kind: KIND_CPU\n}\n"
        "instance_group {\n  count: 1\n  kind: KIND_CPU\n}",
        "instance_group declares 2 model instances",
    ),
    ("kind: KIND_CPU", "kind: KIND_GPU", "without gpus starts one instance per GPU"),
    ("instance_group {\n  count: 1\n  kind: KIND_CPU\n}", "", "instance_group missing"),
]


@pytest.mark.parametrize(("old", "new", "problem"), TEXT_EDITS)
def test_verify_catches_text_hand_edits(
    tmp_path: Path, built: Callable[..., BuildSpec], old: str, new: str, problem: str
) -> None:
    repo = write_repository(built(), tmp_path / "repo")
    _edit_text(repo, old, new)
    problems = verify_repository(repo)
    assert any(problem in p for p in problems), problems


PARAM_EDITS: list[tuple[dict[str, str | None], str]] = [
    ({"cuda_graph_cache_size": "${cuda_graph_cache_size}"}, "unfilled placeholder"),
    ({"enable_kv_cache_reuse": "true"}, "built without paged context FMHA"),
    ({"enable_kv_cache_reuse": None}, "enable_kv_cache_reuse must be 'true' or 'false'"),
    (
        {"max_seq_len": "8192"},
        "max_seq_len = 8192 (+ 0 for speculation) != engine max_seq_len 4096",
    ),
    ({"max_input_len": "4096"}, "max_input_len = 4096 != engine max_input_len 2048"),
    ({"max_attention_window_size": "9000"}, "max_attention_window_size = 9000 > engine"),
    ({"cuda_graph_mode": "false"}, "cuda_graph_mode is 'false'"),
    ({"kv_cache_free_gpu_mem_fraction": "1.2"}, "not in (0, 1]"),
    ({"cancellation_check_period_ms": "soon"}, "is not an integer"),
    (
        {"cancellation_check_period_ms": "99999999999999999999"},
        "parameter cancellation_check_period_ms must be an integer between 1 and 1000, "
        "got '99999999999999999999'",
    ),
    ({"cuda_graph_cache_size": "0"}, "parameter cuda_graph_cache_size must be an integer between"),
    # Python's int() reads these; the backend's std::stoi reads 1 and fails (default 100).
    ({"cancellation_check_period_ms": "1_000"}, "cancellation_check_period_ms = '1_000' is not"),
    ({"cancellation_check_period_ms": "\uff15"}, "is not an integer"),
    ({"gpu_device_ids": "\uff10"}, "is not a comma-separated id list"),
    ({"gpu_device_ids": "0,1"}, "lists 2 GPUs but the engine has 1 ranks"),
    ({"engine_dir": "/elsewhere"}, "gpt_model_path and engine_dir disagree"),
    (
        {"gpt_model_path": None, "engine_dir": None, "hf_model_dir": None},
        "nothing to serve",
    ),
    ({"hf_model_dir": "/nonexistent/model"}, "hf_model_dir config.json missing"),
    # Read without a default by the backend: a missing key fails the model load.
    ({"tokenizer_dir": None}, "parameter tokenizer_dir missing"),
    ({"xgrammar_tokenizer_info_path": None}, "parameter xgrammar_tokenizer_info_path missing"),
    ({"guided_decoding_backend": None}, "parameter guided_decoding_backend missing"),
    ({"gpt_model_type": None}, "parameter gpt_model_type missing"),
    ({"gpt_model_type": "inflight"}, "gpt_model_type 'inflight' is not one of"),
]


@pytest.mark.parametrize(("changes", "problem"), PARAM_EDITS)
def test_verify_catches_parameter_hand_edits(
    tmp_path: Path,
    built: Callable[..., BuildSpec],
    changes: dict[str, str | None],
    problem: str,
) -> None:
    repo = write_repository(built(), tmp_path / "repo")
    _edit_params(repo, **changes)
    problems = verify_repository(repo)
    assert any(problem in p for p in problems), problems


def test_verify_catches_missing_files(tmp_path: Path, built: Callable[..., BuildSpec]) -> None:
    spec = built()
    repo = write_repository(spec, tmp_path / "repo")
    (spec.engine_dir / "rank0.engine").unlink()
    (repo / "tensorrt_llm" / "tokenizer" / "tokenizer.json").unlink()
    (repo / "tensorrt_llm" / "engine_fingerprint").write_text("not hex\n")
    (repo / "tensorrt_llm" / "1").rmdir()
    problems = verify_repository(repo)
    joined = "\n".join(problems)
    assert "rank0.engine missing" in joined
    assert "tokenizer.json missing" in joined
    assert "not one line of lowercase hex" in joined
    assert "version directory" in joined


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("tokenizer.json", '{"model": ', "cannot load tokenizer"),
        ("tokenizer_config.json", "[1, 2]", "expected a JSON object"),
        ("tokenizer_config.json", '{"chat_template": "{% for %}"}', "does not compile"),
    ],
)
def test_verify_loads_the_tokenizer_as_a_gateway_does(
    tmp_path: Path, built: Callable[..., BuildSpec], name: str, text: str, expected: str
) -> None:
    """A tokenizer file that is there but that a gateway could not load is found before the
    repository is served, not when the gateway starts."""
    repo = write_repository(built(), tmp_path / "repo")
    (repo / "tensorrt_llm" / "tokenizer" / name).write_text(text)
    problems = verify_repository(repo)
    assert len(problems) == 1
    assert problems[0].startswith("a gateway cannot load the tokenizer: ")
    assert expected in problems[0]


def test_verify_on_absent_repository(tmp_path: Path) -> None:
    assert verify_repository(tmp_path)[0].startswith("cannot read")


def _edit_engine_config(spec: BuildSpec, edit: Callable[[dict[str, Any]], None]) -> None:
    """Change the engine's config.json as a damaged or foreign engine would have it."""
    engine_cfg = spec.engine_dir / "config.json"
    data = json.loads(engine_cfg.read_text())
    edit(data)
    engine_cfg.write_text(json.dumps(data))


def test_verify_reports_a_damaged_engine_config_instead_of_crashing(
    tmp_path: Path, built: Callable[..., BuildSpec]
) -> None:
    spec = built()
    repo = write_repository(spec, tmp_path / "repo")
    _edit_engine_config(spec, lambda d: d["pretrained_config"]["mapping"].update(world_size="one"))
    assert any("world_size 'one' is not a count" in p for p in verify_repository(repo))


def test_written_repository_has_every_parameter_the_backend_requires(
    tmp_path: Path, built: Callable[..., BuildSpec]
) -> None:
    repo = write_repository(built(runtime={"guided_decoding": False}), tmp_path / "repo")
    cfg = parse_config(repo)
    p = params(cfg)
    for key in ("tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend"):
        assert p[key] == "", key  # present, and empty: no guided decoding
    assert p["gpt_model_type"] == "inflight_fused_batching"
    # No guide inputs: a gateway sees from the config that this model takes no guide.
    assert not {i.name for i in cfg.input} & set(GUIDED_DECODING_INPUTS)
    assert not (repo / "tensorrt_llm" / "tokenizer" / TOKENIZER_INFO_FILE).exists()
    assert verify_repository(repo) == []


def test_guided_decoding_is_on_by_default_as_the_backend_takes_it(
    tmp_path: Path, built: Callable[..., BuildSpec], checkpoint: Path
) -> None:
    out = tmp_path / "repo"
    write_repository(built(), out)
    # Published under its final name: the paths point there, not at the staging directory.
    cfg = parse_config(out)
    p = params(cfg)
    tokenizer = out / "tensorrt_llm" / "tokenizer"
    assert p["guided_decoding_backend"] == "xgrammar"
    assert p["tokenizer_dir"] == str(tokenizer)
    assert p["xgrammar_tokenizer_info_path"] == str(tokenizer / TOKENIZER_INFO_FILE)
    inputs = {i.name: i for i in cfg.input}
    for name in GUIDED_DECODING_INPUTS:
        declared = inputs[name]  # as the 1.2 template declares them
        assert declared.data_type == model_config_pb2.TYPE_STRING
        assert list(declared.dims) == [1]
        assert declared.optional and declared.allow_ragged_batch
        assert not declared.HasField("reshape")
    info = json.loads((tokenizer / TOKENIZER_INFO_FILE).read_text())
    assert info["encoded_vocab"] == ["a", "b", EOS_TOKEN]  # in id order, added tokens included
    assert info["tokenizer_str"] == (checkpoint / "tokenizer.json").read_text()
    assert info["stop_token_ids"] == [EOS_ID]  # the tokenizer's eos token
    assert verify_repository(out) == []


def test_stop_token_falls_back_to_the_checkpoint_eos_token_id(
    tmp_path: Path, fake_trtllm: Path
) -> None:
    ckpt = make_checkpoint(tmp_path / "hf")  # llama-3.1-8b: eos_token_id [128001, 128008, 128009]
    (ckpt / "tokenizer_config.json").write_text("{}")
    repo = write_repository(make_spec(tmp_path, ckpt, fake_trtllm), tmp_path / "r", hf_only=True)
    info = repo / "tensorrt_llm" / "tokenizer" / TOKENIZER_INFO_FILE
    assert json.loads(info.read_text())["stop_token_ids"] == [128001]


def test_guided_decoding_without_an_end_token_is_refused(tmp_path: Path, fake_trtllm: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "hf")
    (ckpt / "tokenizer_config.json").write_text("{}")
    config = json.loads((ckpt / "config.json").read_text())
    del config["eos_token_id"]
    (ckpt / "config.json").write_text(json.dumps(config))
    spec = make_spec(tmp_path, ckpt, fake_trtllm)
    (tmp_path / "out").mkdir()
    with pytest.raises(
        BuildError, match=r"hf: no end-of-sequence token .* runtime\.guided_decoding = false"
    ):
        write_repository(spec, tmp_path / "out" / "repo", hf_only=True)
    assert list((tmp_path / "out").iterdir()) == []
    off = make_spec(tmp_path, ckpt, fake_trtllm, runtime={"guided_decoding": False})
    assert verify_repository(write_repository(off, tmp_path / "out" / "repo", hf_only=True)) == []


def test_hf_repository_for_the_model_makers_turns_guided_decoding_on_or_off(
    tmp_path: Path, checkpoint: Path
) -> None:
    on = write_hf_repository(checkpoint, tmp_path / "on")
    off = write_hf_repository(checkpoint, tmp_path / "off", guided_decoding=False)
    assert params(parse_config(on))["guided_decoding_backend"] == "xgrammar"
    assert (on / "tensorrt_llm" / "tokenizer" / TOKENIZER_INFO_FILE).is_file()
    assert params(parse_config(off))["guided_decoding_backend"] == ""
    assert not (off / "tensorrt_llm" / "tokenizer" / TOKENIZER_INFO_FILE).exists()
    assert verify_repository(on) == verify_repository(off) == []


def test_verify_refuses_a_guided_repository_without_its_tokenizer_info(
    tmp_path: Path, built: Callable[..., BuildSpec]
) -> None:
    repo = write_repository(built(), tmp_path / "repo")
    (repo / "tensorrt_llm" / "tokenizer" / TOKENIZER_INFO_FILE).unlink()
    problems = verify_repository(repo)
    assert any("tokenizer info file" in p and "missing" in p for p in problems), problems


def _without_input(repo: Path, name: str) -> None:
    path = repo / "tensorrt_llm" / "config.pbtxt"
    cfg = parse_config(repo)
    kept = [i for i in cfg.input if i.name != name]
    del cfg.input[:]
    cfg.input.extend(kept)
    path.write_text(text_format.MessageToString(cfg))


def _edit_tokenizer_info(repo: Path, **changes: Any) -> None:
    path = repo / "tensorrt_llm" / "tokenizer" / TOKENIZER_INFO_FILE
    info = json.loads(path.read_text())
    info.update(changes)
    path.write_text(json.dumps(info))


GUIDED_EDITS: list[tuple[Callable[[Path], None], str]] = [
    (lambda r: _without_input(r, "guided_decoding_guide"), "input guided_decoding_guide missing"),
    (
        lambda r: _without_input(r, "guided_decoding_guide_type"),
        "input guided_decoding_guide_type missing",
    ),
    (
        lambda r: _edit_params(r, guided_decoding_backend="outlines"),
        "guided_decoding_backend is 'outlines'",
    ),
    (
        lambda r: _edit_params(r, xgrammar_tokenizer_info_path=f"tokenizer/{TOKENIZER_INFO_FILE}"),
        "is relative: the backend opens it from tritonserver's working directory",
    ),
    (
        lambda r: _edit_params(r, xgrammar_tokenizer_info_path=""),
        "must be set together (guided decoding on) or both empty",
    ),
    (lambda r: _edit_tokenizer_info(r, stop_token_ids=[]), "stop_token_ids must be a non-empty"),
    (lambda r: _edit_tokenizer_info(r, encoded_vocab="ab"), "encoded_vocab is not a list"),
]


@pytest.mark.parametrize(("edit", "problem"), GUIDED_EDITS)
def test_verify_catches_guided_decoding_hand_edits(
    tmp_path: Path, built: Callable[..., BuildSpec], edit: Callable[[Path], None], problem: str
) -> None:
    repo = write_repository(built(), tmp_path / "repo")
    edit(repo)
    problems = verify_repository(repo)
    assert any(problem in p for p in problems), problems


def _triton_root(root: Path, version: str) -> Path:
    (root / "usr/local/lib/python3.12/dist-packages" / f"tensorrt_llm-{version}.dist-info").mkdir(
        parents=True
    )
    return root


def test_verify_requires_the_engine_version_of_the_triton_root(
    tmp_path: Path, built: Callable[..., BuildSpec]
) -> None:
    spec = built()
    repo = write_repository(spec, tmp_path / "repo")
    assert verify_repository(repo, _triton_root(tmp_path / "same", "1.2.1")) == []
    problems = verify_repository(repo, _triton_root(tmp_path / "older", "1.2.0"))
    assert any("built by TensorRT-LLM 1.2.1 but" in p and "runs 1.2.0" in p for p in problems), (
        problems
    )
    problems = verify_repository(repo, tmp_path / "not-a-root")
    assert any("holds no single tensorrt_llm installation" in p for p in problems), problems


@pytest.mark.parametrize(
    ("version", "problem"),
    [(None, "records no TensorRT-LLM version"), ("1.3.0", "not the 1.2 line")],
)
def test_verify_requires_an_engine_of_the_pinned_line(
    tmp_path: Path, built: Callable[..., BuildSpec], version: str | None, problem: str
) -> None:
    spec = built()
    repo = write_repository(spec, tmp_path / "repo")
    _edit_engine_config(spec, lambda d: d.update(version=version) if version else d.pop("version"))
    assert any(problem in p for p in verify_repository(repo)), verify_repository(repo)


def test_multi_gpu_engines_are_refused_until_triton_launches_them(
    tmp_path: Path, built: Callable[..., BuildSpec]
) -> None:
    spec = built()
    repo = write_repository(spec, tmp_path / "repo")
    _edit_engine_config(spec, lambda d: d["pretrained_config"]["mapping"].update(world_size=2))
    (spec.engine_dir / "rank1.engine").write_bytes(b"engine")
    _edit_params(repo, gpu_device_ids="0,1")
    problems = verify_repository(repo)
    assert any("does not launch multi-GPU engines" in p for p in problems), problems


def test_verify_refuses_a_relative_engine_path(
    tmp_path: Path, built: Callable[..., BuildSpec]
) -> None:
    """The tensorrtllm backend opens gpt_model_path as written, from tritonserver's working
    directory, not from the model's directory: an engine found beside config.pbtxt is not
    the one the backend loads."""
    spec = built()
    repo = write_repository(spec, tmp_path / "repo")
    (repo / "tensorrt_llm" / "engine").symlink_to(spec.engine_dir)
    _edit_params(repo, gpt_model_path="engine", engine_dir="engine")
    problems = verify_repository(repo)
    assert any("gpt_model_path 'engine' is relative" in p for p in problems), problems


@pytest.mark.parametrize("target", ["work_dir", "engine_dir", "hf_model_dir", "hf_parent"])
def test_repo_force_never_replaces_the_engine_or_checkpoint_it_serves(
    tmp_path: Path, built: Callable[..., BuildSpec], target: str
) -> None:
    """--force replaces the output folder: pointed at the work directory or the checkpoint
    (or a folder holding them), it would delete the engine the new repository names."""
    spec = built()
    output = {
        "work_dir": spec.work_dir,
        "engine_dir": spec.engine_dir,
        "hf_model_dir": spec.hf_model_dir,
        "hf_parent": spec.hf_model_dir.parent,
    }[target]
    with pytest.raises(BuildError, match="holds the") as info:
        write_repository(spec, output, force=True)
    assert str(output) in str(info.value)
    assert (spec.engine_dir / "rank0.engine").is_file()
    assert (spec.hf_model_dir / "config.json").is_file()
