"""`appliance engine` refuses to start, with one line naming what to fix, when it cannot serve."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from appliance.engine.repository import RepositoryError, lock_repository
from appliance.tools import processes
from engine_build.repo import write_hf_repository
from tests.conftest import Tiny


def engine_cli(repo: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """`appliance engine` on `repo` with `options`, to its exit."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "appliance",
            "engine",
            "--repository",
            str(repo),
            "--listen",
            "127.0.0.1:0",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("appliance engine: ")
    return lines[0]


def _repo_for(model_dir: Path, tmp_path: Path) -> Path:
    return write_hf_repository(model_dir, tmp_path / "repo", guided_decoding=False)


def test_half_written_checkpoint_is_refused_naming_the_file(tiny: Tiny, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny.model_dir, model_dir)
    repo = _repo_for(model_dir, tmp_path)
    weights = model_dir / "model.safetensors"
    with weights.open("r+b") as f:  # a copy that stopped half way
        f.truncate(weights.stat().st_size // 2)
    done = engine_cli(repo)
    assert done.returncode == 2
    line = _one_line(done.stderr)
    assert str(weights) in line and "not a readable safetensors file" in line


def test_missing_checkpoint_is_refused_naming_the_directory(tiny: Tiny, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny.model_dir, model_dir)
    repo = _repo_for(model_dir, tmp_path)
    shutil.rmtree(model_dir)
    done = engine_cli(repo)
    assert done.returncode == 2
    line = _one_line(done.stderr)
    assert "checkpoint directory missing" in line and str(model_dir) in line


def test_a_second_engine_on_one_repository_fails_at_start(tiny: Tiny, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(tiny.repo, repo)
    held = lock_repository(repo)  # what a running engine server holds
    try:
        with pytest.raises(RepositoryError, match="another engine server is already serving"):
            lock_repository(repo)
        done = engine_cli(repo)
        assert done.returncode == 2
        assert "another engine server is already serving this repository" in _one_line(done.stderr)
    finally:
        os.close(held)
    os.close(lock_repository(repo))  # released with its descriptor: free again


def test_a_serving_engine_has_frozen_its_heap(tiny: Tiny, tmp_path: Path) -> None:
    """After loading, the engine moves its long-lived objects out of the cyclic collector's
    sight, so no full collection walks them on the compute thread (bench.heap)."""
    address = f"127.0.0.1:{processes.free_port()}"
    log = tmp_path / "engine.log"
    engine = processes.spawn(["engine", "--repository", str(tiny.repo), "--listen", address], log)
    try:
        processes.wait_engine(address, engine, log)
        serving = processes.wait_for_line(log, "engine serving", engine)
    finally:
        assert processes.stop(engine) == 0, processes.last_words(log)
    frozen = re.search(r"; ([\d,]+) objects frozen out of the collector\)", serving)
    assert frozen is not None, serving
    assert int(frozen.group(1).replace(",", "")) > 10_000  # torch and the model, at least


def test_an_engine_on_port_0_says_the_port_it_serves_on(tiny: Tiny, tmp_path: Path) -> None:
    """`--listen HOST:0` and `--metrics HOST:0` let the system pick the ports; the serving line
    names the ones picked."""
    log = tmp_path / "engine.log"
    args = ["engine", "--repository", str(tiny.repo), "--listen", "127.0.0.1:0"]
    engine = processes.spawn([*args, "--metrics", "127.0.0.1:0"], log)
    try:
        serving = processes.wait_for_line(log, "engine serving", engine)
        port = re.search(r" on 127\.0\.0\.1:(\d+); ", serving)
        assert port is not None and int(port.group(1)) > 0, serving
        processes.wait_engine(f"127.0.0.1:{port.group(1)}", engine, log)
        metrics = re.search(r"; metrics on 127\.0\.0\.1:(\d+) ", serving)
        assert metrics is not None, serving
        url = f"http://127.0.0.1:{metrics.group(1)}/metrics"
        with urllib.request.urlopen(url, timeout=30) as page:
            assert b"nv_inference_request_success" in page.read()
    finally:
        assert processes.stop(engine) == 0, processes.last_words(log)


@pytest.mark.parametrize("listen", ["nosuch.invalid:5000", "192.0.2.1:5000"])
def test_an_address_the_engine_cannot_listen_on_is_refused_before_loading(
    tiny: Tiny, tmp_path: Path, listen: str
) -> None:
    """A name that does not resolve, or an address this host does not have (TEST-NET-1)."""
    repo = tmp_path / "repo"
    shutil.copytree(tiny.repo, repo)
    done = engine_cli(repo, "--listen", listen)
    assert done.returncode == 2
    assert _one_line(done.stderr).startswith(f"appliance engine: cannot listen on {listen}: ")


def test_a_metrics_port_in_use_is_refused_before_loading(tiny: Tiny, tmp_path: Path) -> None:
    """`--metrics` on a port another process holds is refused as `--listen` is, in one line with
    exit 2, before the models load (here a missing checkpoint would be named if they did)."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny.model_dir, model_dir)
    repo = _repo_for(model_dir, tmp_path)
    shutil.rmtree(model_dir)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        done = engine_cli(repo, "--metrics", taken)
    assert done.returncode == 2
    assert _one_line(done.stderr).startswith(f"appliance engine: cannot listen on {taken}: ")
