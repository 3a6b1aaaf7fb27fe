"""Triton's own benchmark client against the engine server: NVIDIA's perf_analyzer, unmodified, over
gRPC with --streaming, measures the tensorrt_llm model and reads the server-side statistics (which it
does only when ServerMetadata lists the "statistics" extension).

The engine server runs in this process on loopback; perf_analyzer is a subprocess awaited without
blocking the loop that serves it.
"""

from __future__ import annotations

import asyncio
import csv
import json
from pathlib import Path

import pytest

from tests.conftest import Engine
from tests.engine.perf_analyzer import PerfAnalyzer, install

pytestmark = pytest.mark.timeout(600)

MODEL = "tensorrt_llm"
PROMPT = [1, 300, 301, 302, 303, 304]
OUTPUT_TOKENS = 4
REQUESTS = 6


@pytest.fixture(scope="session")
def perf_analyzer(tmp_path_factory: pytest.TempPathFactory) -> PerfAnalyzer:
    return install(tmp_path_factory.mktemp("perf_analyzer"))


def _input_data(path: Path) -> Path:
    # Shapes without the batch dimension (max_batch_size 1); only the required inputs and
    # `streaming`: perf_analyzer sends an optional input only when the data names it.
    step = {
        "input_ids": {"content": PROMPT, "shape": [len(PROMPT)]},
        "input_lengths": [len(PROMPT)],
        "request_output_len": [OUTPUT_TOKENS],
        "streaming": [True],
    }
    path.write_text(json.dumps({"data": [step]}))
    return path


async def test_perf_analyzer_streams_from_the_engine_server_with_server_statistics(
    engine: Engine, perf_analyzer: PerfAnalyzer, tmp_path: Path
) -> None:
    report = tmp_path / "report.csv"
    argv = [
        str(perf_analyzer.binary),
        "-m",
        MODEL,
        "-u",
        engine.address,
        "-i",
        "grpc",
        "--streaming",
        "--input-data",
        str(_input_data(tmp_path / "input.json")),
        "--concurrency-range",
        "1",
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        str(REQUESTS),
        "--max-trials",
        "3",
        "--stability-percentage",
        "999",
        "--verbose-csv",
        "-f",
        str(report),
    ]
    process = await asyncio.create_subprocess_exec(
        *argv,
        env=perf_analyzer.env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out_bytes, _ = await asyncio.wait_for(process.communicate(), timeout=300)
    out = out_bytes.decode(errors="replace")
    assert process.returncode == 0, out
    # Server-side statistics were read (perf_analyzer prints this block only then).
    assert "Server: " in out and "Inference count:" in out, out
    assert "Compute infer" in out or "compute infer" in out.lower(), out
    rows = list(csv.DictReader(report.read_text().splitlines()))
    assert rows and float(rows[0]["Inferences/Second"]) > 0, report.read_text()
    assert int(rows[0]["Server Compute Infer"]) > 0, rows[0]
