"""Stand-in for TensorRT-LLM's trtllm-build console script (tests only).

Parses its argv with the recorded real argument list, refuses --opt_num_tokens with
--multiple_profiles enable as the real build.py does, and writes an engine directory shaped like
the real one: config.json with ``pretrained_config`` (the checkpoint's, with ``mapping``) and
``build_config`` (limits and ``plugin_config``), plus rank{N}.engine. FAKE_TRTLLM_FAIL=trtllm-build
makes it fail after partial output; FAKE_TRTLLM_FAIL=no-engine makes it exit 0 without engines.
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

args = parse("trtllm-build", sys.argv[1:])
calls = os.environ.get("FAKE_TRTLLM_CALLS")
if calls:
    with open(calls, "a") as f:
        f.write(json.dumps({"tool": "trtllm-build", "argv": sys.argv[1:]}) + "\n")
if args.multiple_profiles == "enable" and args.opt_num_tokens is not None:
    print("RuntimeError: multiple_profiles is enabled, while opt_num_tokens is set.")
    sys.exit(1)
fail = os.environ.get("FAKE_TRTLLM_FAIL")
os.makedirs(args.output_dir, exist_ok=True)
with open(os.path.join(args.checkpoint_dir, "config.json")) as f:
    pretrained = json.load(f)
if fail == "trtllm-build":
    with open(os.path.join(args.output_dir, "rank0.engine"), "wb") as f:
        f.write(b"partial")
    for i in range(25):
        print(f"[TRT] building layer {i}", flush=True)
    print("AssertionError: Engine building failed, please check error log.", flush=True)
    sys.exit(1)
plugin = {
    "gemm_plugin": None if args.gemm_plugin == "disable" else args.gemm_plugin,
    "low_latency_gemm_plugin": None
    if args.low_latency_gemm_plugin == "disable"
    else args.low_latency_gemm_plugin,
    "use_paged_context_fmha": args.use_paged_context_fmha == "enable",
    "use_fp8_context_fmha": args.use_fp8_context_fmha == "enable",
    "tokens_per_block": args.tokens_per_block,
    "multiple_profiles": args.multiple_profiles == "enable",
}
# As the real builder: speculation adds the draft length (and EAGLE's layers) to max_seq_len,
# and raises max_num_tokens to max_batch_size * (max_draft_len + 1).
seq_len, num_tokens = args.max_seq_len, args.max_num_tokens
if args.speculative_decoding_mode is not None:
    seq_len += args.max_draft_len
    if args.speculative_decoding_mode == "eagle":
        seq_len += pretrained["num_eagle_layers"]
    num_tokens = max(num_tokens, args.max_batch_size * (args.max_draft_len + 1))
config = {
    "version": "1.2.1",  # the version trtllm-build records: its own
    "pretrained_config": pretrained,
    "build_config": {
        "max_batch_size": args.max_batch_size,
        "max_input_len": args.max_input_len,
        "max_seq_len": seq_len,
        "max_num_tokens": num_tokens,
        "max_draft_len": args.max_draft_len or 0,
        "speculative_decoding_mode": args.speculative_decoding_mode,
        "max_beam_width": args.max_beam_width,
        "plugin_config": plugin,
    },
}
with open(os.path.join(args.output_dir, "config.json"), "w") as f:
    json.dump(config, f)
if fail != "no-engine":
    for rank in range(pretrained["mapping"]["world_size"]):
        with open(os.path.join(args.output_dir, f"rank{rank}.engine"), "wb") as f:
            f.write(b"engine")
print("Total time of building all engines: 00:00:00", flush=True)
