"""``host-tune``: facts, plan, apply, verify, revert, hold-latency.

Exit codes: ``host_tuning.actions.EXIT_CODES`` (printed by ``--help``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

from appliance.cliargs import Parser, os_error_line
from appliance.logline import escape
from host_tuning import actions, holdlatency, profile, render, textfile
from host_tuning.cores import PlanError, cpu_affinity_dropin
from host_tuning.facts.collect import collect
from host_tuning.planner import TuningPlan, make_plan
from host_tuning.plugins.base import Context
from host_tuning.rootfs import Root
from host_tuning.state import STATE_FILE, STOP_SIGNALS, Busy, StateError, locked


class CliError(Exception):
    """Operator-facing refusal: printed without a traceback, exit 2."""


class Interrupted(Exception):
    """apply or revert stopped by a signal; what it had changed is in the state file. Exit 1."""


@contextlib.contextmanager
def _stoppable(what: str, root: Root) -> Iterator[None]:
    """Turn SIGTERM, SIGHUP and SIGINT into an exception raised where the work stands.

    By default SIGTERM and SIGHUP end Python at once, skipping the ``finally`` that saves the
    prior values of what was already changed: revert could then not undo it.
    """

    pid = os.getpid()

    def stop(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != pid:
            # A forked helper (pyroute2 forks one to enter a network namespace) inherits this
            # handler: it ends as the signal would have ended it, never runs on as host-tune.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # the state is being saved: once is enough
        name = signal.Signals(signum).name
        if what == "apply":
            raise Interrupted(
                f"apply stopped by {name}; the settings it changed are saved in "
                f"{root.path(STATE_FILE)}: rerun apply to finish, or revert to undo them"
            )
        raise Interrupted(f"revert stopped by {name}; rerun revert to restore the rest")

    old = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="host-tune",
        description="facts, plan, apply, verify, revert, hold-latency",
        epilog="exit codes:\n"
        + "\n".join(f"  {code} {meaning}" for code, meaning in actions.EXIT_CODES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # one line per exit code
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp: argparse.ArgumentParser, needs_profile: bool, json_flag: bool = True) -> None:
        sp.add_argument(
            "--root",
            default="/",
            help="read and write under this directory (default: /, this host)",
        )
        sp.add_argument("--no-nvml", action="store_true", help="find GPUs in sysfs only")
        if needs_profile:
            sp.add_argument("--profile", required=True, help="TOML profile")
        if json_flag:
            sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = sub.add_parser("facts", help="print the host's facts (JSON)")
    common(sp, False, False)
    # Facts are always JSON; the flag is accepted so every command takes --json (Ansible).
    sp.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    sp = sub.add_parser("plan", help="show the settings the profile implies")
    common(sp, True)
    sp.add_argument(
        "--affinity-dropin",
        choices=("gateway", "triton"),
        help="print a systemd CPUAffinity= drop-in for that unit's planned cores",
    )
    for name in ("apply", "verify"):
        sp = sub.add_parser(name, help=f"{name} the plan")
        common(sp, True)
        sp.add_argument("--verbose", action="store_true", help="also list settled settings")
        sp.add_argument(
            "--dry-run",
            action="store_true",
            help="show the diff, change nothing"
            if name == "apply"
            else "accepted for symmetry (Ansible check mode): verify never changes anything",
        )
    sp.add_argument(
        "--textfile",
        metavar="PATH",
        help="also write the result for node_exporter's textfile collector to PATH (*.prom), "
        "replaced whole",
    )
    sp = sub.add_parser("revert", help="restore the values saved by apply")
    common(sp, False)
    sp.add_argument(
        "--dry-run",
        action="store_true",
        help="list the saved settings revert would restore and change nothing "
        "(default: restore them)",
    )
    sp.add_argument(
        "--verbose",
        action="store_true",
        help="accepted like apply's and verify's; revert always lists every setting it restores",
    )
    sp = sub.add_parser("hold-latency", help="hold /dev/cpu_dma_latency open at a value")
    sp.add_argument("--us", type=int, help="latency in microseconds")
    sp.add_argument("--profile", help="take pm_qos_latency_us from this profile")
    sp.add_argument("--path", default=holdlatency.DEFAULT_PATH, help=argparse.SUPPRESS)
    return p


def _require_root(root: Root, what: str) -> None:
    if root.is_host and os.geteuid() != 0:
        raise CliError(
            f"host-tune {what} changes kernel settings of this machine and must run as root "
            "(sudo host-tune ...); use --dry-run to preview, or --root DIR for a copy"
        )


def _plan(args: argparse.Namespace, root: Root) -> tuple[TuningPlan, Context]:
    prof = profile.load(args.profile)
    plan = make_plan(collect(root, use_nvml=not args.no_nvml), prof)
    return plan, Context(root=root, netns=prof.netns)


def _results(
    args: argparse.Namespace, results: list[actions.Result], plan: TuningPlan | None = None
) -> int:
    code = actions.exit_code(results)
    if getattr(args, "textfile", None):
        # Before stdout: a write that fails leaves stdout empty, as every exit-1 error outside
        # the per-setting results does.
        textfile.replace(Path(args.textfile), textfile.exposition(results, code, time.time()))
    notes = render.plan_notes(plan, args.cmd == "apply") if plan is not None else []
    if args.json:
        print(render.results_json(args.cmd, results, code, notes))
    else:
        print(render.results_table(args.cmd, results, args.verbose, notes), end="")
    return code


def run(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "hold-latency":
        us = args.us
        if us is None:
            prof = profile.load(args.profile) if args.profile else profile.Profile()
            us = prof.pm_qos_latency_us
        try:
            holdlatency.encode(us)
        except ValueError as exc:
            raise CliError(f"hold-latency --us {us}: {exc}") from exc
        try:
            return holdlatency.hold(us, args.path)
        except PermissionError as exc:
            raise CliError(f"cannot open {args.path}: {exc.strerror}; run as root") from exc
        except OSError as exc:
            raise CliError(f"cannot open {args.path}: {exc.strerror or exc}") from exc
    root = Root(args.root)
    if not root.base.is_dir():
        raise CliError(f"--root {args.root}: not a directory")
    if args.cmd == "facts":
        facts = collect(root, use_nvml=not args.no_nvml)
        print(json.dumps(dataclasses.asdict(facts), indent=1))
        return 0
    if args.cmd == "plan":
        plan, _ = _plan(args, root)
        if args.affinity_dropin:
            cpus = plan.cores.gateway if args.affinity_dropin == "gateway" else plan.cores.triton
            print(cpu_affinity_dropin(cpus, args.affinity_dropin), end="")
        elif args.json:
            print(render.plan_json(plan))
        else:
            print(render.plan_table(plan), end="")
        return 0
    if args.cmd == "apply":
        if not args.dry_run:
            _require_root(root, "apply")
        plan, ctx = _plan(args, root)
        if args.dry_run:
            return _results(args, actions.apply(ctx, plan.items, dry_run=True), plan)
        with locked(root), _stoppable("apply", root):
            results = actions.apply(ctx, plan.items)
        return _results(args, results, plan)
    if args.cmd == "verify":
        if args.textfile and (why := textfile.refusal(Path(args.textfile))):
            raise CliError(f"--textfile {args.textfile}: {why}")
        plan, ctx = _plan(args, root)
        results = actions.verify(ctx, plan.items) + actions.conflict_results(plan.conflicts)
        code = _results(args, results, plan)
        pending = [r for r in results if r.status == actions.REBOOT]
        if pending:
            # The JSON says so too, but `host-tune verify && ...` reads only the exit status.
            print(escape(f"host-tune: {render.pending_line(pending)}"), file=sys.stderr)
        return code
    if args.cmd == "revert":
        if args.dry_run:
            return _results(args, actions.revert(Context(root=root), dry_run=True))
        _require_root(root, "revert")
        with locked(root), _stoppable("revert", root):
            results = actions.revert(Context(root=root))
        return _results(args, results)
    raise AssertionError(args.cmd)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(argv)
    except (CliError, profile.ProfileError, PlanError, StateError) as exc:
        print(escape(f"host-tune: {exc}"), file=sys.stderr)
        return actions.EXIT_USAGE
    except (Interrupted, Busy) as exc:
        print(escape(f"host-tune: {exc}"), file=sys.stderr)
        return actions.EXIT_FAILED
    except OSError as exc:
        # A read or write outside the per-setting results (state file, sysfs listing, ...).
        print(escape(f"host-tune: {os_error_line(exc)}"), file=sys.stderr)
        return actions.EXIT_FAILED
