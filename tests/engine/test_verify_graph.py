"""The captured verify step of speculative decoding, run on the CPU.

`LlamaModel.verify_static` (the body each verify graph captures) runs eagerly here and is compared
with the eager reference, `forward_rows`: logits of every row and the cache contents, for several
draft counts and positions, over cache positions holding NaN where nothing was written. A stand-in
capture replays the bodies eagerly, so `GraphVerify`'s routing, static buffers and the runner's
speculation with CUDA graphs are exercised as a GPU runs them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance import cli as appliance_cli
from appliance.engine.decode import GraphDecode, decode_spans
from appliance.engine.llama import KVCache, LlamaModel
from appliance.engine.options import EngineOptions
from appliance.engine.options import check_fit as check_fit_of_options
from appliance.engine.runner import Emission, Job, Runner
from appliance.engine.sampling import SamplingParams, generate
from appliance.engine.server import load_repository
from appliance.engine.speculative import NgramSpeculation, OffSwitch, SpecCounts
from appliance.engine.verify import (
    GraphVerify,
    default_verify_counts,
    parse_verify_graphs,
    verify_graph_count,
)
from engine_build.repo import write_hf_repository
from tests.conftest import Tiny
from tests.engine.conftest import write_micro_checkpoint

GREEDY = SamplingParams(top_k=1)
SPEC = NgramSpeculation(draft_tokens=4, ngram=3, off_switch=OffSwitch(min_accepted=0.0))
SEQ = [(7 * i + 3) % 90 + 3 for i in range(120)]
MAX_SEQ = 128
SMALLEST_SPAN = 8
SPANS = decode_spans(MAX_SEQ, SMALLEST_SPAN)  # 8, 16, 32, 64, 128


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    dest = tmp_path_factory.mktemp("verify")
    return LlamaModel.load(write_micro_checkpoint(dest, {"max_position_embeddings": MAX_SEQ}))


class VerifyCapture:
    """A capture that replays the body eagerly and records which (rows, span) each verify replay
    was."""

    def __init__(self) -> None:
        self.captured: list[tuple[int, int]] = []
        self.replayed: list[tuple[int, int]] = []

    def __call__(self, body: Callable[[], None]) -> Callable[[], None]:
        key = (0, 0)
        if isinstance(body, partial) and body.func.__name__ == "verify_static":
            ids, _, _, span, _ = body.args
            key = (ids.shape[0], span)
            self.captured.append(key)

        def replay() -> None:
            if key != (0, 0):
                self.replayed.append(key)
            body()

        return replay


def _nan_cache(model: LlamaModel) -> KVCache:
    cache = model.new_cache(MAX_SEQ)
    with torch.inference_mode():
        cache.k.fill_(float("nan"))  # what uninitialised memory may hold
        cache.v.fill_(float("nan"))
    return cache


def _prefilled(model: LlamaModel, pos: int) -> tuple[KVCache, KVCache]:
    """(a cache of NaN but positions 0..pos-1, a reference cache) both holding SEQ[:pos]."""
    cache, reference = _nan_cache(model), model.new_cache(MAX_SEQ)
    if pos:
        model.forward(SEQ[:pos], cache, 0)
        model.forward(SEQ[:pos], reference, 0)
    return cache, reference


def _verify_static(
    model: LlamaModel, cache: KVCache, tokens: list[int], pos: int, rows: int
) -> torch.Tensor:
    """verify_static's logits of `tokens` at `pos`, padded to `rows`, over the smallest span."""
    ids = torch.tensor(tokens + [0] * (rows - len(tokens)), dtype=torch.long)
    meta = torch.tensor([pos, len(tokens)], dtype=torch.long)
    span = SPANS[bisect.bisect_left(SPANS, pos + rows)]
    logits = torch.full((rows, model.config.vocab_size), float("nan"))
    with torch.inference_mode():
        model.verify_static(ids, meta, cache, span, logits)
    return logits[: len(tokens)]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("pos", [0, 5, 23, 60])
def test_the_static_verify_step_matches_forward_rows(model: LlamaModel, k: int, pos: int) -> None:
    cache, reference = _prefilled(model, pos)
    tokens = SEQ[pos : pos + k + 1]
    got = _verify_static(model, cache, tokens, pos, k + 1)
    expected = model.forward_rows(tokens, reference, pos)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    end = pos + k + 1
    torch.testing.assert_close(cache.k[:, :, :end], reference.k[:, :, :end], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :end], reference.v[:, :, :end], rtol=1e-4, atol=1e-5)
    assert cache.k[:, :, end:].isnan().all()  # nothing after the step's rows was written


@pytest.mark.parametrize(("k", "rows"), [(1, 3), (3, 5), (5, 9)])
def test_a_padded_verify_step_scores_its_live_rows_as_forward_rows(
    model: LlamaModel, k: int, rows: int
) -> None:
    pos = 17
    cache, reference = _prefilled(model, pos)
    tokens = SEQ[pos : pos + k + 1]
    got = _verify_static(model, cache, tokens, pos, rows)
    torch.testing.assert_close(
        got, model.forward_rows(tokens, reference, pos), rtol=1e-4, atol=1e-4
    )
    live = pos + k + 1
    torch.testing.assert_close(cache.k[:, :, :live], reference.k[:, :, :live], rtol=1e-4, atol=1e-5)


def test_rejected_draft_positions_holding_nan_change_nothing_later(model: LlamaModel) -> None:
    pos, k = 30, 6
    cache, reference = _prefilled(model, pos)
    drafts = [50, 51, 52, 53, 54, 55]  # scored at positions 31..36; say two are accepted
    _verify_static(model, cache, [SEQ[pos], *drafts], pos, k + 1)
    accepted = 2
    with torch.inference_mode():  # the rejected positions now hold anything, NaN included
        cache.k[:, :, pos + 1 + accepted :].fill_(float("nan"))
        cache.v[:, :, pos + 1 + accepted :].fill_(float("nan"))
    model.forward_rows([SEQ[pos], *drafts[:accepted]], reference, pos)
    # The next verify step starts at the first rejected position, over a span holding NaN.
    nxt = pos + 1 + accepted
    tokens = [70, 71, 72, 73, 74]
    got = _verify_static(model, cache, tokens, nxt, 8)  # padded too: 5 live rows of 8
    assert torch.isfinite(got).all()
    torch.testing.assert_close(
        got, model.forward_rows(tokens, reference, nxt), rtol=1e-4, atol=1e-4
    )
    # And the single-token step after it (accepting all four drafts, then one more token).
    step = GraphDecode(model, cache, VerifyCapture(), smallest_span=SMALLEST_SPAN)
    after = nxt + len(tokens)
    logits = step(9, after)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, model.forward([9], reference, after), rtol=1e-4, atol=1e-4)


def test_graph_verify_is_captured_once_per_count_and_span_and_replays_the_next_larger(
    model: LlamaModel,
) -> None:
    capture = VerifyCapture()
    cache = model.new_cache(MAX_SEQ)
    verify = GraphVerify(model, cache, capture, (4, 1, 2, 8, 4), SPANS)  # sorted, deduplicated
    assert verify.draft_counts == [1, 2, 4, 8]
    assert len(capture.captured) == verify_graph_count((1, 2, 4, 8), SPANS) == 4 * 5 - 1
    assert (9, 8) not in capture.captured and (9, 16) in capture.captured  # 9 rows need 16
    buffers = verify.verify_in.data_ptr(), verify.logits.data_ptr()
    model.forward(SEQ[:40], cache, 0)
    reference = model.new_cache(MAX_SEQ)
    model.forward(SEQ[:40], reference, 0)
    for drafts, rows in ((1, 2), (2, 3), (3, 5), (4, 5), (5, 9), (8, 9)):
        tokens = SEQ[40 : 41 + drafts]
        got = verify(tokens, 40)
        assert got is not None and got.shape == (drafts + 1, model.config.vocab_size)
        assert capture.replayed[-1] == (rows, 64)
        expected = model.forward_rows(tokens, reference, 40)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (verify.verify_in.data_ptr(), verify.logits.data_ptr()) == buffers
    assert len(capture.captured) == 19  # nothing was captured again
    assert verify(SEQ[:10], 40) is None  # 9 drafts: more than any graph holds
    assert verify(SEQ[:2], MAX_SEQ - 2) is not None  # 1 draft: 2 rows end at the cache's end
    assert verify(SEQ[:4], MAX_SEQ - 4) is None  # 3 drafts pad to 5 rows: past the end, eager
    with pytest.raises(ValueError, match="token ids"):
        verify([1, 97], 0)
    with pytest.raises(ValueError, match="draft count"):
        GraphVerify(model, cache, capture, (0, 4), SPANS)


def test_speculation_on_the_graph_step_gives_the_eager_tokens(model: LlamaModel) -> None:
    capture = VerifyCapture()
    cache = model.new_cache(MAX_SEQ)
    verify = GraphVerify(model, cache, capture, (1, 2, 4), SPANS)
    step = GraphDecode(model, cache, capture, smallest_span=SMALLEST_SPAN, verify=verify)
    prompt = [11, 12, 13, 14, 15] * 4
    counts = SpecCounts()
    got = list(
        generate(
            model,
            prompt,
            80,
            None,
            GREEDY,
            cache=cache,
            decode=step,
            speculation=SPEC,
            spec_counts=counts,
        )
    )
    assert got == list(generate(model, prompt, 80, None, GREEDY))
    assert counts.verify_steps > 0 and counts.accepted > 0
    assert len(capture.replayed) == counts.verify_steps  # every verify step replayed a graph
    with pytest.raises(ValueError, match="verify step must run on the decode step's cache"):
        GraphDecode(model, model.new_cache(MAX_SEQ), capture, verify=verify)


def _run_job(runner: Runner, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    finals: list[Emission] = []

    def emit(e: Emission) -> None:
        out.extend(e.tokens or [])
        if e.final:
            finals.append(e)

    runner.submit(Job("v", prompt, n, None, GREEDY, streaming=False, emit=emit))
    with runner.stats.changed:
        assert runner.stats.changed.wait_for(lambda: runner.stats.completed == 1, timeout=60)
    assert finals and finals[-1].error is None
    return out


def test_the_runner_speculates_with_cuda_graphs_when_verify_steps_are_captured(
    model: LlamaModel,
) -> None:
    prompt = [21, 22, 23, 24] * 5
    plain = Runner(model, MAX_SEQ)
    graphed = Runner(model, MAX_SEQ, capture=VerifyCapture(), speculation=SPEC, verify_counts=(4,))
    uncaptured = Runner(model, MAX_SEQ, capture=VerifyCapture(), speculation=SPEC)
    try:
        assert graphed.speculation is SPEC and uncaptured.speculation is None
        expected = _run_job(plain, prompt, 60)
        assert _run_job(graphed, prompt, 60) == expected
        assert graphed.stats.spec_verify_steps > 0
        assert _run_job(uncaptured, prompt, 60) == expected
        assert uncaptured.stats.spec_verify_steps == 0
    finally:
        for runner in (plain, graphed, uncaptured):
            runner.close()


def test_verify_counts_default_from_draft_tokens_and_parse() -> None:
    assert default_verify_counts(1) == (1,)
    assert default_verify_counts(4) == (1, 2, 4)
    assert default_verify_counts(6) == (1, 2, 4, 6)
    assert default_verify_counts(16) == (1, 2, 4, 8, 16)
    assert parse_verify_graphs("auto") is None
    assert parse_verify_graphs("8,1,4,2,4") == (1, 2, 4, 8)
    for bad in ("x", "0,4", "17"):
        with pytest.raises(ValueError):
            parse_verify_graphs(bad)


def test_options_capture_the_verify_steps_speculation_needs() -> None:
    graphs = EngineOptions(device="cuda", speculative="ngram", draft_tokens=6)
    assert graphs.verify_counts == (1, 2, 4, 6)  # read without touching CUDA
    explicit = EngineOptions(
        device="cuda", speculative="ngram", draft_tokens=4, verify_graphs=(1, 4, 8)
    )
    assert explicit.verify_counts == (1, 4, 8)
    assert EngineOptions(device="cuda", draft_tokens=4).verify_counts == ()  # no speculation
    assert EngineOptions(speculative="ngram").verify_counts == ()  # cpu: the step runs eager
    refused = EngineOptions(speculative="ngram", draft_tokens=5, verify_graphs=(1, 2, 4, 8))
    assert refused.problem() == (
        "--draft-tokens 5",
        "no verify step is captured for 5 drafts (--verify-graphs 1,2,4,8); add 5 to "
        "--verify-graphs, or leave it auto",
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--verify-graphs", "1,x"], "--verify-graphs 1,x: expected comma-separated draft counts"),
        (["--verify-graphs", "0,4"], "--verify-graphs 0,4: each draft count must be in [1, 16]"),
        (
            ["--speculative", "ngram", "--draft-tokens", "3", "--verify-graphs", "1,2,4"],
            "--draft-tokens 3: no verify step is captured for 3 drafts",
        ),
    ],
)
def test_the_engine_refuses_verify_graphs_it_cannot_serve_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    rc = appliance_cli.main(["engine", "--repository", str(tmp_path), *argv])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1
    assert lines[0].startswith(f"appliance engine: {message}"), lines


def test_loading_captures_the_verify_steps_with_the_decode_step(
    tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = write_hf_repository(tiny.model_dir, tmp_path / "repo", guided_decoding=False)
    capture = VerifyCapture()
    monkeypatch.setattr(EngineOptions, "use_cuda_graph", property(lambda self: True))
    monkeypatch.setattr("appliance.engine.loading.cuda_graph_capture", lambda device: capture)
    graphs: list[int] = []

    def check_fit(*args: Any, **kwargs: Any) -> Any:
        graphs.append(args[5])
        return check_fit_of_options(*args, **kwargs)

    monkeypatch.setattr("appliance.engine.loading.check_fit", check_fit)
    options = EngineOptions(
        random_weights="tiny", speculative="ngram", draft_tokens=4, prefill_buckets=()
    )
    models = load_repository(repo, options)
    try:
        runner = models["tensorrt_llm"].runner
        assert isinstance(runner.decode, GraphDecode) and runner.speculation is not None
        assert runner.decode.graph_verify is not None
        assert runner.decode.graph_verify.draft_counts == [1, 2, 4]
        spans = runner.decode.spans
        # The fit check reserved a graph for each decode span and each captured verify step.
        assert graphs == [len(spans) + verify_graph_count((1, 2, 4), spans)]
        assert len(capture.captured) == verify_graph_count((1, 2, 4), spans)
    finally:
        for m in models.values():
            m.runner.close()
