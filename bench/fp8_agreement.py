"""FP8 weights against bf16 on real weights: top-1 agreement of the next-token logits.

The same checkpoint is loaded in bfloat16 three more times with its linear layers in FP8 E4M3,
and each model scores the same token sequences teacher-forced (every position's logits of one
document from one forward pass, `LlamaModel.sequence_logits`). Agreement at a position: the FP8
model's argmax is the bf16 model's argmax. Reported per FP8 form, with float32 against bf16 beside
it for scale (how often bf16's own rounding changes the top token):

- `fp8 channel W8A8`: per-channel weight scales, per-token activation scales (what `--weights fp8`
  runs for a prefill, and for the decode step with `--kernels torch`);
- `fp8 tensor W8A8`: one scale per weight and per activation (`--fp8-scaling tensor`);
- `fp8 channel W8A16`: the same E4M3 weights widened to float32 and multiplied with the bf16
  activations in float32, the arithmetic of the fused decode step's weight-only FP8 kernel.

The W8A8 forms use the engine's own E4M3 weights, scales and activation quantization
(`appliance.engine.linear`), but by default the product is computed as `torch._scaled_mm` defines
it rather than by calling it: the E4M3 operands widened to float32 (exact), multiplied and summed
in float32, times scale_a * scale_b, rounded once to bfloat16. On the CPU `torch._scaled_mm` with
one tensor-wide scale takes a path thousands of times slower than a float32 matmul (a 128-token
document took longer than 40 minutes); the two agree bit for bit except for a last-place bfloat16
rounding in a few outputs per ten thousand (the float32 summation order differs).
`--scaled-mm` calls `torch._scaled_mm` itself instead.

The sequences are the opening tokens of a few documents of this repository (natural English and
code, not model output, whose top tokens would be unusually confident). Runs on the CPU; progress
goes to stderr.

    python -m bench.fp8_agreement                       # SmolLM2-135M-Instruct, made if absent
    python -m bench.fp8_agreement --model-dir DIR       # another Llama checkpoint with tokenizer.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from appliance.engine.linear import Fp8Linear, Linear, Scaling, dequantize, quantize
from appliance.engine.llama import LlamaModel
from bench import record

# Documents whose opening tokens are scored, and how many tokens of each.
DOCUMENTS = (
    "README.md",
    "docs/OPERATIONS.md",
    "docs/MODEL_REPOSITORY.md",
    "appliance/engine/llama.py",
)
TOKENS_PER_DOCUMENT = 128


@dataclass
class WeightOnlyFp8:
    """An Fp8Linear's weight widened to float32 and multiplied in float32 (W8A16)."""

    layer: Fp8Linear
    weight: torch.Tensor = field(init=False)  # float32 (out, in), widened once

    def __post_init__(self) -> None:
        self.weight = dequantize(self.layer.weight, self.layer.scale)

    @property
    def nbytes(self) -> int:
        return self.layer.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.weight.t()).to(self.layer.out_dtype)


@dataclass
class EmulatedW8A8:
    """An Fp8Linear's W8A8 product as `torch._scaled_mm` defines it, in float32 arithmetic.

    The activations are quantized exactly as `Fp8Linear` does; the E4M3 values of both operands
    are exact in float32, so the products are the kernel's; the sum is float32 (in another order),
    then scaled by scale_a * scale_b and rounded once to the layer's output dtype."""

    layer: Fp8Linear
    weight: torch.Tensor = field(init=False)  # the E4M3 values in float32 (out, in), unscaled

    def __post_init__(self) -> None:
        self.weight = self.layer.weight.float()

    @property
    def nbytes(self) -> int:
        return self.layer.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize(x, self.layer.scaling)
        w_scale = self.layer.scale
        scale_b = w_scale.view(1, -1) if self.layer.scaling == "channel" else w_scale
        return ((xq.float() @ self.weight.t()) * x_scale * scale_b).to(self.layer.out_dtype)


def _wrap_fp8(model: LlamaModel, wrap: Callable[[Fp8Linear], Linear]) -> LlamaModel:
    def one(layer: Linear) -> Linear:
        return wrap(layer) if isinstance(layer, Fp8Linear) else layer

    for block in model.layers:
        block.wqkv, block.wo = one(block.wqkv), one(block.wo)
        block.w13, block.w2 = one(block.w13), one(block.w2)
    return model


def weight_only(model: LlamaModel) -> LlamaModel:
    """`model` (FP8 per channel) with every FP8 layer computed W8A16; in place."""
    return _wrap_fp8(model, WeightOnlyFp8)


def emulated(model: LlamaModel) -> LlamaModel:
    """`model` (FP8) with every FP8 layer's W8A8 product computed in float32; in place."""
    return _wrap_fp8(model, EmulatedW8A8)


def top1_agreement(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Share of positions (rows) whose argmax is the same in both logits tensors."""
    return float((reference.argmax(-1) == other.argmax(-1)).float().mean())


Loader = Callable[[torch.dtype, Scaling | None], LlamaModel]


def _quiet(_: str) -> None:
    pass


def agreement(
    load: Loader,
    sequences: Sequence[Sequence[int]],
    scaled_mm: bool = False,
    progress: Callable[[str], None] = _quiet,
) -> dict[str, Any]:
    """Top-1 agreement with bf16 of float32 and the three FP8 forms over `sequences`.

    `load(dtype, fp8)` returns a LlamaModel of the same weights; the W8A8 forms call
    `torch._scaled_mm` when `scaled_mm`, else compute its product in float32 (`EmulatedW8A8`)."""
    started = time.perf_counter()
    w8a8 = (lambda m: m) if scaled_mm else emulated

    def score(name: str, model: LlamaModel) -> torch.Tensor:
        rows = []
        for i, seq in enumerate(sequences):
            t0 = time.perf_counter()
            rows.append(model.sequence_logits(seq))
            progress(
                f"{name}: document {i + 1}/{len(sequences)}, {len(seq)} tokens, "
                f"{time.perf_counter() - t0:.1f} s"
            )
        return torch.cat(rows)

    bf16 = score("bf16", load(torch.bfloat16, None))
    forms: dict[str, Callable[[], LlamaModel]] = {
        "float32": lambda: load(torch.float32, None),
        "fp8 channel W8A8": lambda: w8a8(load(torch.bfloat16, "channel")),
        "fp8 tensor W8A8": lambda: w8a8(load(torch.bfloat16, "tensor")),
        "fp8 channel W8A16": lambda: weight_only(load(torch.bfloat16, "channel")),
    }
    result: dict[str, Any] = {"positions": int(bf16.shape[0]), "top1_agreement_with_bf16": {}}
    for name, make in forms.items():
        logits = score(name, make())
        result["top1_agreement_with_bf16"][name] = top1_agreement(bf16, logits)
    result["w8a8_product"] = "torch._scaled_mm" if scaled_mm else "float32 emulation"
    result["seconds"] = time.perf_counter() - started
    return result


def document_sequences(model_dir: Path, root: Path) -> list[list[int]]:
    """The opening TOKENS_PER_DOCUMENT tokens of each of DOCUMENTS under `root`."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    sequences = []
    for name in DOCUMENTS:
        ids = tokenizer.encode((root / name).read_text(encoding="utf-8")).ids
        sequences.append(ids[:TOKENS_PER_DOCUMENT])
    return sequences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", help="a Llama checkpoint with tokenizer.json")
    parser.add_argument("--root", default="var/smollm2", help="where `make-model` puts SmolLM2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="also write the result as JSON here")
    parser.add_argument(
        "--scaled-mm",
        action="store_true",
        help="W8A8 through torch._scaled_mm itself (hours on a CPU with tensor scaling)",
    )
    record.add_flag(parser)
    args = parser.parse_args(argv)
    with record.recording(
        "fp8_agreement", record.record_dir(args), None if argv is None else list(argv)
    ) as run_record:
        torch.set_num_threads(args.threads)

        def progress(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        # Subnormal floats take a slow path on x86 CPUs, and FP8 products of real activations make
        # many: flushed to zero (for every model alike) the run takes minutes, not hours.
        torch.set_flush_denormal(True)
        if args.model_dir:
            model_dir = Path(args.model_dir)
        else:
            from appliance.tools.instruct_model import ensure_instruct_model

            model_dir, _ = ensure_instruct_model(Path(args.root), log=progress)
        repo_root = Path(__file__).resolve().parent.parent
        sequences = document_sequences(model_dir, repo_root)

        def load(dtype: torch.dtype, fp8: Scaling | None) -> LlamaModel:
            return LlamaModel.load(model_dir, "cpu", dtype, fp8)

        result = {
            "model_dir": str(model_dir),
            "documents": list(DOCUMENTS),
            "torch": torch.__version__,
            **agreement(load, sequences, args.scaled_mm, progress),
        }
        print("| form vs bf16 | top-1 agreement | positions |\n|---|---|---|")
        for name, value in result["top1_agreement_with_bf16"].items():
            print(f"| {name} | {value:.4f} | {result['positions']} |")
        print(f"W8A8 product: {result['w8a8_product']}; {result['seconds']:.0f} s")
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        run_record.results["agreement"] = result
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
