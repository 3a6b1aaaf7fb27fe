"""Dated run records of the benchmarks: docs/runs/<date>-<name>.json and .md.

A benchmark run with `--record` writes what it printed, the command line, the date (UTC), the
commit and the machine (platform, CPU model and count, Python; torch, its threads and the GPU when
the benchmark imported torch) as JSON, and the same as a short Markdown page beside it, so a figure
quoted in docs/PERFORMANCE.md can name the record it came from. Without `--record` (the default,
and what tests run) nothing is written. A second run of the same benchmark on the same day gets
`-2`, `-3`, ... rather than overwriting the first.

    python -m bench.streaming --record                          # docs/runs/<date>-streaming.json, .md
    python -m bench.streaming --record --record-dir /tmp/runs   # the same, in another folder
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from appliance.wholefile import write_whole

RUNS_DIR = Path(__file__).resolve().parent.parent / "docs" / "runs"


def add_flag(parser: argparse.ArgumentParser) -> None:
    """`--record` (write this run's record) and `--record-dir DIR` (where; default docs/runs)."""
    parser.add_argument(
        "--record",
        action="store_true",
        help="write a dated run record (JSON and Markdown) of this run to --record-dir",
    )
    parser.add_argument(
        "--record-dir",
        type=Path,
        default=RUNS_DIR,
        metavar="DIR",
        help="where --record writes (default docs/runs of this checkout)",
    )


def record_dir(args: argparse.Namespace) -> Path | None:
    """The folder to write this run's record to, or None without `--record`."""
    return Path(args.record_dir) if args.record else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=RUNS_DIR.parent.parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine() -> dict[str, Any]:
    """The machine a run was taken on. torch is described only if the benchmark imported it."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = str(torch.__version__)
        info["torch_threads"] = int(torch.get_num_threads())
        if torch.cuda.is_available():
            info["gpu"] = str(torch.cuda.get_device_name())
    return info


def _free_stem(directory: Path, stem: str) -> str:
    candidate, n = stem, 1
    while (directory / f"{candidate}.json").exists() or (directory / f"{candidate}.md").exists():
        n += 1
        candidate = f"{stem}-{n}"
    return candidate


def _markdown(record: dict[str, Any], body: str) -> str:
    title = f"# {record['name']}, {record['date']}"
    lines = [
        f"{title} (partial: the run had not ended)" if record.get("partial") else title,
        "",
        "Written by `bench/record.py`; the same record as JSON beside this file.",
        "",
        f"- command: `{record['command']}`",
        f"- commit: {record['commit'] or 'unknown'}",
    ]
    lines += [f"- {key}: {value}" for key, value in record["machine"].items()]
    lines += ["", "```", body.rstrip("\n"), "```", ""]
    return "\n".join(lines)


def write_record(
    name: str,
    results: dict[str, Any],
    markdown: str,
    *,
    directory: Path = RUNS_DIR,
    argv: list[str] | None = None,
    now: dt.datetime | None = None,
    commit: str | None = None,
    over: Path | None = None,
    partial: bool = False,
) -> Path:
    """Writes <directory>/<date>-<name>.json (and .md beside it); returns the JSON's path.

    `results` must be JSON-serializable (anything else is written as its str); `markdown` is the
    run's printed output, quoted as is in the Markdown page. `commit`: the code that ran (read
    when the run began); by default the checkout's commit now. `over`: a record of this run
    written before (a checkpoint), replaced; `partial`: the run has not ended yet.
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"record name {name!r} must be a plain file name")
    moment = now or dt.datetime.now(dt.UTC)
    directory.mkdir(parents=True, exist_ok=True)
    stem = over.stem if over is not None else _free_stem(directory, f"{moment:%Y-%m-%d}-{name}")
    record: dict[str, Any] = {
        "name": name,
        "date": moment.strftime("%Y-%m-%d"),
        "time_utc": moment.strftime("%H:%M:%S"),
        "command": shlex.join(["python", "-m", f"bench.{name}", *(argv or sys.argv[1:])]),
        "commit": commit or _commit(),
        "machine": machine(),
        "results": results,
    }
    if partial:
        record["partial"] = True
    # Whole or not at all: a run killed while writing keeps its checkpoint.
    path = directory / f"{stem}.json"
    write_whole(path, (json.dumps(record, indent=2, default=str) + "\n").encode(), 0o644)
    write_whole(directory / f"{stem}.md", _markdown(record, markdown).encode(), 0o644)
    return path


class _Tee(io.TextIOBase):
    """Writes to the real stream and keeps a copy."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


@dataclass
class Run:
    """What a benchmark adds to its record besides its printed output. `checkpoint()` writes the
    record so far, marked partial, so that a run killed later (a device call's `timeout`) keeps
    what it measured; the run's end writes over it."""

    results: dict[str, Any] = field(default_factory=dict)
    checkpoint: Callable[[], None] = lambda: None


@contextmanager
def recording(name: str, directory: Path | None, argv: list[str] | None = None) -> Iterator[Run]:
    """Runs the body with stdout copied; on success, and only if `directory` is given, writes the
    record: the body's printed output plus whatever it put into `Run.results`. A run that raises
    writes nothing more than its last checkpoint."""
    run = Run()
    if directory is None:
        yield run
        return
    commit = _commit()  # the code that runs: a commit made during a long run is not it
    tee = _Tee(sys.stdout)
    written: list[Path] = []

    def save(partial: bool) -> Path:
        output = tee.copy.getvalue()
        path = write_record(
            name,
            {"output": output, **run.results},
            output,
            directory=directory,
            argv=argv,
            commit=commit,
            over=written[0] if written else None,
            partial=partial,
        )
        written[:] = [path]
        return path

    def checkpoint() -> None:
        save(partial=True)

    run.checkpoint = checkpoint
    sys.stdout = tee
    try:
        yield run
    finally:
        sys.stdout = tee.stream
    print(f"run record: {save(partial=False)}", file=sys.stderr)
