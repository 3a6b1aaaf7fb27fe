"""Speculative decoding on the real SmolLM2-135M-Instruct, CPU: accepted drafts per verify step and
inter-token latency against no speculation, on three workloads.

    PYTHONPATH=. python -m bench.speculative --model /work/main/var/smollm2/model

Workloads (chat-templated): input-grounded (rewrite a given text), free chat, code. Modes: off,
ngram (prompt lookup, with the off switch), ngram-always (switch disabled), draft (the target's
first --draft-layers layers as a "layer-skip" draft model: no smaller SmolLM2 of this tokenizer
is on the machine), draft-always. Greedy; every mode's output must equal the off output (asserted).
Each workload runs the modes in turn, --reps times, the order reversed every other repetition;
the figure per mode is the median of its mean inter-token latency (first to last token / (n - 1)),
and the ratio is to off's median in the same run; "per rep" lists each repetition's ratio to the
off run of the same repetition (the spread). Each drafter is one instance for the whole run, so
what it remembers of acceptance carries over from request to request and from workload to
workload, as in the server.

Wall time on a shared machine varies by more than the few per cent a resting drafter costs, so
the table also gives the "step-cost ratio": every forward pass of the target counted by its rows
(a decode step is 1 row, a verify step of k drafts k + 1), each row count priced at its median
wall time measured in the same run (interleaved, at the workload's middle position), summed and
divided by the same for off; a draft model's own passes (its catch-up over the text and its
draft steps) are counted and priced the same way, on the draft model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from appliance.engine.decode import EagerDecode
from appliance.engine.draft_model import DraftModelDrafter, check_draft_model, draft_off_switch
from appliance.engine.llama import LlamaModel
from appliance.engine.sampling import SamplingParams, generate
from appliance.engine.speculative import Drafter, NgramSpeculation, OffSwitch, SpecCounts
from appliance.text.tokenizer import ModelText
from bench import record

GREEDY = SamplingParams(top_k=1)
NEVER_OFF = OffSwitch(min_accepted=0.0)

ARTICLE = (
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
    "Supporters said the lanes would make cycling safer and reduce traffic. Shop owners worried "
    "that removing forty parking spaces would hurt their business. The council voted five to two "
    "to build the lanes, and asked the transport office to report on parking in six months. "
    "Construction will start in March and should take about eight weeks."
)
WORKLOADS = {
    "input-grounded": (
        "Rewrite the following text, keeping every fact and sentence but correcting nothing and "
        "changing as little as possible; just repeat it in plain words:\n\n" + ARTICLE
    ),
    "free chat": "What are some good habits for staying healthy while working from home?",
    "code": "Write a Python function that checks whether a string is a palindrome, with a docstring.",
}


@dataclass
class Result:
    tokens: list[int]
    itl_s: float
    counts: SpecCounts
    passes: Counter[int] = field(default_factory=Counter)  # target forward passes by rows
    draft_passes: Counter[int] = field(default_factory=Counter)  # the draft model's, by rows


class CountingDraftModel(DraftModelDrafter):
    """The draft-model drafter, counting its own forward passes by rows."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.passes: Counter[int] = Counter()

    def _run(self, tokens: list[int], start: int) -> torch.Tensor:
        self.passes[len(tokens)] += 1
        return super()._run(tokens, start)


class CountingDecode:
    """The eager decode step, counting the target's decode and verify passes by their rows."""

    def __init__(self, model: LlamaModel, n: int) -> None:
        self.cache = model.new_cache(n)
        self._step = EagerDecode(model, self.cache)
        self.passes: Counter[int] = Counter()

    def prefill(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        return self._step.prefill(token_ids, start)

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        self.passes[1] += 1
        return self._step(token, pos)

    def launch(self, pos: int, token: int | None = None) -> Callable[[], int]:
        self.passes[1] += 1
        return self._step.launch(pos, token)

    def rows(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        self.passes[len(token_ids)] += 1
        return self._step.rows(token_ids, start)


def row_costs(
    model: LlamaModel, prompt: list[int], pos: int, rows: set[int], every_row: bool = True
) -> dict[int, float]:
    """Median wall time of one pass of each row count at `pos`, the counts interleaved: logits
    of every row (a verify step) or, with `every_row` False, of the last (a draft's catch-up)."""
    if not rows:
        return {}
    step = CountingDecode(model, pos + max(rows) + 1)
    step.prefill(prompt[:1] * pos, 0)
    times: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(15):
        for r in sorted(rows):
            began = time.perf_counter()
            if r == 1:
                step(prompt[0], pos)
            elif every_row:
                step.rows(prompt[:1] * r, pos)
            else:
                step.prefill(prompt[:1] * r, pos)
            times[r].append(time.perf_counter() - began)
    return {r: statistics.median(t) for r, t in times.items()}


def layer_skip_dir(model_dir: Path, layers: int, dest: Path) -> Path:
    """A checkpoint directory of the target's first `layers` layers (its norm and head after)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    config["num_hidden_layers"] = layers
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config), encoding="utf-8")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).exists():
            (dest / name).symlink_to((model_dir / name).resolve())
    return dest


def run(
    model: LlamaModel, prompt: list[int], n: int, end_id: int | None, spec: Drafter | None
) -> Result:
    counts = SpecCounts()
    stamps: list[float] = []
    tokens: list[int] = []
    step = CountingDecode(model, len(prompt) + n)
    drafter = spec if isinstance(spec, CountingDraftModel) else None
    if drafter is not None:
        drafter.passes = Counter()
    for token in generate(
        model,
        prompt,
        n,
        end_id,
        GREEDY,
        cache=step.cache,
        decode=step,
        speculation=spec,
        spec_counts=counts,
    ):
        stamps.append(time.perf_counter())
        tokens.append(token)
    itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return Result(tokens, itl, counts, step.passes, drafter.passes if drafter else Counter())


def step_cost(passes: Counter[int], costs: dict[int, float]) -> float:
    return sum(count * costs[rows] for rows, count in passes.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="var/smollm2/model")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of: {', '.join(WORKLOADS)}",
    )
    record.add_flag(parser)
    args = parser.parse_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        parser.error(f"--workloads: unknown {unknown}; known: {', '.join(WORKLOADS)}")
    with record.recording(
        "speculative", record.record_dir(args), None if argv is None else list(argv)
    ):
        measure(args, workloads)


def measure(args: argparse.Namespace, workloads: list[str]) -> None:
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    text = ModelText.load(model_dir)
    model = LlamaModel.load(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        draft_dir = layer_skip_dir(model_dir, args.draft_layers, Path(tmp) / "draft")
        check_draft_model(draft_dir, model_dir, model.config)
        draft = LlamaModel.load(draft_dir)
    seq = 2048
    k = args.draft_tokens
    switch = draft_off_switch(k, draft, model)
    modes: dict[str, Drafter | None] = {
        "off": None,
        "ngram": NgramSpeculation(k, 3),
        "ngram-always": NgramSpeculation(k, 3, NEVER_OFF),
        "draft": CountingDraftModel(draft, seq, k, 256, switch),
        "draft-always": CountingDraftModel(draft, seq, k, 256, NEVER_OFF),
    }
    print(
        f"SmolLM2-135M float32, {args.threads} thread(s), greedy, {args.tokens} new tokens, "
        f"k={k}; draft = first {args.draft_layers} of {model.config.num_hidden_layers} layers "
        f"({draft.weight_bytes / model.weight_bytes:.2f} of the weight bytes; off below "
        f"{switch.min_accepted:.2f} accepted per verify step)"
    )
    print(
        "| workload | mode | accepted/verify | acceptance | verify steps | switched off "
        "| ITL ms | ratio to off | per rep | step-cost ratio, per rep |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    order = list(modes)
    for workload in workloads:
        message = WORKLOADS[workload]
        prompt = text.encode_chat([{"role": "user", "content": message}])
        itls: dict[str, list[float]] = {m: [] for m in modes}
        results: dict[str, list[Result]] = {m: [] for m in modes}
        run(model, prompt, 8, text.end_id, None)  # warm-up: the first pass of a shape is slower
        for rep in range(args.reps):
            for mode in order if rep % 2 == 0 else order[::-1]:
                result = run(model, prompt, args.tokens, text.end_id, modes[mode])
                itls[mode].append(result.itl_s)
                results[mode].append(result)
            for mode in modes:
                assert results[mode][rep].tokens == results["off"][rep].tokens, (workload, mode)
        rows = {r for rs in results.values() for result in rs for r in result.passes}
        middle = len(prompt) + args.tokens // 2
        costs = row_costs(model, prompt, middle, rows)
        draft_rows = {r for rs in results.values() for result in rs for r in result.draft_passes}
        draft_costs = row_costs(draft, prompt, middle, draft_rows, every_row=False)
        base = statistics.median(itls["off"])
        for mode in modes:
            c = results[mode][-1].counts
            itl = statistics.median(itls[mode])
            per_step = f"{c.accepted / c.verify_steps:.2f}" if c.verify_steps else "-"
            rate = f"{c.accepted / c.proposed:.0%}" if c.proposed else "-"
            reps = " / ".join(f"{a / b:.2f}" for a, b in zip(itls[mode], itls["off"], strict=True))
            ratios = [
                (step_cost(r.passes, costs) + step_cost(r.draft_passes, draft_costs))
                / step_cost(o.passes, costs)
                for r, o in zip(results[mode], results["off"], strict=True)
            ]
            modelled = " / ".join(f"{x:.3f}" for x in ratios)
            print(
                f"| {workload} | {mode} | {per_step} | {rate} | {c.verify_steps} | "
                f"{c.switched_off} | {itl * 1e3:.1f} | {itl / base:.2f} | {reps} | {modelled} |"
            )
        priced = ", ".join(f"{r} rows {costs[r] / costs[1]:.2f}" for r in sorted(costs))
        print(
            f"<!-- {workload}: {len(results['off'][-1].tokens)} tokens, prompt {len(prompt)}; "
            f"pass cost in decode steps: {priced} -->"
        )


if __name__ == "__main__":
    main()
