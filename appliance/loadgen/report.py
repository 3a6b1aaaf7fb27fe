"""The bench's tables (text) and its files: JSON with every record and the summaries, CSV with one
row per request. A file is written whole or not at all (`write_file`): an interrupted write never
leaves a cut-off file that passes for a whole one."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from appliance.loadgen.stats import METRICS, NOT_SENT, LevelSummary, Record
from appliance.logline import escape
from appliance.wholefile import write_whole

DEFINITIONS = (
    "TTFT = first non-empty response − request sent; inter-token latency = (request latency − TTFT)"
    " / (output tokens − 1) per generated answer (genai-perf); chunk gap = every gap between"
    " streamed messages, pooled (vLLM's ITL); percentiles: numpy, linear."
)
COLUMNS = ("avg", "p50", "p90", "p99", "min", "max")
# Characters of a server's error message a table shows (the whole one is in requests.csv).
MAX_ERROR_SHOWN = 300


def _cell(value: float) -> str:
    return f"{value:10.2f}" if abs(value) < 1e7 else f"{value:10.3g}"


def level_table(summary: LevelSummary) -> str:
    """A genai-perf-style table of one level, in Markdown; `n` is the number of values each row's
    figures are computed over (answers, or gaps for the pooled chunk gap)."""
    s = summary
    not_sent = s.errors.get(NOT_SENT, 0)
    head = (
        f"{s.level}: {s.sent} sent, {s.ok} ok, {sum(s.errors.values()) - not_sent} errors"
        + (f", {not_sent} not sent (over --max-in-flight)" if not_sent else "")
        + (f", {s.interrupted} interrupted" if s.interrupted else "")
        + f" in {s.wall_s:.2f} s"
    )
    lines = [
        head,
        f"| {'metric':<36} | {'n':>7} | " + " | ".join(f"{c:>10}" for c in COLUMNS) + " |",
    ]
    lines.append(
        "|" + "-" * 38 + "|" + "-" * 8 + ":|" + "|".join("-" * 11 + ":" for _ in COLUMNS) + "|"
    )
    for key, title, _ in METRICS:
        d = s.metrics[key]
        cells = [_cell(getattr(d, c)) for c in COLUMNS] if d else [f"{'-':>10}"] * len(COLUMNS)
        lines.append(f"| {title:<36} | {d.n if d else 0:>7} | " + " | ".join(cells) + " |")
    blank = [f"{'':>10}"] * (len(COLUMNS) - 1)
    for title, value in (
        ("Output token throughput (tokens/s)", s.output_token_throughput),
        ("Request throughput (requests/s)", s.request_throughput),
    ):
        lines.append(f"| {title:<36} | {s.ok:>7} | " + " | ".join([_cell(value), *blank]) + " |")
    if s.errors:
        lines.append("errors: " + ", ".join(f"{k} {v}" for k, v in s.errors.items()))
        # The server's words, as they came: escaped (no terminal control) and cut.
        for status, message in s.first_errors.items():
            cut = "..." if len(message) > MAX_ERROR_SHOWN else ""
            shown = escape(message[:MAX_ERROR_SHOWN]) + cut
            lines.append(f"  {status}, the first: {shown}")
    if s.cache_tiers:
        lines.append("answered by: " + ", ".join(f"{k} {v}" for k, v in s.cache_tiers.items()))
    return "\n".join(lines)


def sweep_table(summaries: list[LevelSummary]) -> str:
    """One line per level: the figures that move with load."""
    head = (
        "| level | ok | errors | requests/s | output tokens/s | TTFT P50 ms | TTFT P99 ms "
        "| ITL P50 ms | ITL P99 ms |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        ttft, itl = s.metrics["ttft_ms"], s.metrics["itl_ms"]

        cells = [
            "-" if d is None else f"{getattr(d, q):.2f}"
            for d in (ttft, itl)
            for q in ("p50", "p99")
        ]
        lines.append(
            f"| {s.level} | {s.ok} | {sum(s.errors.values())} | {s.request_throughput:.2f} "
            f"| {s.output_token_throughput:.1f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def record_dict(r: Record) -> dict[str, Any]:
    out = {f.name: getattr(r, f.name) for f in fields(r)}
    out["itl_s"] = r.itl_s
    return out


CSV_COLUMNS = [f.name for f in fields(Record) if f.name != "gaps_s"] + ["itl_s", "chunks"]


def write_json(
    path: Path, run: dict[str, Any], summaries: list[LevelSummary], records: list[Record]
) -> None:
    document = {
        "run": run,
        "definitions": DEFINITIONS,
        "levels": [s.as_dict() for s in summaries],
        "requests": [record_dict(r) for r in records],
    }
    write_file(path, (json.dumps(document, indent=1) + "\n").encode())


def write_csv(path: Path, records: list[Record]) -> None:
    f = io.StringIO(newline="")
    writer = csv.DictWriter(f, CSV_COLUMNS)
    writer.writeheader()
    for r in records:
        row = record_dict(r)
        row["chunks"] = len(row.pop("gaps_s")) + (r.ttft_s is not None)
        writer.writerow(row)
    write_file(path, f.getvalue().encode())


def write_file(path: Path, data: bytes) -> None:
    """Replaces `path` with `data` whole (readable by all, as a results file is)."""
    write_whole(path, data, 0o644)
