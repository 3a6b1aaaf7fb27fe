"""``engine-build plan|build|repo|verify``.

Every refusal is one line on stderr prefixed ``engine-build: error:`` and a non-zero exit, the
convention of all three CLIs: 2 when the command line or the spec is wrong (fix the input and
rerun), 1 when the work failed (checkpoint, TensorRT-LLM, a stage, NVML, the repository), and 3
when the model does not fit the GPU (so scripts can tell "fix the spec" from "buy memory").
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from appliance.cliargs import INTERRUPTED_EXIT, Parser, os_error_line
from appliance.logline import escape
from appliance.wholefile import write_whole
from engine_build import commands, formats, gpu, planner, runner, runtime
from engine_build.checkpoint import read_shape, read_shape_for
from engine_build.errors import BuildError, DoesNotFit, SpecError
from engine_build.repo import write_repository
from engine_build.spec import BuildSpec, load_spec, plugin_problem
from engine_build.verify import verify_repository

EXIT_ERROR = 1
EXIT_INPUT = 2
EXIT_NOFIT = 3


def _gpu_memory(spec: BuildSpec, arg: str | None) -> int:
    if arg is not None:
        return gpu.parse_size(arg)
    return gpu.nvml_total_memory(spec.gpu_ids)


def planned_script(spec: BuildSpec) -> list[str]:
    """The exact commands ``build`` runs, in order, as shell lines.

    Each tool writes into ``<dir>.partial`` that is renamed into place only after success; the
    ``rm``/``mv`` lines make the script reproduce that (fingerprint stamps and skipping are
    ``build``'s own and not part of the script).
    """
    lines = [commands.render(commands.version_command(spec))]
    for stage in runner.stages(spec):
        partial = stage.output.with_name(stage.output.name + ".partial")
        lines.append(commands.render(["rm", "-rf", str(partial)]))
        lines.append(commands.render(stage.argv_for(partial)))
        lines.append(commands.render(["rm", "-rf", str(stage.output)]))
        lines.append(commands.render(["mv", str(partial), str(stage.output)]))
    return lines


def check_output_file(path: Path, option: str) -> None:
    """Refuse an output file path that cannot be written, before any work: a directory, or a
    file in a folder that does not exist (no folder is created for it)."""
    if path.is_dir():
        raise SpecError(f"{option} {path}: is a directory; give the path of a file to write")
    if not path.parent.is_dir():
        what = "is not a directory" if path.parent.exists() else "does not exist"
        raise SpecError(f"{option} {path}: the folder {path.parent} {what}; create it first")


def check_output_dir(path: Path, option: str) -> None:
    """Refuse an output directory path whose parent folder is missing, or that is a file."""
    if path.exists() and not path.is_dir():
        raise SpecError(f"{option} {path}: exists and is not a directory")
    if not path.parent.is_dir():
        what = "is not a directory" if path.parent.exists() else "does not exist"
        raise SpecError(f"{option} {path}: the folder {path.parent} {what}; create it first")


def _capability(spec: BuildSpec, args: argparse.Namespace) -> tuple[int, int] | None:
    """The GPUs' compute capability: ``--compute-capability``, else NVML when the memory comes
    from NVML too; None (not checked) when planning elsewhere with ``--gpu-memory`` alone."""
    if args.compute_capability is not None:
        try:
            return formats.parse_capability(args.compute_capability)
        except ValueError as err:
            raise SpecError(str(err)) from err
    if args.gpu_memory is None:
        return gpu.nvml_compute_capability(spec.gpu_ids)
    return None


def check_gpu(spec: BuildSpec, capability: tuple[int, int] | None) -> None:
    """Refuse a weight or KV-cache format the GPU cannot run, before any work."""
    if capability is None:
        print(
            "compute capability not checked (pass --compute-capability to check "
            f"{spec.quantization} / KV {spec.kv_cache_dtype} against the GPU)"
        )
        return
    why = formats.capability_problem(
        spec.quantization, spec.kv_cache_dtype, capability
    ) or plugin_problem(spec, capability)
    if why:
        raise SpecError(why)


def check_fit(spec: BuildSpec, gpu_memory: str | None) -> planner.FitPlan:
    """Print the table; raise :class:`DoesNotFit` with what to change when it does not fit."""
    shape = read_shape_for(spec)
    planner.check_groups(shape, spec)
    s = spec.speculative
    other = s.draft_hf_model_dir if s.mode == "draft_target" else s.eagle_model_dir
    draft_shape = read_shape(other) if s.mode in ("draft_target", "eagle") and other else None
    if draft_shape is not None and s.mode == "draft_target":
        planner.check_groups(draft_shape, spec)
    cost = planner.draft_cost(shape, spec, draft_shape)
    plan = planner.make_plan(shape, spec, _gpu_memory(spec, gpu_memory), cost)
    print(planner.render_table(plan, spec))
    if not plan.fits:
        raise DoesNotFit(
            f"{shape.architecture} does not fit: needs {plan.required_bytes / planner.GIB:.2f} GiB "
            f"per GPU, has {plan.gpu_memory_bytes / planner.GIB:.2f} GiB; "
            + "; ".join(planner.advice(plan, spec))
        )
    return plan


def cmd_plan(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    if args.commands_out is not None:
        check_output_file(args.commands_out, "--commands-out")
    script = "\n".join(planned_script(spec)) + "\n"
    check_gpu(spec, _capability(spec, args))
    try:
        check_fit(spec, args.gpu_memory)
    except DoesNotFit:
        # The table is out; the commands still show what would run once the spec is fixed.
        print("\n# commands `engine-build build` would run (after fixing the fit):")
        print(script, end="")
        raise
    print("\n# commands `engine-build build` runs:")
    print(script, end="")
    if args.commands_out is not None:
        write_whole(args.commands_out, ("#!/bin/sh\nset -eu\n" + script).encode())
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    runtime.require_single_gpu(spec)
    check_gpu(spec, _capability(spec, args))
    check_fit(spec, args.gpu_memory)
    results = runner.BuildRunner(spec, quiet=args.quiet).run(force=args.force)
    built = [r.name for r in results if not r.skipped]
    print(f"engine ready: {spec.engine_dir} (rebuilt: {', '.join(built) or 'nothing'})")
    return 0


def cmd_repo(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    check_output_dir(args.output, "--output")
    out = write_repository(spec, args.output.resolve(), hf_only=args.hf_only, force=args.force)
    print(f"model repository written and verified: {out}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    if args.triton_root is not None and not args.triton_root.is_dir():
        raise SpecError(f"--triton-root {args.triton_root}: not a directory")
    problems = verify_repository(args.repository, args.triton_root)
    for p in problems:
        print(escape(f"engine-build: error: {args.repository}: {p}"), file=sys.stderr)
    if problems:
        return EXIT_ERROR
    print(f"ok: {args.repository}")
    return 0


_SPEC_HELP = "the build spec (TOML; see docs/ENGINE_BUILD.md)"
_CC_HELP = (
    "GPU compute capability (e.g. 8.0, 9.0) instead of asking NVML; formats the GPU cannot run "
    "are refused"
)


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="engine-build",
        description="Plan, build and lay out TensorRT-LLM 1.2 engines for batch-1 latency.",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="fit table and the exact commands build would run")
    p.add_argument("--spec", type=Path, required=True, help=_SPEC_HELP)
    p.add_argument("--gpu-memory", help="GPU size (e.g. 80GiB) instead of asking NVML")
    p.add_argument("--compute-capability", help=_CC_HELP)
    p.add_argument(
        "--commands-out",
        type=Path,
        help="also write the commands as a shell script to this file (its folder must exist)",
    )
    p.set_defaults(func=cmd_plan)

    b = sub.add_parser("build", help="quantize and build the engine (skips up-to-date stages)")
    b.add_argument("--spec", type=Path, required=True, help=_SPEC_HELP)
    b.add_argument("--gpu-memory", help="GPU size instead of asking NVML")
    b.add_argument("--compute-capability", help=_CC_HELP)
    b.add_argument("--force", action="store_true", help="rebuild even if up to date")
    b.add_argument("--quiet", action="store_true", help="only progress lines; logs go to files")
    b.set_defaults(func=cmd_build)

    r = sub.add_parser("repo", help="write the Triton model repository")
    r.add_argument("--spec", type=Path, required=True, help=_SPEC_HELP)
    r.add_argument(
        "--output",
        type=Path,
        required=True,
        help="directory to write the repository to (its parent folder must exist; an existing "
        "one is replaced only with --force)",
    )
    r.add_argument(
        "--hf-only",
        action="store_true",
        help="point at the HF checkpoint only (engine server; no engine needed)",
    )
    r.add_argument("--force", action="store_true", help="replace an existing repository")
    r.set_defaults(func=cmd_repo)

    v = sub.add_parser("verify", help="check an existing model repository")
    v.add_argument(
        "repository",
        type=Path,
        help="the model repository directory (the --output of `engine-build repo`)",
    )
    v.add_argument(
        "--triton-root",
        type=Path,
        help="Triton root filesystem that serves it: the engine's TensorRT-LLM must match",
    )
    v.set_defaults(func=cmd_verify)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except DoesNotFit as err:
        print(escape(f"engine-build: error: {err}"), file=sys.stderr)
        return EXIT_NOFIT
    except SpecError as err:
        print(escape(f"engine-build: error: {err}"), file=sys.stderr)
        return EXIT_INPUT
    except BuildError as err:
        print(escape(f"engine-build: error: {err}"), file=sys.stderr)
        return EXIT_ERROR
    except OSError as err:
        # Writing an output (--commands-out, --output, work_dir) the system refused.
        print(escape(f"engine-build: error: {os_error_line(err)}"), file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("engine-build: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    return rc


if __name__ == "__main__":
    sys.exit(main())
