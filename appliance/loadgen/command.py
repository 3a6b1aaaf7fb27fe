"""`appliance bench`: checks the command line, runs the sweep, prints and writes the results.

Exit status: 0 done (request errors are results, counted in the tables), 1 the deployment failed
the first request for a reason of its own, or during the run became unreachable, answered only
UNAVAILABLE, stopped answering (--stop-after-timeouts) or refused the API key (revoked, or its
scopes changed), 2 a wrong option, input file, address or API key, 130 interrupted by SIGINT and 143 by SIGTERM (in the cases after the first
request what was measured is still printed and written).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from appliance.cliargs import INTERRUPTED_EXIT
from appliance.client import add_credential_options
from appliance.loadgen import report
from appliance.loadgen.options import BenchInputError, Settings, settings
from appliance.loadgen.progress import Progress
from appliance.loadgen.runner import BenchRunError, LoadRunner, open_channel
from appliance.loadgen.stats import LevelSummary, Record, summarize
from appliance.loadgen.workload import Prompt, load_prompts
from appliance.logline import escape
from appliance.v1 import inference_pb2_grpc as pb_grpc

PROG = "appliance bench"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Numbers and the options it needs are read by `options.settings`, so a malformed or missing
    # one is a one-line error too (argparse's refusal prints the whole usage block).
    p.add_argument("--address", help="the deployment's gateway, HOST:PORT (required)")
    p.add_argument("--model", help="model name, as the deployment serves it (required)")
    p.add_argument(
        "--concurrency", help="closed-loop levels: concurrent clients, e.g. 1,2,4,8 (default 1)"
    )
    p.add_argument("--rate", help="open-loop levels: Poisson arrivals per second, e.g. 5,10")
    p.add_argument("--requests", help="requests per level (default 20)")
    p.add_argument("--duration", help="seconds per level (instead of --requests)")
    p.add_argument("--warmup", default=2, help="unrecorded requests first (default 2)")
    p.add_argument(
        "--prompt-tokens",
        help="synthetic prompt length: N, normal:MEAN,STDDEV or uniform:LOW,HIGH (default 128); "
        "approximated with words, the reported input tokens are the gateway's count",
    )
    p.add_argument(
        "--output-tokens",
        default="64",
        help="max_tokens per request, same forms (default 64); a model may stop earlier",
    )
    p.add_argument(
        "--prompts",
        help="prompt file: one prompt per line, or JSONL of {prompt|messages[, max_tokens]}",
    )
    p.add_argument(
        "--cache-policy",
        default="bypass",
        help="bypass (default: every request reaches the engine), default (cache hits count), "
        "refresh",
    )
    p.add_argument("--temperature", default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", default=0, help="seed of lengths, prompts and arrivals")
    p.add_argument("--timeout", default=120.0, help="per-request deadline, s")
    p.add_argument("--connect-timeout", default=10.0, help="wait for the address, s (default 10)")
    p.add_argument(
        "--max-in-flight",
        default=1000,
        help="open loop: outstanding requests at most; an arrival over it is counted as NOT_SENT "
        "(default 1000)",
    )
    p.add_argument(
        "--stop-after-timeouts",
        default=3,
        help="end the run once this many requests in a row got no answer at all within "
        "--timeout (a gateway that stopped answering); 0: never (default 3)",
    )
    p.add_argument("--out", help="directory for bench.json, requests.csv and the PNG plots")
    add_credential_options(p, "the API key every request presents")


def _out_dir(path: Path | None) -> None:
    """Creates the output directory and proves it writable before any request is sent."""
    if path is None:
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".bench-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise BenchInputError(f"--out {path}: {exc.strerror or exc}") from None


class SweepResult:
    def __init__(self) -> None:
        self.records: list[Record] = []
        self.summaries: list[LevelSummary] = []
        self.warmup: dict[str, int] = {}
        self.interrupted = False
        self.signal = signal.SIGINT  # the first one received, when interrupted
        self.lost: str | None = None  # why the target stopped answering, when it did
        self.started = datetime.now(UTC)


async def _sweep(s: Settings, prompts: list[Prompt] | None, outcome: SweepResult) -> None:
    progress = Progress(sys.stderr)
    channel = await open_channel(s.target)
    loop = asyncio.get_running_loop()
    async with channel:
        runner = LoadRunner(s, prompts, pb_grpc.InferenceStub(channel), progress, channel)

        def on_signal(signum: signal.Signals) -> None:
            # A second SIGINT or SIGTERM ends the process at once.
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
            outcome.interrupted = True
            outcome.signal = signum
            progress.say("interrupted: ending the requests in flight, then writing the results")
            runner.interrupt()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await runner.preflight()
            if s.warmup:
                progress.say(f"warm-up: {s.warmup} requests")
                outcome.warmup = await runner.warmup()
            for i, level in enumerate(s.levels):
                if runner.stopping.is_set():
                    break
                records = await runner.level(i, level)
                summary = summarize(level, records)
                outcome.summaries.append(summary)
                print(f"\n{report.level_table(summary)}", flush=True)
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
            outcome.records = runner.records
            outcome.lost = runner.lost


def _run_info(s: Settings, outcome: SweepResult, argv: list[str]) -> dict[str, Any]:
    return {
        "command": " ".join(["appliance", "bench", *argv]),
        "started": outcome.started.isoformat(timespec="seconds"),
        "address": s.target.address,
        "tls": s.target.tls_mode,
        "api_key": s.target.credentials.key_id,
        "model": s.model,
        "levels": [lv.label for lv in s.levels],
        "requests_per_level": s.requests,
        "duration_per_level_s": s.duration_s,
        "warmup": s.warmup,
        "warmup_statuses": outcome.warmup,
        "prompt_tokens": None if s.prompts_file else s.prompt_tokens.describe(),
        "prompts_file": str(s.prompts_file) if s.prompts_file else None,
        "output_tokens": s.output_tokens.describe(),
        "cache_policy": s.cache_policy,
        "temperature": s.temperature,
        "seed": s.seed,
        "interrupted": outcome.interrupted,
        "unreachable": outcome.lost,
        "client_host": platform.node(),
        "client_cpus": os.cpu_count(),
    }


def _write(s: Settings, outcome: SweepResult, argv: list[str]) -> str | None:
    """Writes the files of `--out`; returns what could not be written (None: all were)."""
    if s.out is None:
        return None
    from appliance.loadgen import plots  # matplotlib: loaded only when files are written

    def summary_md(path: Path) -> None:
        tables = [report.level_table(x) for x in outcome.summaries]
        text = "\n\n".join([*tables, report.sweep_table(outcome.summaries)]) + "\n"
        report.write_file(path, text.encode())

    files: list[tuple[str, Callable[[Path], None]]] = [
        (
            "bench.json",
            lambda path: report.write_json(
                path, _run_info(s, outcome, argv), outcome.summaries, outcome.records
            ),
        ),
        ("requests.csv", lambda path: report.write_csv(path, outcome.records)),
        ("summary.md", summary_md),
    ]
    for name, write in files:
        try:
            write(s.out / name)
        except OSError as exc:
            with contextlib.suppress(OSError):
                (s.out / name).unlink(missing_ok=True)  # an earlier run's would pass for this one's
            return f"--out {s.out}: writing {name} failed: {exc.strerror or exc}"
    try:
        plots.draw(s.out, outcome.summaries, outcome.records)
    except OSError as exc:
        return f"--out {s.out}: writing the plots failed: {exc.strerror or exc}"
    print(f"wrote {s.out}/: bench.json, requests.csv, summary.md, 4 PNG plots", flush=True)
    return None


def run(args: argparse.Namespace, argv: list[str]) -> int:
    import uvloop

    try:
        s = settings(args)
        prompts = load_prompts(s.prompts_file) if s.prompts_file else None
        _out_dir(s.out)
    except BenchInputError as exc:
        print(escape(f"{PROG}: {exc}"), file=sys.stderr)
        return 2
    outcome = SweepResult()
    started = time.monotonic()
    try:
        uvloop.run(_sweep(s, prompts, outcome))
    except BenchInputError as exc:
        print(escape(f"{PROG}: {exc}"), file=sys.stderr)
        return 2
    except BenchRunError as exc:
        print(escape(f"{PROG}: {exc}"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C while connecting, or a second Ctrl-C: stop at once, nothing is written.
        why = "again: stopped at once" if outcome.interrupted else "while connecting"
        print(escape(f"{PROG}: interrupted {why}; nothing written"), file=sys.stderr)
        return INTERRUPTED_EXIT
    try:
        print(f"\n{report.sweep_table(outcome.summaries)}")
        print(f"definitions: {report.DEFINITIONS}")
        print(f"sweep took {time.monotonic() - started:.1f} s", flush=True)
        unwritten = _write(s, outcome, argv)
    except KeyboardInterrupt:
        # Ctrl-C (a second one, or the first after the last level) while the results go out.
        where = f"; the files in {s.out} may be incomplete" if s.out is not None else ""
        print(escape(f"{PROG}: interrupted while writing the results{where}"), file=sys.stderr)
        return INTERRUPTED_EXIT
    if unwritten is not None:
        print(escape(f"{PROG}: {unwritten}; the tables are printed above"), file=sys.stderr)
    if outcome.interrupted:
        return 128 + outcome.signal
    if unwritten is not None:
        return 1
    if outcome.lost is not None:
        kept = "printed above" + (f" and written to {s.out}" if s.out is not None else "")
        print(
            escape(f"{PROG}: {outcome.lost}; what was measured before is {kept}"), file=sys.stderr
        )
        return 1
    return 0
