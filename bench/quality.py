"""Quality of the engine server's weight formats on a real checkpoint: perplexity and agreement.

    python -m bench.quality --repository var/smollm2/repo --text appliance/data/corpus.txt

Loads the repository's model once per format (float32 first: the reference), scores the text's
perplexity and teacher-forced top-1 agreement with the reference, and greedy agreement over
prompts cut from the same text (see appliance.engine.quality). CPU only; no server is started.

`awq:DIR` and `awq-bf16:DIR` score the AWQ checkpoint in DIR (`appliance awq-quantize`) in the
engine's INT4 layers, as `--weights int4` serves it; its group is the checkpoint's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from appliance.engine.awq import load_awq_model, read_awq_format
from appliance.engine.llama import CheckpointError, LlamaModel, load_config
from appliance.engine.quality import FormatQuality, measure
from appliance.engine.quantized import GROUP_SIZES, GroupQuant
from appliance.engine.repository import RepositoryError, read_repository
from appliance.textfile import TextFileError, read_text
from bench import record

MAX_TEXT_BYTES = 4 << 20
# name -> (compute dtype, weight-only bits or None)
FORMATS: dict[str, tuple[torch.dtype, int | None]] = {
    "float32": (torch.float32, None),
    "bfloat16": (torch.bfloat16, None),
    "int8": (torch.float32, 8),
    "int4": (torch.float32, 4),
    "int8-bf16": (torch.bfloat16, 8),
    "int4-bf16": (torch.bfloat16, 4),
}
# name -> compute dtype of an AWQ checkpoint's model (the name takes :DIR, the checkpoint).
AWQ_FORMATS: dict[str, torch.dtype] = {"awq": torch.float32, "awq-bf16": torch.bfloat16}


@dataclass(frozen=True)
class Format:
    """One row: a format name, its group, and the AWQ checkpoint for an AWQ format."""

    name: str
    group: int
    awq_dir: Path | None = None


class UsageError(Exception):
    """A bad argument or input: one line, exit 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n")[0])
    p.add_argument("--repository", type=Path, required=True, help="engine model repository")
    p.add_argument("--model", help="model name in the repository (default: the only one)")
    p.add_argument("--text", type=Path, required=True, help="UTF-8 text to score")
    p.add_argument(
        "--formats",
        default="float32,bfloat16,int8,int4",
        help=f"comma list, the first is the reference (known: {', '.join(FORMATS)}); "
        "NAME:G gives an int format its own group size; awq:DIR and awq-bf16:DIR score the "
        "AWQ checkpoint in DIR",
    )
    p.add_argument("--weight-group", type=int, default=128, help="inputs per scale of int8/int4")
    p.add_argument("--tokens", type=int, default=4096, help="score at most this many tokens")
    p.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    p.add_argument("--prompts", type=int, default=8, help="greedy prompts cut from the text")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", type=Path, help="also write the results as JSON")
    return p


def _format(item: str, default_group: int) -> Format:
    name, _, rest = item.partition(":")
    if name in AWQ_FORMATS:
        if not rest:
            raise UsageError(f"--formats {item}: {name} takes the checkpoint, {name}:DIR")
        awq_dir = Path(rest)
        try:
            fmt = read_awq_format(awq_dir)
        except CheckpointError as err:
            raise UsageError(f"--formats {item}: {err}") from err
        if fmt is None:
            raise UsageError(f"--formats {item}: {awq_dir} is not an AWQ checkpoint")
        return Format(name, fmt.group_size, awq_dir)
    if name not in FORMATS:
        known = ", ".join([*FORMATS, *(f"{n}:DIR" for n in AWQ_FORMATS)])
        raise UsageError(f"--formats: unknown {[name]}; known: {known}")
    if not rest:
        return Format(name, default_group)
    if FORMATS[name][1] is None or not rest.isdigit() or int(rest) not in GROUP_SIZES:
        raise UsageError(
            f"--formats {item}: a group ({', '.join(map(str, GROUP_SIZES))}) goes with int formats"
        )
    return Format(name, int(rest))


def _check(args: argparse.Namespace) -> list[Format]:
    items = [n.strip() for n in args.formats.split(",") if n.strip()]
    if not items:
        raise UsageError("--formats: empty list")
    if args.weight_group not in GROUP_SIZES:
        raise UsageError(
            f"--weight-group {args.weight_group}: expected one of {', '.join(map(str, GROUP_SIZES))}"
        )
    bounds = {
        "--tokens": (args.tokens, 2, 1 << 16),
        "--window": (args.window, 2, 8192),
        "--prompts": (args.prompts, 0, 256),
        "--prompt-tokens": (args.prompt_tokens, 1, 4096),
        "--steps": (args.steps, 1, 1024),
    }
    for flag, (value, low, high) in bounds.items():
        if not low <= value <= high:
            raise UsageError(f"{flag} {value}: expected {low}..{high}")
    return [_format(item, args.weight_group) for item in items]


def _model_dir(repository: Path, name: str | None) -> Path:
    try:
        entries = read_repository(repository)
    except RepositoryError as err:
        raise UsageError(str(err)) from err
    if name is None:
        if len(entries) != 1:
            raise UsageError(f"--model: the repository has {', '.join(entries)}; name one")
        return next(iter(entries.values())).hf_model_dir
    if name not in entries:
        raise UsageError(f"--model {name}: not in the repository ({', '.join(entries)})")
    return entries[name].hf_model_dir


def _read_text(path: Path) -> str:
    try:
        return read_text(path, MAX_TEXT_BYTES)
    except TextFileError as err:
        raise UsageError(f"--text {path}: {err}") from None


def _load(fmt: Format, model_dir: Path) -> tuple[str, LlamaModel]:
    """The row's name and model."""
    if fmt.awq_dir is not None:
        dtype = AWQ_FORMATS[fmt.name]
        model = load_awq_model(fmt.awq_dir, load_config(model_dir), torch.device("cpu"), dtype)
        return f"{fmt.name} g{fmt.group} ({fmt.awq_dir.name})", model
    dtype, bits = FORMATS[fmt.name]
    quant = GroupQuant(bits, fmt.group) if bits else None  # type: ignore[arg-type]
    name = f"{fmt.name} g{fmt.group}" if bits else fmt.name
    return name, LlamaModel.load(model_dir, "cpu", dtype, quant)


def _table(rows: list[FormatQuality], reference_ppl: float) -> str:
    lines = [
        "| format | weights MiB | perplexity | vs reference | top-1 agreement | greedy agreement | ms/token |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def pct(v: float | None) -> str:
        return "—" if v is None else f"{100 * v:.1f} %"

    for r in rows:
        delta = 100 * (r.perplexity / reference_ppl - 1)
        lines.append(
            f"| {r.name} | {r.weight_bytes / 2**20:.1f} | {r.perplexity:.3f} | {delta:+.2f} % | "
            f"{pct(r.top1_agreement)} | {pct(r.greedy_agreement)} | {r.decode_ms:.1f} |"
        )
    return "\n".join(lines)


def run(argv: list[str] | None = None) -> int:
    parser = _parser()
    record.add_flag(parser)
    args = parser.parse_args(argv)
    with record.recording(
        "quality", record.record_dir(args), None if argv is None else list(argv)
    ) as run_record:
        names = _check(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        model_dir = _model_dir(args.repository, args.model)
        text = _read_text(args.text)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        ids = tokenizer.encode(text, add_special_tokens=False).ids[: args.tokens]
        if len(ids) < 2:
            raise UsageError(f"--text {args.text}: fewer than 2 tokens")
        span = max(1, len(ids) - args.prompt_tokens)
        prompts = [
            ids[i * span // max(1, args.prompts) :][: args.prompt_tokens]
            for i in range(args.prompts)
        ]
        print(
            f"model {model_dir}, text {args.text}: {len(ids)} tokens, windows of {args.window}; "
            f"{args.prompts} prompts x {args.steps} greedy tokens; group {args.weight_group}; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads",
            flush=True,
        )
        rows: list[FormatQuality] = []
        reference = None
        for fmt in names:
            started = time.perf_counter()
            try:
                name, model = _load(fmt, model_dir)
            except CheckpointError as err:
                raise UsageError(f"{fmt.name}: {err}") from err
            loaded = time.perf_counter() - started
            quality, own = measure(name, model, ids, prompts, args.steps, args.window, reference)
            if reference is None:
                reference = own
            rows.append(quality)
            print(
                f"{name}: perplexity {quality.perplexity:.4f}, load {loaded:.1f} s, "
                f"scored in {time.perf_counter() - started - loaded:.1f} s",
                flush=True,
            )
            del model
        print()
        print(f"reference: {rows[0].name}")
        print(_table(rows, rows[0].perplexity))
        run_record.results["formats"] = [r.__dict__ for r in rows]
        if args.json is not None:
            args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=2) + "\n")
        return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except UsageError as err:
        print(f"bench.quality: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
