"""Loading one model of the repository onto the engine's device: fit check, weights, runner.

The order is the point: the fit check runs on config.json alone (or the random-weights shape),
before a byte of weights moves, so a model too large for the device is refused in milliseconds with
the numbers; then the weights load (or are drawn on the device), then the runner allocates its
working cache and, on a GPU, captures the decode step, the bucketed short prefills and (when
speculating) the verify steps.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from appliance.engine.awq import awq_options, awq_source, load_awq_model
from appliance.engine.decode import cuda_graph_capture, decode_spans
from appliance.engine.draft_model import DraftModelDrafter, check_draft_model, draft_off_switch
from appliance.engine.kernels import model_problem, triton_problem
from appliance.engine.llama import LlamaModel, load_config
from appliance.engine.options import EngineOptions, check_fit
from appliance.engine.prefill import prefill_graph_count
from appliance.engine.prefix_cache import free_device_bytes
from appliance.engine.random_weights import random_config, random_model
from appliance.engine.repository import ModelEntry, RepositoryError
from appliance.engine.runner import Runner, build_runner, prefill_chunk_tokens, working_seq_len
from appliance.engine.speculative import Drafter
from appliance.engine.verify import verify_graph_count

__all__ = ["load_model"]

log = logging.getLogger(__name__)


def load_model(entry: ModelEntry, options: EngineOptions) -> tuple[LlamaModel, Runner]:
    """The model and its running compute thread; CheckpointError, FitError or RepositoryError
    (each a one-line message) when it cannot be served."""
    started = time.monotonic()
    shape = options.random_weights
    config = random_config(shape) if shape else load_config(entry.hf_model_dir)
    kernel_path = options.kernel_path
    if options.kernels == "auto" and options.device_type == "cuda" and kernel_path == "torch":
        log.info("decode on torch kernels: %s", triton_problem(options.torch_device))
    why = model_problem(config.head_dim) if kernel_path == "triton" else None
    if why is not None and options.kernels == "triton":
        raise RepositoryError(f"--kernels triton: {why}; use --kernels torch")
    if why is not None:
        log.info("decode on torch kernels: %s", why)
        kernel_path = "torch"
    awq_dir = None if shape else awq_source(entry)
    if awq_dir is not None:
        options = awq_options(awq_dir, options)
    kv = entry.kv_cache
    max_seq_len = working_seq_len(config, kv)
    device = options.torch_device
    spans = decode_spans(max_seq_len)
    verify_counts = options.verify_counts
    graphs = (
        len(spans)
        + prefill_graph_count(options.prefill_buckets, spans)
        + verify_graph_count(verify_counts, spans)
        if options.use_cuda_graph
        else 0
    )
    plan = check_fit(config, options, kv, max_seq_len, prefill_chunk_tokens(device), graphs)
    draft_config = None
    if options.speculative == "draft" and options.draft_model:
        # Before any weights load: a draft of another tokenizer, or one that does not fit beside
        # the target, is refused in milliseconds.
        draft_config = check_draft_model(
            Path(options.draft_model), None if shape else entry.hf_model_dir, config
        )
        free = free_device_bytes(device) - (plan.required_bytes - plan.overhead_bytes)
        check_fit(draft_config, options, kv, max_seq_len, prefill_chunk_tokens(device), 0, free)
    if shape:
        model = random_model(
            config, device, options.torch_dtype, options.weight_quant, options.seed
        )
        # Random weights compute other tokens than the checkpoint: their reusable KV blocks must
        # never match blocks of the real weights.
        fingerprint = f"random-weights {shape} seed {options.seed} {entry.fingerprint}"
    elif awq_dir is not None:
        model = load_awq_model(awq_dir, config, device, options.torch_dtype)
        fingerprint = f"awq {awq_dir} {entry.fingerprint}"
    else:
        model = LlamaModel.load(
            entry.hf_model_dir, device, options.torch_dtype, options.weight_quant
        )
        fingerprint = entry.fingerprint
    model.kernels = kernel_path
    speculation: Drafter | None = options.speculation
    if draft_config is not None and options.draft_model:
        draft = LlamaModel.load(
            Path(options.draft_model), device, options.torch_dtype, options.weight_quant
        )
        speculation = DraftModelDrafter(
            draft,
            max_seq_len,
            options.draft_tokens,
            prefill_chunk_tokens(device),
            draft_off_switch(options.draft_tokens, draft, model),
        )
        log.info(
            "model %s: draft model %s (%d layers, %.2f GiB read per draft step)",
            entry.name,
            options.draft_model,
            draft_config.num_hidden_layers,
            draft.weight_bytes / 2**30,
        )
    loaded = time.monotonic()
    capture = cuda_graph_capture(device) if options.use_cuda_graph else None
    runner = build_runner(
        model, kv, fingerprint, capture, options.prefill_buckets, speculation, verify_counts
    )
    log.info(
        "model %s: %s %s, weights %s (%.2f GiB read per decode step), working cache %d tokens, "
        "decode %s on %s kernels; fit: %.2f of %.2f GiB free; loaded in %.1f s, runner ready in %.1f s",
        entry.name,
        device,
        options.dtype_name,
        options.weights_label,
        model.weight_bytes / 2**30,
        max_seq_len,
        f"{graphs} CUDA graphs (decode: {len(spans)} attention spans; prefill: buckets "
        f"{','.join(map(str, options.prefill_buckets)) or 'none'}"
        + (f"; verify: drafts {','.join(map(str, verify_counts))}" if verify_counts else "")
        + ")"
        if graphs
        else "eager",
        model.kernels,
        plan.required_bytes / 2**30,
        plan.gpu_memory_bytes / 2**30,
        loaded - started,
        time.monotonic() - loaded,
    )
    return model, runner
