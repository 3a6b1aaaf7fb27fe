"""The bench's PNG plots (900×500 px): latency CDFs, percentiles against load, and a timeline of
every request. Figures are drawn without pyplot, so no display or global backend is involved."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from appliance.loadgen.report import write_file
from appliance.loadgen.stats import OK, LevelSummary, Record

logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font cache notices are not ours
SIZE = (9.0, 5.0)
DPI = 100


def _save(fig: Figure, path: Path) -> None:
    """The figure as a PNG file, written whole or not at all."""
    png = io.BytesIO()
    fig.savefig(png, format="png")
    write_file(path, png.getvalue())


def _figure() -> Figure:
    return Figure(figsize=SIZE, dpi=DPI, layout="constrained")


Series = tuple[str, list[float], str, int]  # label, values (s), line style, colour index


def _cdf(path: Path, title: str, xlabel: str, series: list[Series]) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    positive = [v for _, values, _, _ in series for v in values if v > 0]
    for label, values, style, colour in series:
        if values:
            ms = np.asarray(values) * 1e3
            ax.ecdf(ms, label=label, ls=style, color=f"C{colour % 10}")
    if positive and max(positive) / min(positive) > 50:
        ax.set_xscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel="fraction of samples ≤ x", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    if any(values for _, values, _, _ in series):
        ax.legend(fontsize="small")
    _save(fig, path)


def _vs_load(path: Path, summaries: list[LevelSummary]) -> None:
    fig = _figure()
    labels = [s.level for s in summaries]
    x = np.arange(len(labels))
    for i, (key, title) in enumerate(
        (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency"))
    ):
        ax = fig.add_subplot(1, 2, i + 1)
        for colour, (q, marker) in enumerate((("p50", "o"), ("p99", "^"))):
            y = np.array([getattr(d, q) if (d := s.metrics[key]) else np.nan for s in summaries])
            for mode in ("concurrency", "rate"):
                # Closed- and open-loop levels are different axes of load: never joined by a line.
                at = np.array([s.mode == mode for s in summaries])
                if at.any():
                    label = q.upper() if mode == summaries[0].mode else None
                    ax.plot(x[at], y[at], marker=marker, color=f"C{colour}", label=label)
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize="small")
        ax.set(title=title, ylabel="ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    _save(fig, path)


def _timeline(path: Path, records: list[Record]) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    done = sorted((r for r in records if r.latency_s is not None), key=lambda r: r.start_s)
    y = np.arange(len(done))
    start = np.array([r.start_s for r in done])
    end = start + np.array([r.latency_s or 0.0 for r in done])
    first = start + np.array([r.ttft_s or 0.0 for r in done])
    answered = np.array([r.status == OK and r.ttft_s is not None for r in done], dtype=bool)
    failed = np.array([r.status != OK for r in done], dtype=bool)
    # One collection per colour: thousands of requests stay three artists.
    a = answered
    ax.hlines(y[a], start[a], first[a], color="tab:orange", lw=1.5, label="sent → first token")
    ax.hlines(y[a], first[a], end[a], color="tab:blue", lw=1.5, label="first token → end")
    ax.hlines(y[failed], start[failed], end[failed], color="tab:red", lw=1, label="error")
    levels: dict[str, tuple[float, float]] = {}
    for r, e in zip(done, end, strict=True):
        lo, hi = levels.get(r.level, (r.start_s, r.start_s))
        levels[r.level] = (min(lo, r.start_s), max(hi, float(e)))
    for i, (label, (lo, _)) in enumerate(levels.items()):
        ax.axvline(lo, color="grey", lw=0.5, ls=":")
        top = 0.98 - 0.045 * (i % 2)
        ax.text(
            lo, top, f" {label}", transform=ax.get_xaxis_transform(), fontsize="x-small", va="top"
        )
    ax.set(title="requests over time", xlabel="seconds since the run started", ylabel="request")
    ax.legend(fontsize="small", loc="lower right")
    _save(fig, path)


def draw(out: Path, summaries: list[LevelSummary], records: list[Record]) -> list[Path]:
    """Writes the plots into `out`; returns their paths."""
    by_level = [(s.level, [r for r in records if r.level == s.level]) for s in summaries]
    paths = [
        out / n for n in ("ttft_cdf.png", "itl_cdf.png", "latency_vs_load.png", "timeline.png")
    ]
    _cdf(
        paths[0],
        "time to first token (CDF)",
        "TTFT (ms)",
        [
            (lv, [r.ttft_s for r in rs if r.status == OK and r.ttft_s is not None], "-", i)
            for i, (lv, rs) in enumerate(by_level)
        ],
    )
    itl: list[Series] = [
        (lv, [v for r in rs if (v := r.itl_s) is not None], "-", i)
        for i, (lv, rs) in enumerate(by_level)
    ]
    gaps: list[Series] = [
        (f"{lv} chunk gaps", [g for r in rs if r.generated for g in r.gaps_s], ":", i)
        for i, (lv, rs) in enumerate(by_level)
    ]
    _cdf(
        paths[1],
        "inter-token latency per request (solid) and pooled chunk gaps (dotted), CDF",
        "ms",
        itl + gaps,
    )
    _vs_load(paths[2], summaries)
    _timeline(paths[3], records)
    return paths
