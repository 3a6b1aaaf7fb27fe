"""Build stages run for real against a fake TensorRT-LLM installation.

The installation (conftest.make_fake_trtllm) is a virtual environment whose package metadata
says ``tensorrt_llm <version>`` and whose quantize.py / trtllm-build are stand-in scripts that
parse their argv with the recorded 1.2 CLI, write outputs shaped like the real ones, record
their calls and fail on demand. Nothing of TensorRT-LLM is imported.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine_build import runner
from engine_build.errors import BuildError, SpecError
from engine_build.spec import BuildSpec, load_spec

from .conftest import (
    make_checkpoint,
    make_fake_trtllm,
    read_calls,
    spec_sections,
    write_spec,
)


def make_spec(
    tmp_path: Path, checkpoint: Path, venv: Path, **overrides: dict[str, Any]
) -> BuildSpec:
    sections = spec_sections(checkpoint, tmp_path / "work", venv, **overrides)
    return load_spec(write_spec(tmp_path / "spec.toml", sections))


def run(spec: BuildSpec, force: bool = False) -> tuple[list[runner.StageResult], str]:
    out = io.StringIO()
    results = runner.BuildRunner(spec, out=out).run(force=force)
    return results, out.getvalue()


def tools(calls: Path) -> list[str]:
    return [c["tool"] for c in read_calls(calls)]


def test_stand_in_tools_build_checkpoint_and_engine(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, calls: Path
) -> None:
    spec = make_spec(tmp_path, checkpoint, fake_trtllm)
    results, log = run(spec)
    assert [r.skipped for r in results] == [False, False]
    assert tools(calls) == ["quantize.py", "trtllm-build"]
    assert (spec.checkpoint_dir / "rank0.safetensors").is_file()
    assert (spec.engine_dir / "rank0.engine").is_file()
    engine_cfg = json.loads((spec.engine_dir / "config.json").read_text())
    assert engine_cfg["build_config"]["max_batch_size"] == 1
    assert engine_cfg["build_config"]["plugin_config"]["use_paged_context_fmha"] is False
    assert "==> TensorRT-LLM 1.2.1" in log
    assert "[1/2 quantize] Quantized model exported" in log  # tool log streamed, prefixed
    assert "==> [2/2 trtllm-build] done in" in log
    assert (spec.log_dir / "trtllm-build.log").read_text().startswith("$ ")
    assert not list(spec.work_dir.glob("*.partial"))


def test_second_run_skips_both_stages_with_stand_in_tools(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, calls: Path
) -> None:
    spec = make_spec(tmp_path, checkpoint, fake_trtllm)
    first, _ = run(spec)
    second, log = run(spec)
    assert [r.skipped for r in second] == [True, True]
    assert [r.fingerprint for r in second] == [r.fingerprint for r in first]
    assert tools(calls) == ["quantize.py", "trtllm-build"]
    assert log.count("up to date, skipped") == 2


def test_engine_only_spec_change_rebuilds_only_the_engine_with_stand_in_tools(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, calls: Path
) -> None:
    run(make_spec(tmp_path, checkpoint, fake_trtllm))
    changed = make_spec(tmp_path, checkpoint, fake_trtllm, limits={"max_seq_len": 8192})
    results, _ = run(changed)
    assert [r.skipped for r in results] == [True, False]
    assert tools(calls) == ["quantize.py", "trtllm-build", "trtllm-build"]
    cfg = json.loads((changed.engine_dir / "config.json").read_text())
    assert cfg["build_config"]["max_seq_len"] == 8192


def test_checkpoint_change_rebuilds_everything_with_stand_in_tools(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, calls: Path
) -> None:
    spec = make_spec(tmp_path, checkpoint, fake_trtllm)
    run(spec)
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(b"\1" * 128)
    results, _ = run(spec)
    assert [r.skipped for r in results] == [False, False]


def test_trtllm_version_change_rebuilds_with_stand_in_tools(
    tmp_path: Path,
    checkpoint: Path,
    fake_trtllm_factory: Callable[[str | None], Path],
    calls: Path,
) -> None:
    spec = make_spec(tmp_path, checkpoint, fake_trtllm_factory("1.2.0"))
    first, _ = run(spec)
    # Same spec file contents except the venv path: point at a 1.2.1 install.
    spec2 = make_spec(tmp_path, checkpoint, fake_trtllm_factory("1.2.1"))
    second, _ = run(spec2)
    assert all(not r.skipped for r in second)
    assert first[1].fingerprint != second[1].fingerprint


def test_force_rebuilds_with_stand_in_tools(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, calls: Path
) -> None:
    spec = make_spec(tmp_path, checkpoint, fake_trtllm)
    run(spec)
    results, _ = run(spec, force=True)
    assert [r.skipped for r in results] == [False, False]


def test_stand_in_build_failure_names_stage_shows_tail_and_removes_partial_output(
    tmp_path: Path,
    checkpoint: Path,
    fake_trtllm: Path,
    calls: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = make_spec(tmp_path, checkpoint, fake_trtllm)
    run(spec)
    monkeypatch.setenv("FAKE_TRTLLM_FAIL", "trtllm-build")
    with pytest.raises(BuildError) as info:
        run(spec, force=True)
    msg = str(info.value)
    assert msg.startswith("stage trtllm-build failed (exit 1)")
    assert "Engine building failed" in msg and "[TRT] building layer 24" in msg
    assert "[TRT] building layer 0 " not in msg  # only the tail
    assert "\n" not in msg
    assert not spec.engine_dir.exists()  # stale engine of the old checkpoint removed
    assert not (spec.work_dir / "engine.partial").exists()
    assert (spec.log_dir / "trtllm-build.log").is_file()  # full log kept for the operator
    # After the fault is gone the checkpoint is reused and only the engine is rebuilt.
    monkeypatch.delenv("FAKE_TRTLLM_FAIL")
    results, _ = run(spec)
    assert [r.skipped for r in results] == [True, False]


def test_stand_in_quantize_failure_leaves_nothing(
    tmp_path: Path,
    checkpoint: Path,
    fake_trtllm: Path,
    calls: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAKE_TRTLLM_FAIL", "quantize")
    spec = make_spec(tmp_path, checkpoint, fake_trtllm)
    with pytest.raises(BuildError, match=r"stage quantize failed \(exit 1\).*CUDA out of memory"):
        run(spec)
    assert not spec.checkpoint_dir.exists()
    assert not (spec.work_dir / "checkpoint.partial").exists()
    assert tools(calls) == ["quantize.py"]


def test_stand_in_tool_exiting_zero_without_engine_is_a_failure(
    tmp_path: Path,
    checkpoint: Path,
    fake_trtllm: Path,
    calls: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAKE_TRTLLM_FAIL", "no-engine")
    spec = make_spec(tmp_path, checkpoint, fake_trtllm)
    with pytest.raises(BuildError, match=r"exited 0 but did not write rank0\.engine"):
        run(spec)
    assert not spec.engine_dir.exists()


def test_opt_num_tokens_reaches_the_stand_in_tool(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, calls: Path
) -> None:
    spec = make_spec(
        tmp_path,
        checkpoint,
        fake_trtllm,
        limits={"multiple_profiles": False, "opt_num_tokens": 128},
    )
    run(spec)
    argv = read_calls(calls)[1]["argv"]
    assert argv[argv.index("--opt_num_tokens") + 1] == "128"


@pytest.mark.parametrize(
    ("version", "message"),
    [
        ("1.3.0", "TensorRT-LLM 1.3.0 is too new: 1.3 removed the TensorRT engine path"),
        ("2.0.0rc1", "TensorRT-LLM 2.0.0rc1 is too new"),
        ("1.1.0", "TensorRT-LLM 1.1.0 is too old"),
        (None, "TensorRT-LLM is missing: the installation reports no tensorrt_llm package"),
    ],
)
def test_wrong_or_missing_trtllm_refused_before_any_stand_in_stage(
    tmp_path: Path,
    checkpoint: Path,
    fake_trtllm_factory: Callable[[str | None], Path],
    calls: Path,
    version: str | None,
    message: str,
) -> None:
    spec = make_spec(tmp_path, checkpoint, fake_trtllm_factory(version))
    with pytest.raises(BuildError) as info:
        run(spec)
    assert message in str(info.value)
    assert read_calls(calls) == []
    assert not spec.work_dir.exists()


def test_missing_venv_refused(tmp_path: Path, checkpoint: Path, calls: Path) -> None:
    spec = make_spec(tmp_path, checkpoint, tmp_path / "no-venv")
    with pytest.raises(BuildError, match="TensorRT-LLM is missing: no virtual environment"):
        run(spec)


def test_container_prefix_runs_the_same_stand_in_tools(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, calls: Path
) -> None:
    # `env PATH=...` stands in for `docker run ... IMAGE`: an argv prefix before the tool.
    prefix = ["env", f"PATH={fake_trtllm / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"]
    sections = spec_sections(checkpoint, tmp_path / "work", fake_trtllm)
    sections["trtllm"] = {
        "container": prefix,
        "quantize_script": str(fake_trtllm / "examples" / "quantization" / "quantize.py"),
    }
    spec = load_spec(write_spec(tmp_path / "spec.toml", sections))
    results, log = run(spec)
    assert [r.skipped for r in results] == [False, False]
    assert "==> TensorRT-LLM 1.2.1" in log


def test_missing_container_runtime_refused(tmp_path: Path, checkpoint: Path, calls: Path) -> None:
    sections = spec_sections(checkpoint, tmp_path / "work", tmp_path)
    sections["trtllm"] = {
        "container": ["/nonexistent/docker", "run", "img"],
        "quantize_script": "/app/quantize.py",
    }
    spec = load_spec(write_spec(tmp_path / "spec.toml", sections))
    with pytest.raises(
        BuildError, match="TensorRT-LLM is missing: cannot run '/nonexistent/docker'"
    ):
        run(spec)


def test_version_parse_ignores_banners() -> None:
    text = "[TensorRT-LLM] TensorRT LLM version: 1.2.1\nTRTLLM_VERSION=1.2.1\n"
    assert runner.parse_version(text) == (1, 2, "1.2.1")


def test_stamp_mtime_is_not_part_of_the_fingerprint_with_stand_in_tools(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, calls: Path
) -> None:
    spec = make_spec(tmp_path, checkpoint, fake_trtllm)
    run(spec)
    stamp = spec.engine_dir / runner.STAMP
    t = time.time() + 100
    os.utime(stamp, (t, t))
    results, _ = run(spec)
    assert all(r.skipped for r in results)


def test_failed_stand_in_engine_rebuild_removes_the_stale_engine(
    tmp_path: Path,
    checkpoint: Path,
    fake_trtllm: Path,
    calls: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run(make_spec(tmp_path, checkpoint, fake_trtllm))
    changed = make_spec(
        tmp_path, checkpoint, fake_trtllm, plugins={"gemm": "low_latency_gemm_plugin"}
    )
    monkeypatch.setenv("FAKE_TRTLLM_FAIL", "trtllm-build")
    with pytest.raises(BuildError, match="stage trtllm-build failed"):
        run(changed)
    assert (changed.checkpoint_dir / "rank0.safetensors").is_file()  # still valid, kept
    assert not changed.engine_dir.exists()  # built with the other GEMM plugin: gone


def test_missing_quantize_script_refused_before_the_built_engine_is_removed(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, calls: Path
) -> None:
    run(make_spec(tmp_path, checkpoint, fake_trtllm))
    moved = make_spec(
        tmp_path,
        checkpoint,
        fake_trtllm,
        trtllm={"quantize_script": str(tmp_path / "TensorRT-LLM" / "quantize.py")},
    )
    with pytest.raises(SpecError, match=r"key 'trtllm\.quantize_script': .*quantize\.py") as info:
        run(moved)
    assert "\n" not in str(info.value)
    assert tools(calls) == ["quantize.py", "trtllm-build"]  # nothing ran the second time
    assert (moved.engine_dir / "rank0.engine").is_file()  # and nothing was removed


def test_venv_without_trtllm_build_refused_before_any_stage(
    tmp_path: Path, checkpoint: Path, calls: Path
) -> None:
    venv_dir = make_fake_trtllm(tmp_path / "trtllm")
    (venv_dir / "bin" / "trtllm-build").unlink()
    spec = make_spec(tmp_path, checkpoint, venv_dir)
    with pytest.raises(SpecError, match=r"key 'trtllm\.venv': .*bin/trtllm-build"):
        run(spec)
    assert read_calls(calls) == []
    assert not spec.checkpoint_dir.exists()


@pytest.mark.parametrize("dataset", ["/nonexistent/calibration", "wikitext"])
def test_calibration_dataset_quantize_py_cannot_load_refused_before_any_stage(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, calls: Path, dataset: str
) -> None:
    """quantize.py loads the model for minutes, then raises NotImplementedError for a dataset
    that is neither one it knows by name nor a directory."""
    spec = make_spec(tmp_path, checkpoint, fake_trtllm, precision={"calib_dataset": dataset})
    with pytest.raises(SpecError, match=r"key 'precision\.calib_dataset': .*directory"):
        run(spec)
    assert read_calls(calls) == []


def test_calibration_dataset_directory_and_hub_names_pass(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path, calls: Path
) -> None:
    local = tmp_path / "calib"
    local.mkdir()
    for dataset in (str(local), "cnn_dailymail", "abisee/cnn_dailymail", "pileval"):
        spec = make_spec(tmp_path, checkpoint, fake_trtllm, precision={"calib_dataset": dataset})
        run(spec)
    assert tools(calls).count("quantize.py") == 4


def test_work_dir_inside_the_checkpoint_is_refused(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path
) -> None:
    """The checkpoint's fingerprint covers every file under it: build outputs written there
    would change it on every run, and every build would start again from quantize.py."""
    for work in (checkpoint, checkpoint / "build"):
        sections = spec_sections(checkpoint, work, fake_trtllm)
        with pytest.raises(SpecError, match=r"key 'model\.work_dir': .*inside"):
            load_spec(write_spec(tmp_path / "spec.toml", sections))


def test_checkpoint_inside_a_build_output_is_refused(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path
) -> None:
    """A stage removes its output folder before it runs: a checkpoint kept there is deleted."""
    work = tmp_path / "work"
    hf = make_checkpoint_copy(checkpoint, work / "checkpoint" / "hf")
    sections = spec_sections(hf, work, fake_trtllm)
    with pytest.raises(SpecError, match=r"key 'model\.hf_model_dir': .*removes"):
        load_spec(write_spec(tmp_path / "spec.toml", sections))


def make_checkpoint_copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_missing_medusa_heads_refused_before_the_convert_stage(
    tmp_path: Path, checkpoint: Path, calls: Path
) -> None:
    """convert_checkpoint.py loads the base model before it opens the heads' folder."""
    venv_dir = make_fake_trtllm(tmp_path / "trtllm")
    medusa = venv_dir / "examples" / "medusa"
    medusa.mkdir()
    (medusa / "convert_checkpoint.py").write_text("raise SystemExit(1)\n")
    spec = make_spec(
        tmp_path,
        checkpoint,
        venv_dir,
        precision={"quantization": "none", "kv_cache_dtype": "auto"},
        speculative={
            "mode": "medusa",
            "medusa_model_dir": str(tmp_path / "no-heads"),
            "medusa_choices": [[0], [1]],
        },
    )
    with pytest.raises(SpecError, match=r"key 'speculative\.medusa_model_dir': .*no-heads"):
        run(spec)
    assert read_calls(calls) == []


@pytest.mark.parametrize("changed", ["draft", "medusa"])
def test_a_changed_draft_or_heads_folder_rebuilds_its_stages(
    tmp_path: Path, checkpoint: Path, calls: Path, changed: str
) -> None:
    """The draft model and the Medusa heads are inputs like the target checkpoint: replaced
    in place (retrained, re-downloaded), the stages built from them must run again."""
    venv_dir = make_fake_trtllm(tmp_path / "trtllm")
    if changed == "draft":
        inputs = make_checkpoint(tmp_path / "draft")
        overrides: dict[str, dict[str, Any]] = {
            "kv_cache": {"enable_reuse": True},
            "speculative": {
                "mode": "draft_target",
                "draft_hf_model_dir": str(inputs),
                "max_draft_len": 4,
            },
        }
        weights = inputs / "model.safetensors"
        expected = [True, True, False, False]
    else:
        inputs = tmp_path / "heads"
        inputs.mkdir()
        weights = inputs / "medusa_lm_head.safetensors"
        weights.write_bytes(b"\0" * 8)
        medusa = venv_dir / "examples" / "medusa"
        medusa.mkdir()
        # The stand-in converter: the quantize stand-in's checkpoint, heads ignored.
        shutil.copy(venv_dir / "examples" / "quantization" / "quantize.py", medusa / "x.py")
        (medusa / "convert_checkpoint.py").write_text(
            "import sys, runpy\n"
            "a = sys.argv[1:]\n"
            "keep = ['--model_dir', '--dtype', '--tp_size', '--output_dir']\n"
            "sys.argv = [sys.argv[0]] + [x for i in range(0, len(a), 2) if a[i] in keep "
            "for x in a[i:i + 2]] + ['--qformat', 'full_prec']\n"
            f"runpy.run_path({str(medusa / 'x.py')!r}, run_name='__main__')\n"
        )
        overrides = {
            "precision": {"quantization": "none", "kv_cache_dtype": "auto"},
            "speculative": {
                "mode": "medusa",
                "medusa_model_dir": str(inputs),
                "medusa_choices": [[0], [1]],
            },
        }
        expected = [False, False]
    spec = make_spec(tmp_path, checkpoint, venv_dir, **overrides)
    first, _ = run(spec)
    assert not any(r.skipped for r in first)
    assert all(r.skipped for r in run(spec)[0])
    weights.write_bytes(b"\1" * 16)
    again, _ = run(spec)
    assert [r.skipped for r in again] == expected


def test_a_work_dir_beside_the_checkpoint_written_with_dot_dot_passes(
    tmp_path: Path, checkpoint: Path, fake_trtllm: Path
) -> None:
    """`CHECKPOINT/../work` is a folder beside the checkpoint, not in it: paths are compared
    as the file system resolves them, not by their text."""
    work = checkpoint / ".." / "work-beside"
    spec = load_spec(
        write_spec(tmp_path / "spec.toml", spec_sections(checkpoint, work, fake_trtllm))
    )
    assert not spec.work_dir.resolve().is_relative_to(spec.hf_model_dir.resolve())
