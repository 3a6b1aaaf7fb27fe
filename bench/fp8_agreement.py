"""FP8 weights against bf16 on real weights: top-1 agreement of the next-token logits.

The same checkpoint is loaded in bfloat16 three more times with its linear layers in FP8 E4M3,
and each model scores the same token sequences teacher-forced (every position's logits from one
forward pass, `LlamaModel.sequence_logits`). Agreement at a position: the FP8 model's argmax is the
bf16 model's argmax. Reported per FP8 form, with float32 against bf16 beside it for scale (how
often bf16's own rounding changes the top token):

- `fp8 channel W8A8`: per-channel weight scales, per-token activation scales, `torch._scaled_mm`
  (what `--weights fp8` runs for a prefill, and for the decode step with `--kernels torch`);
- `fp8 tensor W8A8`: one scale per weight and per activation (`--fp8-scaling tensor`);
- `fp8 channel W8A16`: the same E4M3 weights widened to float32 and multiplied with the bf16
  activations in float32, the arithmetic of the fused decode step's weight-only FP8 kernel.

The sequences are the opening tokens of a few documents of this repository (natural English and
code, not model output, whose top tokens would be unusually confident). Runs on the CPU.

    python -m bench.fp8_agreement                       # SmolLM2-135M-Instruct, made if absent
    python -m bench.fp8_agreement --model-dir DIR       # another Llama checkpoint with tokenizer.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from appliance.engine.linear import Fp8Linear, Linear, Scaling, dequantize
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

    @property
    def nbytes(self) -> int:
        return self.layer.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize(self.layer.weight, self.layer.scale)
        return (x.float() @ weight.t()).to(self.layer.out_dtype)


def weight_only(model: LlamaModel) -> LlamaModel:
    """`model` (FP8 per channel) with every FP8 layer computed W8A16; in place."""

    def wrap(layer: Linear) -> Linear:
        return WeightOnlyFp8(layer) if isinstance(layer, Fp8Linear) else layer

    for block in model.layers:
        block.wqkv, block.wo = wrap(block.wqkv), wrap(block.wo)
        block.w13, block.w2 = wrap(block.w13), wrap(block.w2)
    return model


def top1_agreement(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Share of positions (rows) whose argmax is the same in both logits tensors."""
    return float((reference.argmax(-1) == other.argmax(-1)).float().mean())


Loader = Callable[[torch.dtype, Scaling | None], LlamaModel]


def agreement(load: Loader, sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Top-1 agreement with bf16 of float32 and the three FP8 forms over `sequences`.

    `load(dtype, fp8)` returns a LlamaModel of the same weights."""
    started = time.perf_counter()

    def score(model: LlamaModel) -> torch.Tensor:
        return torch.cat([model.sequence_logits(seq) for seq in sequences])

    bf16 = score(load(torch.bfloat16, None))
    forms: dict[str, Callable[[], LlamaModel]] = {
        "float32": lambda: load(torch.float32, None),
        "fp8 channel W8A8": lambda: load(torch.bfloat16, "channel"),
        "fp8 tensor W8A8": lambda: load(torch.bfloat16, "tensor"),
        "fp8 channel W8A16": lambda: weight_only(load(torch.bfloat16, "channel")),
    }
    result: dict[str, Any] = {"positions": int(bf16.shape[0]), "top1_agreement_with_bf16": {}}
    for name, make in forms.items():
        logits = score(make())
        result["top1_agreement_with_bf16"][name] = top1_agreement(bf16, logits)
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
    record.add_flag(parser)
    args = parser.parse_args(argv)
    with record.recording(
        "fp8_agreement", record.record_dir(args), None if argv is None else list(argv)
    ) as run_record:
        torch.set_num_threads(args.threads)
        # Subnormal floats take a slow path on x86 CPUs, and FP8 products of real activations make
        # many: flushed to zero (for every model alike) the run takes minutes, not hours.
        torch.set_flush_denormal(True)
        if args.model_dir:
            model_dir = Path(args.model_dir)
        else:
            from appliance.tools.instruct_model import ensure_instruct_model

            model_dir, _ = ensure_instruct_model(Path(args.root), log=print)
        repo_root = Path(__file__).resolve().parent.parent
        sequences = document_sequences(model_dir, repo_root)

        def load(dtype: torch.dtype, fp8: Scaling | None) -> LlamaModel:
            return LlamaModel.load(model_dir, "cpu", dtype, fp8)

        result = {
            "model_dir": str(model_dir),
            "documents": list(DOCUMENTS),
            "torch": torch.__version__,
            **agreement(load, sequences),
        }
        for name, value in result["top1_agreement_with_bf16"].items():
            print(
                f"{name:>20} vs bf16: top-1 agreement {value:.4f} over {result['positions']} positions"
            )
        run_record.results["agreement"] = result
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
