"""The bucketed prefill (`appliance.engine.prefill`) against the eager prefill, on the CPU.

The captured prefill's body runs here without a capture (a recording stand-in replays it eagerly),
so everything but the CUDA graph itself is the code a GPU runs: padding to a bucket, the fixed
attention span, selection of unwritten cache positions, the fallback to the eager prefill.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import pytest
import torch

from appliance.engine.decode import EagerDecode, GraphDecode, decode_spans
from appliance.engine.linear import Linear
from appliance.engine.llama import KVCache, LlamaModel
from appliance.engine.options import EngineOptions
from appliance.engine.prefill import (
    MAX_PREFILL_BUCKET,
    GraphPrefill,
    bucket_problem,
    parse_buckets,
    prefill_graph_count,
)
from appliance.engine.random_weights import random_model
from appliance.engine.repository import KvCacheParams
from appliance.engine.runner import Emission, Job, build_runner
from appliance.engine.sampling import SamplingParams, generate
from appliance.engine.verify import GraphVerify

GREEDY = SamplingParams(top_k=1)
BUCKETS = (4, 8, 16)
# Each bucket, one below it and one above it; 17 is above the largest (eager).
LENGTHS = (1, 3, 4, 5, 7, 8, 9, 15, 16, 17)
# (rtol, atol) of logits against the eager prefill. float32 differs only in summation order
# (attention over a padded span, GQA batched differently). bf16 rounds each product to 2^-8
# relative, so the two orders differ by a few units of logits near 1.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 6e-2)}


class BucketCapture:
    """A capture that replays the body eagerly and records which (bucket, span) each replay was."""

    def __init__(self) -> None:
        self.captured: list[Callable[[], None]] = []
        self.replayed: list[tuple[int, int]] = []

    def __call__(self, body: Callable[[], None]) -> Callable[[], None]:
        self.captured.append(body)

        def replay() -> None:
            if isinstance(body, partial) and body.func.__name__ == "prefill_static":
                ids, _, _, span, _ = body.args
                self.replayed.append((ids.shape[0], span))
            body()

        return replay


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def _nan_cache(model: LlamaModel, tokens: int) -> KVCache:
    cache = model.new_cache(tokens)
    with torch.inference_mode():
        cache.k.fill_(float("nan"))  # what uninitialised memory may hold
        cache.v.fill_(float("nan"))
    return cache


@pytest.fixture(scope="module")
def tiny32() -> LlamaModel:
    return random_model("tiny", torch.device("cpu"), torch.float32, seed=3)


def test_bucket_limits() -> None:
    assert bucket_problem((16, 32, 64, 128)) is None
    assert bucket_problem((0, 16)) is not None
    assert bucket_problem((MAX_PREFILL_BUCKET + 1,)) is not None
    assert parse_buckets("64,16,32,16") == (16, 32, 64) and parse_buckets("none") == ()
    for bad in ("16,x", "0", "-4", str(MAX_PREFILL_BUCKET + 1)):
        with pytest.raises(ValueError):
            parse_buckets(bad)
    assert EngineOptions().prefill_buckets == (16, 32, 64, 128)
    assert EngineOptions(prefill_buckets=(0,)).problem() == (
        "--prefill-buckets",
        f"each bucket must be a token count in [1, {MAX_PREFILL_BUCKET}], got [0]",
    )
    # Each bucket over each span that can hold it.
    assert prefill_graph_count((4, 8, 16), (8, 16, 32)) == 3 + 3 + 2


@pytest.mark.parametrize(
    ("dtype", "fp8"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "tensor")],
    ids=["f32", "bf16", "fp8-tensor"],
)
@pytest.mark.parametrize("start", [0, 9], ids=["fresh", "reused-prefix"])
def test_bucketed_prefill_gives_the_eager_logits_below_at_and_above_each_bucket(
    dtype: torch.dtype, fp8: str | None, start: int
) -> None:
    """Prompt lengths around every bucket, from position 0 and after a 9-token prefix already in
    the cache, on a cache whose unwritten positions hold NaN. With FP8 per-tensor scaling, one
    scale covers every row of an activation, so a padded row that were not exactly zero would
    change the live rows' quantisation."""
    model = random_model("tiny", torch.device("cpu"), dtype, fp8=fp8, seed=3)  # type: ignore[arg-type]
    capture = BucketCapture()
    cache = _nan_cache(model, 64)
    spans = decode_spans(64, 16)  # 16, 32, 64
    prefill = GraphPrefill(model, cache, capture, BUCKETS, spans)
    prompt = _prompt(start + max(LENGTHS), model.config.vocab_size)
    rtol, atol = TOLERANCE[dtype]
    for n in LENGTHS if fp8 is None else (3, 4, 9, 17):  # FP8 products are slow on a CPU
        ref_cache = model.new_cache(64)
        if start:
            model.forward(prompt[:start], ref_cache, 0)
            model.forward(prompt[:start], cache, 0)  # the reused prefix
        expected = model.forward(prompt[start : start + n], ref_cache, start)
        got = prefill(prompt[start : start + n], start)
        if n > BUCKETS[-1]:
            assert got is None, n  # the caller prefills eagerly
            continue
        assert got is prefill.logits and torch.isfinite(got).all(), n
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=f"n={n}")
        bucket = min(b for b in BUCKETS if b >= n)
        assert capture.replayed[-1] == (bucket, min(s for s in spans if s >= start + bucket))
        # The live positions' K/V are what the eager prefill wrote: later steps read them.
        end = start + n
        torch.testing.assert_close(
            cache.k[:, :, :end], ref_cache.k[:, :, :end], rtol=rtol, atol=atol
        )
        torch.testing.assert_close(
            cache.v[:, :, :end], ref_cache.v[:, :, :end], rtol=rtol, atol=atol
        )


@dataclass
class RowsSeen:
    """A linear layer that records the rows it is given, then runs the real one."""

    layer: Linear
    inputs: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.layer.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x.clone())
        return self.layer(x)


def test_padded_rows_stay_exactly_zero_into_every_linear_layer() -> None:
    """What makes padding inert: a padded row is zero wherever an activation scale could see it
    (an FP8 per-tensor scale is one amax over every row)."""
    model = random_model("tiny", torch.device("cpu"), torch.float32, seed=3)
    seen = []
    for layer in model.layers:
        for name in ("wqkv", "wo", "w13", "w2"):
            spy = RowsSeen(getattr(layer, name))
            setattr(layer, name, spy)
            seen.append(spy)
    cache = _nan_cache(model, 64)
    prefill = GraphPrefill(model, cache, BucketCapture(), (16,), (32,))
    for spy in seen:
        spy.inputs.clear()  # the capture's own runs
    prompt = _prompt(12, model.config.vocab_size)
    model.forward(prompt[:7], cache, 0)
    for spy in seen:
        spy.inputs.clear()
    assert prefill(prompt[7:], 7) is not None  # 5 live rows in the 16-token bucket
    for spy in seen:
        (x,) = spy.inputs
        assert x.shape[0] == 16 and torch.isfinite(x[:5]).all() and x[:5].abs().sum() > 0
        assert torch.equal(x[5:], torch.zeros_like(x[5:]))


def run_at_capture(body: Callable[[], None]) -> Callable[[], None]:
    """A capture that runs the body once as it captures, as the CUDA capture's warm-up does, on
    whatever the static buffers hold before any request."""
    body()
    return body


def test_the_captured_bodies_run_on_the_buffers_as_they_stand_before_any_request(
    tiny32: LlamaModel,
) -> None:
    """The CUDA capture runs each body before a request has filled its buffers; a count of 0
    live tokens there made the prefill index row -1 (a device-side assert on a GPU, an
    IndexError here)."""
    cache = tiny32.new_cache(64)
    spans = decode_spans(64, 16)
    GraphPrefill(tiny32, cache, run_at_capture, BUCKETS, spans)
    GraphVerify(tiny32, cache, run_at_capture, (1, 4), spans)


def test_the_prefill_is_captured_once_per_bucket_and_span_with_fixed_buffers(
    tiny32: LlamaModel,
) -> None:
    capture = BucketCapture()
    cache = tiny32.new_cache(64)
    spans = decode_spans(64, 16)
    prefill = GraphPrefill(tiny32, cache, capture, (8, 4, 8, 16), spans)  # sorted, deduplicated
    assert prefill.buckets == [4, 8, 16]
    assert len(capture.captured) == prefill_graph_count(BUCKETS, spans) == 9
    buffers = prefill.prefill_in.data_ptr(), prefill.logits.data_ptr()
    prompt = _prompt(20, tiny32.config.vocab_size)
    prefill(prompt[:3], 0)
    prefill(prompt[3:12], 3)
    assert capture.replayed == [(4, 16), (16, 32)]  # 3..18 needs the 32-position span
    assert (prefill.prefill_in.data_ptr(), prefill.logits.data_ptr()) == buffers
    assert len(capture.captured) == 9  # nothing captured again
    # A bucket that would run past the end of the cache: eager, not an error.
    assert prefill.choose(3, 61) is None and prefill(prompt[:3], 61) is None
    assert prefill.choose(3, 60) == (4, 64)
    with pytest.raises(ValueError, match="token ids"):
        prefill([tiny32.config.vocab_size], 0)
    with pytest.raises(ValueError, match="decode step's cache"):
        GraphDecode(tiny32, tiny32.new_cache(64), capture, prefill=prefill)


def _decode(model: LlamaModel, cache: KVCache, capture: BucketCapture) -> GraphDecode:
    spans = decode_spans(cache.max_seq_len, 32)
    prefill = GraphPrefill(model, cache, capture, (16, 32, 64, 128), spans)
    return GraphDecode(model, cache, capture, smallest_span=32, prefill=prefill)


def test_greedy_tokens_equal_eager_over_64_tokens_in_float32(tiny32: LlamaModel) -> None:
    capture = BucketCapture()
    cache = _nan_cache(tiny32, 256)
    step = _decode(tiny32, cache, capture)
    for n in (5, 64, 100, 130):  # below, at and between buckets, and above the largest
        prompt = _prompt(n, tiny32.config.vocab_size, seed=n)
        capture.replayed.clear()
        got = list(generate(tiny32, prompt, 64, None, GREEDY, cache=cache, decode=step))
        assert got == list(generate(tiny32, prompt, 64, None, GREEDY)), n
        assert len(got) == 64
        assert (capture.replayed[:1] == []) == (n > 128), n  # 130 tokens: the eager prefill


def test_a_prefill_continuing_a_reused_prefix_pays_for_its_new_tokens_only(
    tiny32: LlamaModel,
) -> None:
    """generate's start_pos (what the runner passes after copying a pooled prefix in): a
    200-token prefix in the cache, 40 new tokens take the 64-token bucket."""
    capture = BucketCapture()
    cache = _nan_cache(tiny32, 512)
    step = _decode(tiny32, cache, capture)
    prompt = _prompt(240, tiny32.config.vocab_size, seed=7)
    EagerDecode(tiny32, cache).prefill(prompt[:200], 0)
    got = list(generate(tiny32, prompt, 64, None, GREEDY, cache=cache, start_pos=200, decode=step))
    assert got == list(generate(tiny32, prompt, 64, None, GREEDY))
    assert capture.replayed[0] == (64, 512)  # positions 200..263: the 512-position span


def test_the_runner_prefills_the_new_tokens_after_a_pooled_prefix_in_a_bucket(
    tiny32: LlamaModel,
) -> None:
    capture = BucketCapture()
    params = KvCacheParams(
        max_seq_len=256,
        tokens_per_block=16,
        enable_reuse=True,
        max_tokens=256 + 512,
        free_mem_fraction=0.9,
    )
    runner = build_runner(tiny32, params, "test", capture, prefill_buckets=(16, 32, 64, 128))
    try:
        prefix = _prompt(100, tiny32.config.vocab_size, seed=11)

        def run(prompt: list[int]) -> list[int]:
            out: list[int] = []
            errors: list[str | None] = []
            done = threading.Event()

            def emit(e: Emission) -> None:
                out.extend(e.tokens or [])
                if e.final:
                    errors.append(e.error)
                    done.set()

            runner.submit(Job("r", prompt, 16, None, GREEDY, False, emit))
            assert done.wait(120) and errors == [None]
            return out

        first = run(prefix)  # 100 tokens: the 128 bucket; its 6 full blocks are pooled
        assert capture.replayed[0] == (128, 256)
        capture.replayed.clear()
        prompt = prefix + _prompt(10, tiny32.config.vocab_size, seed=12)
        second = run(prompt)
        # 96 tokens reused: 14 new tokens take the 16-token bucket.
        assert capture.replayed[0] == (16, 256)
        assert first == list(generate(tiny32, prefix, 16, None, GREEDY))
        assert second == list(generate(tiny32, prompt, 16, None, GREEDY))
    finally:
        runner.close()
