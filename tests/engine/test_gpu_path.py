"""The GPU path's device-independent parts, run on the CPU: FP8 math, the graph-capture contract,
random weights of a real shape, the fit check, options, chunked prefill and stopping the runner."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from appliance import cli as appliance_cli
from appliance.engine.decode import GraphDecode, decode_spans
from appliance.engine.linear import (
    E4M3_MAX,
    FP8_DTYPE,
    Fp8Linear,
    PlainLinear,
    dequantize,
    quantize,
    quantize_linear,
)
from appliance.engine.llama import LlamaModel
from appliance.engine.options import EngineOptions, FitError, check_fit
from appliance.engine.random_weights import RandomTensors, random_config, random_model
from appliance.engine.repository import KvCacheParams, RepositoryError
from appliance.engine.runner import Emission, Job, Runner
from appliance.engine.sampling import SamplingParams, generate
from appliance.engine.server import load_repository
from engine_build.planner import count_params
from engine_build.repo import write_hf_repository
from tests.conftest import Tiny

TOKENS = [1, 5, 17, 42, 3, 88, 60, 7, 7, 19, 33, 96]
GREEDY_PARAMS = SamplingParams(top_k=1)
KV = KvCacheParams(
    max_seq_len=None,
    tokens_per_block=32,
    enable_reuse=False,
    max_tokens=None,
    free_mem_fraction=0.9,
)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


# --- FP8 ------------------------------------------------------------------------------------------


def test_quantize_per_channel_maps_each_row_max_to_e4m3_max() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=gen) * torch.logspace(-3, 2, 32).unsqueeze(1)
    w[5] = 0.0  # an all-zero row must not divide 0 by 0
    q, scale = quantize(w, "channel")
    assert q.dtype == FP8_DTYPE and scale.shape == (32, 1) and scale.dtype == torch.float32
    assert torch.isfinite(q.float()).all()
    row_max = q.float().abs().amax(dim=1)
    nonzero = torch.arange(32) != 5
    torch.testing.assert_close(row_max[nonzero], torch.full((31,), E4M3_MAX))
    torch.testing.assert_close(scale[nonzero, 0], w.abs().amax(dim=1)[nonzero] / E4M3_MAX)
    # E4M3 keeps 3 mantissa bits: each normal value is within half a unit in the last place (2^-4).
    back = dequantize(q, scale)
    normal = q.float().abs() >= 2.0**-6
    rel = (back - w).abs() / w.abs().clamp(min=1e-30)
    assert rel[normal].max() <= 2.0**-4 + 1e-6
    assert back[5].abs().max() == 0


def test_quantize_per_tensor_has_one_scale_and_stays_in_range() -> None:
    w = torch.tensor([[1.0, -2.0, 4.0, 1000.0], [-3000.0, 0.5, 0.0, 7.0]])
    q, scale = quantize(w, "tensor")
    assert scale.shape == () and float(scale) == pytest.approx(3000.0 / E4M3_MAX)
    assert float(q.float().abs().max()) == E4M3_MAX and float(q.float()[1, 0]) == -E4M3_MAX
    assert torch.isfinite(q.float()).all()
    torch.testing.assert_close(dequantize(q, scale), w, rtol=2.0**-4, atol=scale.item())


@pytest.mark.parametrize("scaling", ["channel", "tensor"])
def test_fp8_linear_matches_the_dequantized_product(scaling: str) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=gen) * 0.05
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    layer = quantize_linear("w", w, scaling, torch.bfloat16)  # type: ignore[arg-type]
    assert isinstance(layer, Fp8Linear)
    assert layer.nbytes == 48 * 64 + layer.scale.numel() * 4
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 48)
    # The same math in float64 from the FP8 operands: only bf16 output rounding differs.
    xq, x_scale = quantize(x, scaling)  # type: ignore[arg-type]
    reference = dequantize(xq, x_scale).double() @ dequantize(layer.weight, layer.scale).double().T
    assert _rel_err(out, reference) < 1e-2
    # Against the unquantized product: FP8's error, a few percent.
    assert _rel_err(out, x.double() @ w.double().T) < 0.08


def test_fp8_refuses_shapes_scaled_mm_cannot_take() -> None:
    with pytest.raises(ValueError, match=r"layers.0.mlp.down_proj: shape \(48, 40\).*16"):
        quantize_linear("layers.0.mlp.down_proj", torch.randn(48, 40), "channel", torch.bfloat16)


def test_fp8_model_keeps_embeddings_norms_and_lm_head_wide(micro_dir: Path) -> None:
    wide = LlamaModel.load(micro_dir, dtype=torch.bfloat16)
    fp8 = LlamaModel.load(micro_dir, dtype=torch.bfloat16, fp8="channel")
    layer = fp8.layers[0]
    assert isinstance(layer.wqkv, Fp8Linear) and layer.wqkv.weight.dtype == FP8_DTYPE
    assert isinstance(wide.layers[0].wqkv, PlainLinear)
    for tensor in (fp8.embed, fp8.lm_head, fp8.norm, layer.attn_norm, layer.mlp_norm):
        assert tensor.dtype == torch.bfloat16
    assert fp8.weight_bytes < wide.weight_bytes


@pytest.mark.parametrize("scaling", ["channel", "tensor"])
def test_fp8_model_logits_stay_close_to_float32(scaling: str) -> None:
    prompt = list(range(1, 60))
    reference = random_model("tiny", seed=1)
    expected = reference.forward(prompt, reference.new_cache(64), 0)
    fp8 = random_model("tiny", dtype=torch.bfloat16, fp8=scaling, seed=1)  # type: ignore[arg-type]
    got = fp8.forward(prompt, fp8.new_cache(64), 0)
    assert _rel_err(got, expected) < 0.03  # bf16 alone is ~0.004 here; FP8 adds ~0.01


# --- the decode step ------------------------------------------------------------------------------


class RecordingCapture:
    """A capture that runs the body eagerly on replay and records the static-buffer contract."""

    def __init__(self) -> None:
        self.captured: list[Callable[[], None]] = []
        self.replays = 0

    def __call__(self, body: Callable[[], None]) -> Callable[[], None]:
        self.captured.append(body)

        def replay() -> None:
            self.replays += 1
            body()

        return replay


def test_decode_spans_double_up_to_the_cache() -> None:
    assert decode_spans(64, 4) == [4, 8, 16, 32, 64]
    assert decode_spans(100, 32) == [32, 64, 100]
    assert decode_spans(16, 256) == [16]


def test_graph_decode_keeps_its_static_buffers_and_matches_eager(micro_model: LlamaModel) -> None:
    capture = RecordingCapture()
    cache = micro_model.new_cache(64)
    step = GraphDecode(micro_model, cache, capture, smallest_span=4)
    assert len(capture.captured) == len(step.spans) == 5  # one capture per span, at start-up
    inputs, outputs = step.step_in.data_ptr(), step.logits.data_ptr()
    eager_cache = micro_model.new_cache(64)
    seq = TOKENS + TOKENS + [4, 9, 11]  # 27 positions: spans 4, 8, 16 and 32 are all used
    micro_model.forward(seq[:1], cache, 0)
    micro_model.forward(seq[:1], eager_cache, 0)
    for pos in range(1, len(seq)):
        got = step(seq[pos], pos)
        assert got is step.logits  # the output is read from the static buffer
        # The inputs were copied into the buffer; the step wrote its greedy choice back.
        assert step.step_in.tolist() == [int(got.argmax()), pos + 1]
        assert (step.step_in.data_ptr(), step.logits.data_ptr()) == (inputs, outputs)
        expected = micro_model.forward([seq[pos]], eager_cache, pos)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert capture.replays == len(seq) - 1
    assert len(capture.captured) == 5  # nothing was captured again
    with pytest.raises(ValueError, match="outside the cache"):
        step(1, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fixed_shape_step_ignores_what_unwritten_cache_positions_hold(
    micro_dir: Path, dtype: torch.dtype
) -> None:
    model = LlamaModel.load(micro_dir, dtype=dtype)
    cache, eager_cache = model.new_cache(64), model.new_cache(64)
    with torch.inference_mode():
        for t in (cache.k, cache.v):
            t.fill_(float("nan"))  # what uninitialised memory may hold
    step = GraphDecode(model, cache, RecordingCapture(), smallest_span=8)
    model.forward(TOKENS[:3], cache, 0)
    model.forward(TOKENS[:3], eager_cache, 0)
    # Positions 3..20 attend over spans 8, 16 and 32: each step masks unwritten NaN positions.
    for pos in range(3, 21):
        token = TOKENS[pos % len(TOKENS)]
        got = step(token, pos)
        assert torch.isfinite(got).all(), pos
        expected = model.forward([token], eager_cache, pos)
        # bf16: logits near 4 here, whose unit in the last place is 2^-5; 4 of them.
        atol = 1e-4 if dtype == torch.float32 else 0.125
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=atol)


def test_generate_with_the_graph_step_gives_the_eager_tokens(micro_model: LlamaModel) -> None:
    cache = micro_model.new_cache(64)
    step = GraphDecode(micro_model, cache, RecordingCapture(), smallest_span=8)
    graph = list(generate(micro_model, TOKENS, 20, None, GREEDY_PARAMS, cache=cache, decode=step))
    eager = list(generate(micro_model, TOKENS, 20, None, GREEDY_PARAMS))
    assert graph == eager and len(graph) == 20
    with pytest.raises(ValueError, match="its own cache"):
        generate(micro_model, TOKENS, 2, None, GREEDY_PARAMS, decode=step)


class LoggedStep:
    """A graph step that logs its launches and the reads of their tokens, in order."""

    def __init__(self, step: GraphDecode) -> None:
        self.step, self.cache = step, step.cache
        self.prefill, self.rows = step.prefill, step.rows
        self.log: list[str] = []

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        self.log.append(f"call {pos}")
        return self.step(token, pos)

    def launch(self, pos: int, token: int | None = None) -> Callable[[], int]:
        self.log.append(f"launch {pos}")
        read = self.step.launch(pos, token)

        def logged() -> int:
            self.log.append(f"read {pos}")
            return read()

        return logged


def test_greedy_steps_are_queued_before_the_previous_token_is_read(
    micro_model: LlamaModel,
) -> None:
    cache = micro_model.new_cache(64)
    step = LoggedStep(GraphDecode(micro_model, cache, RecordingCapture(), smallest_span=8))
    history: list[int] = []
    n = len(TOKENS)
    chained = list(
        generate(
            micro_model, TOKENS, 6, None, GREEDY_PARAMS, cache=cache, decode=step, history=history
        )
    )
    assert step.log == [
        f"launch {n}",
        f"launch {n + 1}",
        f"read {n}",
        f"launch {n + 2}",
        f"read {n + 1}",
        f"launch {n + 3}",
        f"read {n + 2}",
        f"launch {n + 4}",
        f"read {n + 3}",
        f"read {n + 4}",
    ]  # five steps for six tokens; each read after the next step was queued
    assert history == TOKENS + chained[:5]  # the last token's K/V is never written
    # Asking for log-probabilities takes the step-by-step path: the same tokens.
    step.log.clear()
    one_by_one = list(
        generate(micro_model, TOKENS, 6, None, GREEDY_PARAMS, cache=cache, decode=step, logprobs=[])
    )
    assert one_by_one == chained and step.log == [f"call {p}" for p in range(n, n + 5)]


def test_a_chain_that_reaches_the_end_id_stops_there(micro_model: LlamaModel) -> None:
    cache = micro_model.new_cache(64)
    step = LoggedStep(GraphDecode(micro_model, cache, RecordingCapture(), smallest_span=8))
    free = list(generate(micro_model, TOKENS, 8, None, GREEDY_PARAMS, cache=cache, decode=step))
    end = free[3]
    cut = free.index(end)
    step.log.clear()
    history: list[int] = []
    got = generate(
        micro_model, TOKENS, 8, end, GREEDY_PARAMS, cache=cache, decode=step, history=history
    )
    assert list(got) == free[:cut]
    assert history == TOKENS + free[:cut]  # the end id's own step never ran
    # The step after the end id's was queued before the end id was read: computed in vain.
    assert step.log[-2:] == [f"launch {len(TOKENS) + cut}", f"read {len(TOKENS) + cut - 1}"]


def test_a_cancelled_chain_queues_no_further_step(micro_model: LlamaModel) -> None:
    cache = micro_model.new_cache(64)
    step = LoggedStep(GraphDecode(micro_model, cache, RecordingCapture(), smallest_span=8))
    cancel = threading.Event()
    out = generate(
        micro_model,
        TOKENS,
        20,
        None,
        GREEDY_PARAMS,
        should_stop=cancel.is_set,
        cache=cache,
        decode=step,
    )
    got = [next(out), next(out)]
    cancel.set()
    got += list(out)
    # No token after the cancel; the step queued before it ran in vain, none was queued after.
    assert len(got) == 2
    assert sum(line.startswith("launch") for line in step.log) == 2


def test_chunked_prefill_gives_the_same_tokens_and_stops_between_chunks(
    micro_model: LlamaModel,
) -> None:
    whole = list(generate(micro_model, TOKENS, 8, None, GREEDY_PARAMS))
    chunked = list(generate(micro_model, TOKENS, 8, None, GREEDY_PARAMS, prefill_chunk=5))
    assert chunked == whole
    polls = 0

    def stop_after_first_chunk() -> bool:
        nonlocal polls
        polls += 1
        return polls > 1  # the poll before the prefill says go, the one after chunk 1 says stop

    history: list[int] = []
    out = generate(
        micro_model,
        TOKENS,
        8,
        None,
        GREEDY_PARAMS,
        should_stop=stop_after_first_chunk,
        prefill_chunk=5,
        history=history,
    )
    assert list(out) == [] and polls == 2 and history == []


def test_runner_close_cancels_the_running_job_and_joins(micro_model: LlamaModel) -> None:
    runner = Runner(micro_model, 64, capture=RecordingCapture())
    first_token = threading.Event()
    release = threading.Event()
    finals: list[Emission] = []
    graph_step = runner.decode

    class HeldStep:
        cache = runner.cache
        prefill = graph_step.prefill
        rows = graph_step.rows

        def __call__(self, token: int, pos: int) -> torch.Tensor:
            release.wait(10)  # the job stays in its decode loop until close() has cancelled it
            return graph_step(token, pos)

        def launch(self, pos: int, token: int | None = None) -> Callable[[], int]:
            release.wait(10)
            return graph_step.launch(pos, token)

    runner.decode = HeldStep()

    def emit(e: Emission) -> None:
        first_token.set()
        if e.final:
            finals.append(e)

    job = Job("long", TOKENS, 50, None, GREEDY_PARAMS, True, emit)
    runner.submit(job)
    assert first_token.wait(10)
    closed: list[bool] = []
    closing = threading.Thread(target=lambda: closed.append(runner.close(10)))
    closing.start()
    assert job.cancel.wait(10)  # close() cancelled the running job
    release.set()
    closing.join(15)
    assert closed == [True] and not runner._thread.is_alive()
    # Ended as a cancelled streaming job: the executor's final result, with no new tokens.
    assert [(e.tokens, e.final) for e in finals] == [([], True)]
    assert runner.stats.cancelled == 1
    late = Job("late", TOKENS, 1, None, GREEDY_PARAMS, False, lambda e: None)
    runner.submit(late)
    assert late.cancel.is_set()


# --- random weights -------------------------------------------------------------------------------


def test_llama_3_1_8b_shape_has_the_published_numbers() -> None:
    config = random_config("llama-3.1-8b")
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        32,
        4096,
        14336,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert config.vocab_size == 128256 and config.rope_theta == 500000.0
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    assert round(count_params(config).total / 1e9, 2) == 8.03
    with pytest.raises(ValueError, match=r"known: llama-3\.1-8b, tiny"):
        random_config("llama-9b")


def test_random_weights_are_seeded_per_tensor_and_finite() -> None:
    config = random_config("tiny")
    a = RandomTensors(config, torch.device("cpu"), seed=3)
    b = RandomTensors(config, torch.device("cpu"), seed=3)
    name = "model.layers.1.mlp.up_proj.weight"
    torch.testing.assert_close(a[name], b[name])  # whatever was drawn before it
    assert not torch.equal(a[name], RandomTensors(config, torch.device("cpu"), seed=4)[name])
    bound = config.hidden_size**-0.5
    assert a[name].abs().max() <= bound
    assert torch.equal(a["model.norm.weight"], torch.ones(config.hidden_size))
    model = random_model("tiny", dtype=torch.bfloat16, fp8="channel", seed=3)
    logits = model.forward(list(range(1, 40)), model.new_cache(64), 0)
    assert torch.isfinite(logits).all()
    again = random_model("tiny", dtype=torch.bfloat16, fp8="channel", seed=3)
    torch.testing.assert_close(again.forward(list(range(1, 40)), again.new_cache(64), 0), logits)


# --- fit, options, refusals -----------------------------------------------------------------------


def test_fit_check_uses_the_planners_numbers_and_names_them() -> None:
    config = random_config("llama-3.1-8b")
    options = EngineOptions(device="cpu", dtype="bfloat16")
    plan = check_fit(config, options, KV, 8192, 2048, 6, free_bytes=80 << 30)
    assert plan.fits and plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert plan.weight_bytes == 2 * count_params(config).total  # bf16, lm_head untied
    with pytest.raises(FitError) as err:
        check_fit(config, options, KV, 131072, 2048, 10, free_bytes=24 << 30)
    message = str(err.value)
    assert "does not fit on cpu: needs" in message and "weights 14.96 GiB (bfloat16)" in message
    assert "KV cache 16.00 GiB (131072 tokens)" in message and "24.00 GiB is free" in message
    assert "use --weights fp8" in message and "\n" not in message
    fp8 = EngineOptions(device="cpu", dtype="bfloat16", weights="fp8")
    assert check_fit(config, fp8, KV, 8192, 2048, 6, free_bytes=24 << 30).weight_bytes < (
        plan.weight_bytes
    )


def test_a_model_too_large_for_free_memory_is_refused_before_loading(
    tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = write_hf_repository(tiny.model_dir, tmp_path / "repo", guided_decoding=False)
    monkeypatch.setattr("appliance.engine.options.free_device_bytes", lambda device: 64 << 20)
    loaded: list[object] = []
    monkeypatch.setattr(LlamaModel, "load", lambda *a, **k: loaded.append(a))
    with pytest.raises(RepositoryError, match=r"model 'tensorrt_llm': does not fit on cpu"):
        load_repository(repo)
    assert loaded == []  # refused on config.json alone


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--weights", "fp8"], "--weights fp8: FP8 linear layers compute in bfloat16"),
        (["--cuda-graph", "on"], "--cuda-graph on: CUDA graphs need a CUDA device"),
        (["--random-weights", "gpt-5"], "--random-weights gpt-5: known shapes: llama-3.1-8b, tiny"),
        (["--seed", "-1"], "--seed -1: expected an integer"),
        (["--prefill-buckets", "16,x"], "--prefill-buckets 16,x: expected comma-separated"),
        (["--prefill-buckets", "0,16"], "--prefill-buckets 0,16: each bucket must be"),
    ],
)
def test_engine_refuses_options_it_cannot_honour(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    rc = appliance_cli.main(["engine", "--repository", str(tmp_path), *argv])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1
    assert lines[0].startswith(f"appliance engine: {message}"), lines


def test_triton_kernels_without_a_gpu_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc = appliance_cli.main(["engine", "--repository", str(tmp_path), "--kernels", "triton"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1
    assert lines[0] in (
        "appliance engine: --kernels triton: Triton kernels need a CUDA device; use --kernels torch",
        "appliance engine: --kernels triton: the triton package is not installed; use --kernels torch",
    )
    assert EngineOptions(device="cpu").kernel_path == "torch"  # auto: torch on a CPU


def test_random_weights_serve_a_repository_without_reading_its_checkpoint(
    tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = write_hf_repository(tiny.model_dir, tmp_path / "repo", guided_decoding=False)

    def no_checkpoint(*args: object, **kwargs: object) -> None:
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(LlamaModel, "load", no_checkpoint)
    monkeypatch.setattr("appliance.engine.loading.load_config", no_checkpoint)
    models = load_repository(
        repo, EngineOptions(random_weights="tiny", dtype="bfloat16", weights="fp8", seed=1)
    )
    try:
        served = models["tensorrt_llm"]
        assert served.model.config == random_config("tiny")
        assert isinstance(served.model.layers[0].w13, Fp8Linear)
        assert served.max_len == served.entry.kv_cache.max_seq_len  # the repository's limit
    finally:
        for m in models.values():
            m.runner.close()
