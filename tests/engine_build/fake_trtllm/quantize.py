"""Stand-in for TensorRT-LLM's examples/quantization/quantize.py (tests only).

Parses its argv with the recorded real argument list, prints a banner like the real tool,
refuses a --calib_dataset its calibration loader cannot load, writes a checkpoint
(config.json + rank{N}.safetensors) and fails on demand
(FAKE_TRTLLM_FAIL=quantize) after writing part of its output, like a crash mid-export.
Every call is appended to $FAKE_TRTLLM_CALLS.
"""

import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # The installation copies tests/engine_build/recorded_cli.py into fake_support/.
    from tests.engine_build.recorded_cli import parse
else:
    sys.path.insert(0, os.path.join(sys.prefix, "fake_support"))
    from recorded_cli import parse

args = parse("quantize.py", sys.argv[1:])
calls = os.environ.get("FAKE_TRTLLM_CALLS")
if calls:
    with open(calls, "a") as f:
        f.write(json.dumps({"tool": "quantize.py", "argv": sys.argv[1:]}) + "\n")
print("[TensorRT-LLM] TensorRT LLM version: fake", flush=True)
os.makedirs(args.output_dir, exist_ok=True)
with open(os.path.join(args.model_dir, "config.json")) as f:
    hf = json.load(f)
dataset = args.calib_dataset
# As the real calibration loader, after the model is loaded: names it knows, or a directory.
if dataset is not None and not (
    dataset == "pileval"
    or "cnn_dailymail" in dataset
    or "scienceqa" in dataset.lower()
    or "science_qa" in dataset.lower()
    or os.path.isdir(dataset)
):
    print(f"NotImplementedError: Unsupported dataset name or local repo directory: {dataset}.")
    sys.exit(1)
if os.environ.get("FAKE_TRTLLM_FAIL") == "quantize":
    with open(os.path.join(args.output_dir, "rank0.safetensors"), "wb") as f:
        f.write(b"half")
    for i in range(30):
        print(f"calibrating batch {i}", flush=True)
    print("RuntimeError: CUDA out of memory (fake)", file=sys.stderr, flush=True)
    sys.exit(1)
QUANT_ALGO = {
    "fp8": "FP8",
    "int8_sq": "W8A8_SQ_PER_CHANNEL",
    "int4_awq": "W4A16_AWQ",
    "w4a8_awq": "W4A8_AWQ",
    "int8_wo": "W8A16",
    "int4_wo": "W4A16",
}
KV_ALGO = {"fp8": "FP8", "int8": "INT8"}
config = {
    "architecture": hf["architectures"][0],
    "dtype": args.dtype,
    "quantization": {
        "quant_algo": QUANT_ALGO.get(args.qformat),
        "kv_cache_quant_algo": KV_ALGO.get(args.kv_cache_dtype or ""),
    },
    "mapping": {"world_size": args.tp_size, "tp_size": args.tp_size, "pp_size": 1},
}
with open(os.path.join(args.output_dir, "config.json"), "w") as f:
    json.dump(config, f)
for rank in range(args.tp_size):
    with open(os.path.join(args.output_dir, f"rank{rank}.safetensors"), "wb") as f:
        f.write(b"weights")
print("Quantized model exported to " + args.output_dir, flush=True)
