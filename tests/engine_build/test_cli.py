"""``engine-build`` end to end through ``cli.main``: exit codes and one-line errors.

The build runs against the fake TensorRT-LLM installation of conftest.py (stand-in scripts).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

from engine_build import cli, gpu
from engine_build.errors import SpecError

from .conftest import make_checkpoint, read_calls, spec_sections, write_spec


def spec_file(tmp_path: Path, checkpoint: Path, venv: Path, **overrides: dict[str, Any]) -> str:
    sections = spec_sections(checkpoint, tmp_path / "work", venv, **overrides)
    return str(write_spec(tmp_path / "spec.toml", sections))


@pytest.fixture
def spec(tmp_path: Path, checkpoint: Path, fake_trtllm: Path) -> str:
    """A spec of the default checkpoint built with the stand-in tools."""
    return spec_file(tmp_path, checkpoint, fake_trtllm)


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("engine-build: error: ")
    return lines[0]


def test_plan_fits_prints_table_and_commands(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = spec_file(tmp_path, checkpoint, fake_trtllm)
    script = tmp_path / "cmds.sh"
    rc = cli.main(["plan", "--spec", spec, "--gpu-memory", "80GiB", "--commands-out", str(script)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "verdict" in out and "FITS" in out and "8.030 B" in out
    assert "trtllm-build --checkpoint_dir" in out and "--qformat fp8" in out
    text = script.read_text()
    assert text.startswith("#!/bin/sh\nset -eu\n") and "trtllm-build" in text


def test_plan_does_not_fit_exits_3_with_table_and_advice(
    tmp_path: Path, fake_trtllm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = make_checkpoint(tmp_path / "hf70", "llama-3.1-70b")
    spec = spec_file(
        tmp_path, ckpt, fake_trtllm, precision={"quantization": "none", "kv_cache_dtype": "auto"}
    )
    script = tmp_path / "cmds.sh"
    rc = cli.main(["plan", "--spec", spec, "--gpu-memory", "80GiB", "--commands-out", str(script)])
    cap = capsys.readouterr()
    assert rc == cli.EXIT_NOFIT == 3
    assert not script.exists()  # no script for a build that would be refused
    assert "DOES NOT FIT" in cap.out and "trtllm-build" in cap.out
    line = one_line_error(cap.err)
    assert "does not fit" in line and "set precision.quantization = 'fp8'" in line


# (case, exit status, message): 2 = the command line or the spec is wrong, 1 = what the work found.
BAD_PLAN = [
    ("missing checkpoint", 1, "checkpoint directory missing"),
    ("unsupported architecture", 1, "unsupported architecture 'Qwen2ForCausalLM'"),
    ("sequence beyond the model", 1, "limits.max_seq_len 4096 > max_position_embeddings 2048"),
    ("bad gpu memory", 2, "--gpu-memory 'lots': expected a number with a unit"),
    ("gpu memory without a unit", 2, "--gpu-memory '80': expected a number with a unit"),
    ("contradictory spec", 2, "key 'limits.max_input_len': 8192 > limits.max_seq_len"),
    ("opt_num_tokens with multiple profiles", 2, "conflicts with limits.multiple_profiles"),
    ("tp not dividing the heads", 1, "parallel.tp_size 3 does not divide num_attention_heads 32"),
    ("unreadable config.json", 1, "checkpoint config.json"),
]


@pytest.mark.parametrize(("case", "status", "message"), BAD_PLAN)
def test_plan_refusals_are_one_line_with_the_exit_status(
    tmp_path: Path,
    fake_trtllm: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    status: int,
    message: str,
) -> None:
    ckpt = tmp_path / "hf"
    overrides: dict[str, dict[str, Any]] = {}
    memory = "80GiB"
    if case == "unsupported architecture":
        make_checkpoint(ckpt, architectures=["Qwen2ForCausalLM"])
    elif case == "sequence beyond the model":
        make_checkpoint(ckpt, max_position_embeddings=2048)
    elif case != "missing checkpoint":
        make_checkpoint(ckpt)
    if case == "bad gpu memory":
        memory = "lots"
    if case == "gpu memory without a unit":
        memory = "80"
    if case == "contradictory spec":
        overrides = {"limits": {"max_input_len": 8192}}
    if case == "opt_num_tokens with multiple profiles":
        overrides = {"limits": {"opt_num_tokens": 256, "multiple_profiles": True}}
    if case == "tp not dividing the heads":
        overrides = {"parallel": {"tp_size": 3}}
    if case == "unreadable config.json":
        (ckpt / "config.json").write_text("{not json")
    spec = spec_file(tmp_path, ckpt, fake_trtllm, **overrides)
    rc = cli.main(["plan", "--spec", spec, "--gpu-memory", memory])
    assert rc == status
    cap = capsys.readouterr()
    assert message in one_line_error(cap.err)
    assert "trtllm-build" not in cap.out


def test_plan_without_gpu_memory_asks_nvml_and_explains_failure(
    spec: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pynvml

    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    assert cli.main(["plan", "--spec", spec]) == 1
    assert "pass --gpu-memory" in one_line_error(capsys.readouterr().err)
    monkeypatch.setattr(gpu, "nvml_total_memory", lambda ids: 80 << 30)
    monkeypatch.setattr(gpu, "nvml_compute_capability", lambda ids: (9, 0))
    assert cli.main(["plan", "--spec", spec]) == 0


def test_gpu_memory_sizes() -> None:
    assert gpu.parse_size("80GiB") == 80 << 30
    assert gpu.parse_size("81559MiB") == 81559 << 20
    assert gpu.parse_size("80GB") == 80 * 10**9
    # A bare number is refused: "80" meant as GiB would be planned as 80 bytes.
    for bare in ("1024", "80", "80G"):
        with pytest.raises(SpecError, match="expected a number with a unit, such as 80GiB"):
            gpu.parse_size(bare)


def test_build_repo_verify_round_trip_with_stand_in_tools(
    tmp_path: Path,
    spec: str,
    calls: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["build", "--spec", spec, "--gpu-memory", "80GiB", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "rebuilt: quantize, trtllm-build" in out
    assert cli.main(["build", "--spec", spec, "--gpu-memory", "80GiB"]) == 0
    assert "rebuilt: nothing" in capsys.readouterr().out
    repo = tmp_path / "repo"
    assert cli.main(["repo", "--spec", spec, "--output", str(repo)]) == 0
    assert cli.main(["verify", str(repo)]) == 0
    assert "ok:" in capsys.readouterr().out
    # A hand edit: KV reuse switched on for an engine without paged context FMHA.
    cfg = repo / "tensorrt_llm" / "config.pbtxt"
    text = cfg.read_text()
    key = text.index('key: "enable_kv_cache_reuse"')
    cfg.write_text(text[:key] + text[key:].replace('"false"', '"true"', 1))
    assert cli.main(["verify", str(repo)]) == 1
    err = capsys.readouterr().err
    assert "paged context FMHA" in err
    assert all(line.startswith("engine-build: error: ") for line in err.strip().splitlines())
    # repo refuses to overwrite without --force
    assert cli.main(["repo", "--spec", spec, "--output", str(repo)]) == 1
    assert "--force" in one_line_error(capsys.readouterr().err)


def test_build_refuses_before_running_any_stand_in_tool(
    tmp_path: Path,
    fake_trtllm_factory: Any,
    calls: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt = make_checkpoint(tmp_path / "hf70", "llama-3.1-70b")
    spec = spec_file(tmp_path, ckpt, fake_trtllm_factory("1.2.1"))
    assert cli.main(["build", "--spec", spec, "--gpu-memory", "40GiB"]) == 3
    assert read_calls(calls) == []
    capsys.readouterr()
    spec = spec_file(tmp_path, ckpt, fake_trtllm_factory("1.3.0"))
    assert cli.main(["build", "--spec", spec, "--gpu-memory", "80GiB"]) == 1
    assert "too new" in one_line_error(capsys.readouterr().err)
    assert read_calls(calls) == []


def test_stand_in_build_failure_exits_1_naming_the_stage(
    tmp_path: Path,
    spec: str,
    calls: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAKE_TRTLLM_FAIL", "trtllm-build")
    assert cli.main(["build", "--spec", spec, "--gpu-memory", "80GiB", "--quiet"]) == 1
    line = one_line_error(capsys.readouterr().err)
    assert "stage trtllm-build failed" in line and "last lines:" in line
    assert not (tmp_path / "work" / "engine").exists()
    assert not (tmp_path / "work" / "engine.partial").exists()
    assert [c["tool"] for c in read_calls(calls)] == ["quantize.py", "trtllm-build"]


def test_repo_hf_only_via_cli(
    tmp_path: Path, spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    assert cli.main(["repo", "--spec", spec, "--output", str(repo), "--hf-only"]) == 0
    assert cli.main(["verify", str(repo)]) == 0


def test_usage_errors_exit_2() -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["plan"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2


def test_verify_refuses_out_of_range_parameters_and_bad_bytes(
    tmp_path: Path, spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    assert cli.main(["repo", "--spec", spec, "--output", str(repo), "--hf-only"]) == 0
    capsys.readouterr()
    cfg = repo / "tensorrt_llm" / "config.pbtxt"
    text = cfg.read_text()
    key = text.index('key: "cancellation_check_period_ms"')
    cfg.write_text(text[:key] + text[key:].replace('"10"', '"99999999999999999999"', 1))
    assert cli.main(["verify", str(repo)]) == 1
    assert one_line_error(capsys.readouterr().err) == (
        f"engine-build: error: {repo}: parameter cancellation_check_period_ms must be an integer "
        "between 1 and 1000, got '99999999999999999999'"
    )
    cfg.write_bytes(b"\xff\xfe")
    assert cli.main(["verify", str(repo)]) == 1
    assert one_line_error(capsys.readouterr().err) == (
        f"engine-build: error: {repo}: {cfg} is not UTF-8 text: invalid start byte"
    )
    missing = tmp_path / "no-root"
    assert cli.main(["verify", str(repo), "--triton-root", str(missing)]) == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"engine-build: error: --triton-root {missing}: not a directory"
    )


def test_out_of_range_spec_and_options_are_one_line_exit_2(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = 99999999999999999999
    spec = spec_file(
        tmp_path, checkpoint, fake_trtllm, runtime={"cancellation_check_period_ms": huge}
    )
    repo = tmp_path / "repo"
    assert cli.main(["repo", "--spec", spec, "--output", str(repo), "--hf-only"]) == 2
    assert "key 'runtime.cancellation_check_period_ms': must be between 1 and 1000" in (
        one_line_error(capsys.readouterr().err)
    )
    assert not repo.exists()
    spec = spec_file(tmp_path, checkpoint, fake_trtllm)
    for memory in ("9" * 400 + "GiB", "5TiB"):
        assert cli.main(["plan", "--spec", spec, "--gpu-memory", memory]) == 2
        assert "must be greater than 0 and at most 4TiB" in one_line_error(capsys.readouterr().err)
    argv = ["plan", "--spec", spec, "--gpu-memory", "80GiB", "--compute-capability", "\u00b2.0"]
    assert cli.main(argv) == 2
    assert "expected MAJOR.MINOR, e.g. 8.0 or 9.0" in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("command", "option", "words"),
    [
        ("plan", "--spec", "the build spec (TOML"),
        ("repo", "--spec", "the build spec (TOML"),
        ("repo", "--output", "its parent folder must exist"),
        ("verify", "repository", "the model repository directory"),
    ],
)
def test_every_option_has_help(
    capsys: pytest.CaptureFixture[str], command: str, option: str, words: str
) -> None:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert option in text and words in text


def test_verify_missing_repository_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["verify", str(tmp_path / "nope")]) == 1
    assert "cannot read" in one_line_error(capsys.readouterr().err)


def test_engine_config_json_shape_matches_what_verify_reads(tmp_path: Path) -> None:
    """verify reads build_config.{max_batch_size,max_input_len,max_seq_len,plugin_config} and
    pretrained_config.mapping.world_size, the layout trtllm-build writes into config.json."""
    from engine_build.verify import engine_limits

    cfg = {
        "version": "1.2.1",
        "pretrained_config": {"mapping": {"world_size": 2}},
        "build_config": {
            "max_batch_size": 1,
            "max_input_len": 2048,
            "max_seq_len": 4096,
            "plugin_config": {"use_paged_context_fmha": True},
        },
    }
    limits = engine_limits(json.loads(json.dumps(cfg)))
    assert limits == {
        "max_draft_len": 0,
        "num_eagle_layers": 0,
        "max_batch_size": 1,
        "max_input_len": 2048,
        "max_seq_len": 4096,
        "use_paged_context_fmha": True,
        "world_size": 2,
        "version": "1.2.1",
    }


def test_plan_commands_are_exactly_what_build_runs(
    tmp_path: Path,
    spec: str,
    calls: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import shlex

    script = tmp_path / "cmds.sh"
    assert (
        cli.main(["plan", "--spec", spec, "--gpu-memory", "80GiB", "--commands-out", str(script)])
        == 0
    )
    assert cli.main(["build", "--spec", spec, "--gpu-memory", "80GiB", "--quiet"]) == 0
    planned = [shlex.split(line) for line in script.read_text().splitlines()[2:]]
    quantize = next(argv for argv in planned if argv[1].endswith("quantize.py"))
    build = next(argv for argv in planned if argv[0].endswith("trtllm-build"))
    ran = read_calls(calls)
    assert ran[0]["argv"] == quantize[2:]
    assert ran[1]["argv"] == build[1:]


def test_unwritable_outputs_are_one_line_errors(
    tmp_path: Path, spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = str(blocker / "plan.sh")
    assert cli.main(["plan", "--spec", spec, "--gpu-memory", "80GiB", "--commands-out", out]) == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"engine-build: error: --commands-out {out}: the folder {blocker} is not a directory; "
        "create it first"
    )
    repo = str(blocker / "repo")
    assert cli.main(["repo", "--spec", spec, "--output", repo, "--hf-only"]) == 2
    assert f"--output {repo}: the folder {blocker} is not a directory" in one_line_error(
        capsys.readouterr().err
    )


def test_commands_out_in_a_missing_folder_is_refused_before_the_plan(
    tmp_path: Path, spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing"
    out = str(missing / "x.sh")
    assert cli.main(["plan", "--spec", spec, "--gpu-memory", "80GiB", "--commands-out", out]) == 2
    cap = capsys.readouterr()
    assert one_line_error(cap.err) == (
        f"engine-build: error: --commands-out {out}: the folder {missing} does not exist; "
        "create it first"
    )
    assert cap.out == "" and not missing.exists()


def test_commands_out_naming_a_directory_is_refused_before_the_plan(
    tmp_path: Path,
    spec: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "adir").mkdir()
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--spec", spec, "--gpu-memory", "80GiB", "--commands-out", "adir"]
    assert cli.main(argv) == 2
    cap = capsys.readouterr()
    assert one_line_error(cap.err) == (
        "engine-build: error: --commands-out adir: is a directory; give the path of a file to write"
    )
    assert cap.out == "" and sorted(p.name for p in tmp_path.iterdir() if p.name[0] == ".") == []


def test_a_failed_commands_out_write_names_the_file_not_the_temporary(
    tmp_path: Path,
    spec: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "x.sh"

    def no_space(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", src)

    monkeypatch.setattr(os, "replace", no_space)
    argv = ["plan", "--spec", spec, "--gpu-memory", "80GiB", "--commands-out", str(out)]
    assert cli.main(argv) == 1
    line = one_line_error(capsys.readouterr().err)
    assert line == f"engine-build: error: {out}: No space left on device"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".x.sh")] == []


def test_repo_in_a_missing_folder_is_refused_without_creating_it(
    tmp_path: Path, spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing"
    repo = str(missing / "repo")
    assert cli.main(["repo", "--spec", spec, "--output", repo, "--hf-only"]) == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"engine-build: error: --output {repo}: the folder {missing} does not exist; "
        "create it first"
    )
    assert not missing.exists()


def test_a_failed_repo_write_names_the_output_not_the_staging_folder(
    tmp_path: Path,
    spec: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine_build import repo as repo_module

    def no_space(tokenizer_json: Path, stop_ids: Any, dest: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(dest))

    monkeypatch.setattr(repo_module, "write_tokenizer_info", no_space)
    repo = tmp_path / "repo"
    assert cli.main(["repo", "--spec", spec, "--output", str(repo), "--hf-only"]) == 1
    line = one_line_error(capsys.readouterr().err)
    info = repo / "tensorrt_llm" / "tokenizer" / "xgrammar_tokenizer_info.json"
    assert line == f"engine-build: error: {info}: No space left on device"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("command", ["build", "repo"])
def test_build_and_repo_refuse_multi_gpu_engines(
    tmp_path: Path,
    checkpoint: Path,
    fake_trtllm: Path,
    calls: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    spec = spec_file(tmp_path, checkpoint, fake_trtllm, parallel={"tp_size": 2})
    # plan still says how a two-GPU engine would fit
    assert cli.main(["plan", "--spec", spec, "--gpu-memory", "80GiB"]) == 0
    capsys.readouterr()
    argv = {
        "build": ["build", "--spec", spec, "--gpu-memory", "80GiB"],
        "repo": ["repo", "--spec", spec, "--output", str(tmp_path / "repo")],
    }[command]
    assert cli.main(argv) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "key 'parallel.tp_size'" in line and "does not launch multi-GPU engines" in line
    assert "TRTLLM_ORCHESTRATOR=1" in line
    assert read_calls(calls) == []


def test_verify_triton_root_option(
    tmp_path: Path,
    spec: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["build", "--spec", spec, "--gpu-memory", "80GiB", "--quiet"]) == 0
    repo = str(tmp_path / "repo")
    assert cli.main(["repo", "--spec", spec, "--output", repo]) == 0
    root = tmp_path / "root"
    (root / "usr/local/lib/python3.12/dist-packages/tensorrt_llm-1.2.0.dist-info").mkdir(
        parents=True
    )
    capsys.readouterr()
    assert cli.main(["verify", repo, "--triton-root", str(root)]) == 1
    assert "runs 1.2.0" in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("plugins", "key"),
    [
        ({"gemm": "low_latency_gemm_plugin"}, "plugins.gemm"),
        ({"gemm_swiglu": "gemm_swiglu_plugin"}, "plugins.gemm_swiglu"),
    ],
)
def test_plugins_trtllm_build_refuses_on_sm100_are_refused_by_plan(
    tmp_path: Path,
    checkpoint: Path,
    fake_trtllm: Path,
    capsys: pytest.CaptureFixture[str],
    plugins: dict[str, str],
    key: str,
) -> None:
    """trtllm-build's PluginConfig.validate raises NotImplementedError for these plugins on
    SM 100, after quantize.py has calibrated; the GPU check refuses them before any stage."""
    spec = spec_file(tmp_path, checkpoint, fake_trtllm, plugins=plugins)
    argv = ["plan", "--spec", spec, "--gpu-memory", "180GiB", "--compute-capability", "10.0"]
    assert cli.main(argv) == 2
    line = one_line_error(capsys.readouterr().err)
    assert f"{key} = " in line and "10.0" in line
    # Hopper and later Blackwell parts take them.
    for cc in ("9.0", "10.3"):
        argv[-1] = cc
        assert cli.main(argv) == 0
