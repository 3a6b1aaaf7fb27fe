"""Runs the build stages as subprocesses with fingerprints, skips and clean failure.

Each stage writes into ``<output>.partial`` and is renamed into place only after the tool exits
0 and its expected files exist, so an interrupted or failed stage never leaves something that
looks finished. A stamp file inside the finished directory records the stage fingerprint (the
checkpoint fingerprint, the stage's argv with final paths, the TensorRT-LLM version and the
fingerprint of the stage before it); a stage whose stamp matches is skipped.

TensorRT-LLM is never imported here: its version comes from package metadata of the target
installation, read through a subprocess.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from engine_build import commands
from engine_build.checkpoint import fingerprint_tree
from engine_build.errors import BuildError, SpecError
from engine_build.spec import BuildSpec

STAMP = ".engine_build_stamp.json"
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class Stage:
    """One tool run: ``argv_for(out)`` builds the command writing into ``out``."""

    name: str
    output: Path
    argv_for: Callable[[Path], list[str]]
    expected: Callable[[Path], list[str]]
    # Folders the stage reads besides its upstream stage (the draft model, Medusa heads,
    # EAGLE drafter): their identity is part of the fingerprint like the target checkpoint's.
    inputs: tuple[Path, ...] = ()

    def fingerprint(self, upstream: str, version: str) -> str:
        h = hashlib.sha256()
        payload = {
            "stage": self.name,
            "argv": self.argv_for(self.output),
            "upstream": upstream,
            "trtllm": version,
        }
        if self.inputs:
            # Only when there are some: stamps of stages without inputs stay valid.
            payload["inputs"] = [fingerprint_tree(p) for p in self.inputs]
        h.update(json.dumps(payload, sort_keys=True).encode())
        return h.hexdigest()


def _rank_files(spec: BuildSpec, pattern: str) -> Callable[[Path], list[str]]:
    def expected(_: Path) -> list[str]:
        return ["config.json", *(pattern.format(rank=r) for r in range(spec.tp_size))]

    return expected


def stages(spec: BuildSpec) -> list[Stage]:
    """The checkpoint stage (quantize.py, or convert_checkpoint.py for Medusa/EAGLE) then
    trtllm-build; draft-target speculation adds the draft model's two stages after them."""
    s = spec.speculative
    mode = s.mode
    heads = s.medusa_model_dir if mode == "medusa" else s.eagle_model_dir
    out = [
        Stage(
            "convert" if mode in ("medusa", "eagle") else "quantize",
            spec.checkpoint_dir,
            lambda out: commands.checkpoint_command(spec, out),
            _rank_files(spec, "rank{rank}.safetensors"),
            (heads,) if mode in ("medusa", "eagle") and heads is not None else (),
        ),
        Stage(
            "trtllm-build",
            spec.engine_dir,
            lambda out: commands.build_command(spec, spec.checkpoint_dir, out),
            _rank_files(spec, "rank{rank}.engine"),
        ),
    ]
    if mode == "draft_target":
        out += [
            Stage(
                "draft-quantize",
                spec.draft_checkpoint_dir,
                lambda out: commands.draft_quantize_command(spec, out),
                _rank_files(spec, "rank{rank}.safetensors"),
                (s.draft_hf_model_dir,) if s.draft_hf_model_dir is not None else (),
            ),
            Stage(
                "draft-trtllm-build",
                spec.draft_engine_dir,
                lambda out: commands.draft_build_command(spec, spec.draft_checkpoint_dir, out),
                _rank_files(spec, "rank{rank}.engine"),
            ),
        ]
    return out


_VERSION_RE = re.compile(r"^TRTLLM_VERSION=(\d+)\.(\d+)(\S*)$", re.MULTILINE)


def parse_version(text: str) -> tuple[int, int, str]:
    """Pick the version out of the probe's output (banners may precede it)."""
    m = _VERSION_RE.search(text)
    if m is None:
        raise BuildError(
            "TensorRT-LLM is missing: the installation reports no tensorrt_llm package"
        )
    return int(m.group(1)), int(m.group(2)), f"{m.group(1)}.{m.group(2)}{m.group(3)}"


def check_version(major: int, minor: int, full: str) -> None:
    """Refuse anything but the pinned 1.2 line, saying why."""
    want = commands.TRTLLM_SUPPORTED
    if (major, minor) > want:
        raise BuildError(
            f"TensorRT-LLM {full} is too new: 1.3 removed the TensorRT engine path "
            "(trtllm-build and the tensorrtllm Triton backend); install tensorrt-llm "
            f"{want[0]}.{want[1]}.x"
        )
    if (major, minor) < want:
        raise BuildError(
            f"TensorRT-LLM {full} is too old: flags and plugin defaults of this tool follow "
            f"{want[0]}.{want[1]}.x; install tensorrt-llm {want[0]}.{want[1]}.x"
        )


def probe_version(spec: BuildSpec) -> str:
    """Run the version probe in the target installation and enforce the pin."""
    t = spec.trtllm
    if t.venv is not None and not (t.venv / "bin" / "python").exists():
        raise BuildError(f"TensorRT-LLM is missing: no virtual environment at {t.venv}")
    argv = commands.version_command(spec)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    except FileNotFoundError as err:
        raise BuildError(f"TensorRT-LLM is missing: cannot run {argv[0]!r}") from err
    except subprocess.TimeoutExpired as err:
        raise BuildError(f"TensorRT-LLM version probe timed out: {commands.render(argv)}") from err
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise BuildError(f"TensorRT-LLM is missing: version probe failed: {tail[0]}")
    major, minor, full = parse_version(proc.stdout)
    check_version(major, minor, full)
    return full


def calib_dataset_problem(value: str) -> str | None:
    """Why quantize.py cannot load this ``--calib_dataset`` (None: it can).

    Its calibration loader knows ``pileval``, names containing ``cnn_dailymail`` or
    ``scienceqa``/``science_qa`` (fetched from the hub) and local dataset directories (a train
    split with a text column); anything else raises NotImplementedError, after the model has
    been loaded. A relative directory is relative to where ``build`` runs, as for quantize.py.
    """
    lowered = value.lower()
    if value == "pileval" or "cnn_dailymail" in value:
        return None
    if "scienceqa" in lowered or "science_qa" in lowered or Path(value).is_dir():
        return None
    return (
        f"{value!r} is neither a dataset quantize.py knows by name (cnn_dailymail, pileval, "
        "scienceqa) nor an existing directory; give a local dataset directory (train split, "
        "text column)"
    )


# Input folders a convert stage opens only after loading the base model, by its flag.
_INPUT_DIRS = {
    "--medusa_model_dir": "speculative.medusa_model_dir",
    "--eagle_model_dir": "speculative.eagle_model_dir",
}


def check_stage_inputs(spec: BuildSpec, stage: Stage) -> None:
    """Refuse, before any output is removed, a stage whose tool or input is missing on this host:
    the venv's python/trtllm-build, the script it runs, the Medusa/EAGLE folders, the
    calibration dataset. A container's tools are not checked (they live in its image)."""
    argv = stage.argv_for(stage.output)
    where = spec.source
    t = spec.trtllm
    if t.venv is not None:
        tool = Path(argv[0])
        if not tool.is_file():
            raise SpecError(
                f"{where}: key 'trtllm.venv': {tool} missing: {t.venv} is not a TensorRT-LLM "
                "1.2 virtual environment (bin/python, bin/trtllm-build)"
            )
        if tool.name.startswith("python") and not Path(argv[1]).is_file():
            raise SpecError(
                f"{where}: key 'trtllm.quantize_script': {argv[1]} is not a file (the "
                "examples/ of the TensorRT-LLM 1.2 sources: quantization/quantize.py, and "
                "<mode>/convert_checkpoint.py beside it)"
            )
    for flag, key in _INPUT_DIRS.items():
        if flag in argv and not Path(argv[argv.index(flag) + 1]).is_dir():
            raise SpecError(
                f"{where}: key '{key}': {argv[argv.index(flag) + 1]} is not a directory"
            )
    if "--calib_dataset" in argv:
        why = calib_dataset_problem(argv[argv.index("--calib_dataset") + 1])
        if why:
            raise SpecError(f"{where}: key 'precision.calib_dataset': {why}")


def read_stamp(directory: Path) -> str | None:
    try:
        data = json.loads((directory / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    fp = data.get("fingerprint") if isinstance(data, dict) else None
    return fp if isinstance(fp, str) else None


def _complete(stage: Stage, directory: Path) -> list[str]:
    return [f for f in stage.expected(directory) if not (directory / f).is_file()]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@dataclass
class StageResult:
    name: str
    fingerprint: str
    skipped: bool
    seconds: float


class BuildRunner:
    """Drives the stages; ``out`` receives progress lines and (unless quiet) the tool logs."""

    def __init__(self, spec: BuildSpec, out: TextIO = sys.stdout, quiet: bool = False) -> None:
        self.spec = spec
        self.out = out
        self.quiet = quiet

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def run(self, force: bool = False) -> list[StageResult]:
        version = probe_version(self.spec)
        self._say(f"==> TensorRT-LLM {version}")
        upstream = fingerprint_tree(self.spec.hf_model_dir)
        results: list[StageResult] = []
        all_stages = stages(self.spec)
        for index, stage in enumerate(all_stages, 1):
            fp = stage.fingerprint(upstream, version)
            label = f"[{index}/{len(all_stages)} {stage.name}]"
            if not force and read_stamp(stage.output) == fp and not _complete(stage, stage.output):
                self._say(f"==> {label} up to date, skipped ({fp[:12]})")
                results.append(StageResult(stage.name, fp, True, 0.0))
            else:
                self._say(f"==> {label} running ({fp[:12]})")
                # This stage's old output and everything downstream are stale: an engine built
                # from other inputs must not survive a failed rebuild and then be served.
                # A stage that cannot start must not cost the outputs that still work.
                for later in all_stages[index - 1 :]:
                    check_stage_inputs(self.spec, later)
                for later in all_stages[index - 1 :]:
                    _remove(later.output)
                seconds = self._run_stage(stage, fp, label)
                self._say(f"==> {label} done in {seconds:.1f}s")
                results.append(StageResult(stage.name, fp, False, seconds))
                force = True  # everything downstream of a rebuilt stage is rebuilt too
            upstream = fp
        return results

    def _run_stage(self, stage: Stage, fp: str, label: str) -> float:
        partial = stage.output.with_name(stage.output.name + ".partial")
        _remove(partial)
        partial.parent.mkdir(parents=True, exist_ok=True)
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.spec.log_dir / f"{stage.name}.log"
        argv = stage.argv_for(partial)
        tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        start = time.monotonic()
        try:
            with log_path.open("w", encoding="utf-8") as log:
                log.write(f"$ {commands.render(argv)}\n")
                try:
                    proc = subprocess.Popen(
                        argv,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        text=True,
                        errors="replace",
                        bufsize=1,
                    )
                except OSError as err:
                    raise BuildError(
                        f"stage {stage.name} failed to start {argv[0]!r}: {err.strerror or err}"
                    ) from err
                assert proc.stdout is not None
                try:
                    for line in proc.stdout:
                        log.write(line)
                        tail.append(line.rstrip("\n"))
                        if not self.quiet:
                            self._say(f"{label} {line.rstrip()}")
                    rc = proc.wait()
                except BaseException:
                    # Interrupted (Ctrl-C, a write error): the tool must not keep writing into
                    # the directory we are about to remove.
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                    raise
            if rc != 0:
                raise BuildError(
                    f"stage {stage.name} failed (exit {rc}); log {log_path}; last lines: "
                    + " | ".join(tail)
                )
            missing = _complete(stage, partial)
            if missing:
                raise BuildError(
                    f"stage {stage.name} exited 0 but did not write {', '.join(missing)}; "
                    f"log {log_path}"
                )
            (partial / STAMP).write_text(
                json.dumps({"fingerprint": fp, "argv": stage.argv_for(stage.output)}, indent=1),
                encoding="utf-8",
            )
            _remove(stage.output)
            partial.rename(stage.output)
        except BaseException:
            _remove(partial)
            raise
        return time.monotonic() - start
