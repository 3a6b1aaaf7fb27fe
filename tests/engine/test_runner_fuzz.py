"""Random request sequences through real runners: KV-cache reuse (with a pool small enough to
evict), cancellation mid-generation and speculative decoding never change a greedy answer, its
log-probabilities or its alternatives, compared with a runner that computes every request afresh.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.engine.llama import LlamaModel
from appliance.engine.prefix_cache import PrefixCache
from appliance.engine.runner import Emission, Job, Runner
from appliance.engine.sampling import SamplingParams
from appliance.engine.speculative import NgramSpeculation, OffSwitch

B = 4
SEQ = 64  # the micro model's context
GREEDY = SamplingParams(top_k=1)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    n: int
    cancel_after: int | None  # cancel once this many tokens were emitted
    scored: bool  # log-probabilities and 3 alternatives
    end_id: int | None
    streaming: bool = True
    min_tokens: int = 0


@dataclass
class Result:
    tokens: list[int]
    log_probs: list[float] | None
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    errors: list[str]
    finals: int


def run(runner: Runner, req: Request) -> Result:
    done = threading.Event()
    out: list[Emission] = []
    job: Job

    def emit(e: Emission) -> None:
        out.append(e)
        emitted = sum(len(x.tokens or []) for x in out)
        if req.cancel_after is not None and emitted >= req.cancel_after:
            job.cancel.set()
        if e.final:
            done.set()

    job = Job(
        "fuzz",
        req.prompt,
        req.n,
        req.end_id,
        GREEDY,
        streaming=req.streaming,
        emit=emit,
        return_log_probs=req.scored,
        top_logprobs=3 if req.scored else 0,
        min_tokens=req.min_tokens,
    )
    if req.cancel_after == 0:
        job.cancel.set()
    runner.submit(job)
    assert done.wait(120)
    with runner.stats.changed:  # the pool is written after the final response
        runner.stats.changed.wait_for(lambda: runner.stats.running is None, timeout=120)
    tokens = [t for e in out for t in (e.tokens or [])]
    last = out[-1]
    top = [e.top_logprobs for e in out if e.top_logprobs is not None]
    return Result(
        tokens,
        last.log_probs,
        [ids for t in top for ids in t.ids],
        [lp for t in top for lp in t.logprobs],
        [e.error for e in out if e.error],
        sum(e.final for e in out),
    )


@dataclass
class Runners:
    plain: Runner
    reuse: Runner
    spec: Runner  # reuse, prompt-lookup speculation that never switches off, chunked prefills
    graphs: Runner  # as spec, on the fixed-shape steps a CUDA graph captures, replayed eagerly


@pytest.fixture(scope="module")
def runners(micro_model: LlamaModel) -> Iterator[Runners]:
    def pool(blocks: int) -> PrefixCache:
        m = micro_model
        return PrefixCache(m.config, blocks, B, "fp", m.device, m.dtype)

    spec = NgramSpeculation(3, 2, OffSwitch(min_accepted=0.0))
    r = Runners(
        Runner(micro_model, SEQ, B),
        Runner(micro_model, SEQ, B, prefix=pool(6)),
        Runner(micro_model, SEQ, B, prefix=pool(9), speculation=spec),
        Runner(
            micro_model,
            SEQ,
            B,
            prefix=pool(9),
            capture=lambda body: body,
            prefill_buckets=(1, 4, 16),
            speculation=spec,
            verify_counts=(1, 3),
        ),
    )
    # Prompts in chunks whose boundaries fall anywhere relative to the blocks and a reused prefix.
    r.spec.prefill_chunk, r.graphs.prefill_chunk = 5, 7
    yield r
    for runner in (r.plain, r.reuse, r.spec, r.graphs):
        runner.close()


@st.composite
def requests(draw: st.DrawFn) -> list[Request]:
    """Prompts sharing prefixes of random lengths with earlier ones; one-token and repeated-token
    prompts, whose greedy answers recompute blocks an earlier answer pooled."""
    texts: list[list[int]] = [[5], [7, 7, 7, 7, 7, 7, 7, 7]]
    out: list[Request] = []
    for _ in range(draw(st.integers(2, 6))):
        base = draw(st.sampled_from(texts))
        keep = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(3, 96), min_size=0 if keep else 1, max_size=20))
        prompt = (base[:keep] + tail)[: SEQ - 1] or [9]
        n = draw(st.integers(1, SEQ - len(prompt)))
        cancel = draw(st.one_of(st.none(), st.integers(0, n)))
        end_id = draw(st.one_of(st.none(), st.integers(0, 96)))
        streaming = draw(st.booleans())
        if not streaming and cancel:  # a non-streaming request is cancelled before it starts
            cancel = 0
        min_tokens = draw(st.integers(0, n + 1))
        scored = draw(st.booleans())
        out.append(Request(prompt, n, cancel, scored, end_id, streaming, min_tokens))
        texts.append(prompt)
    return out


def check(got: Result, want: Result, req: Request) -> None:
    assert got.errors == [] and got.finals == 1
    if req.cancel_after is None:
        assert got.tokens == want.tokens
    else:
        assert len(got.tokens) <= req.cancel_after
        assert got.tokens == want.tokens[: len(got.tokens)]
    if req.scored and got.tokens:
        assert got.log_probs is not None and want.log_probs is not None
        k = len(got.tokens)
        torch.testing.assert_close(got.log_probs, want.log_probs[:k], rtol=0, atol=1e-4)
        assert got.top_ids == want.top_ids[:k]
        torch.testing.assert_close(got.top_logprobs, want.top_logprobs[:k], rtol=0, atol=1e-4)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seq=requests())
def test_reuse_cancellation_and_speculation_keep_the_answer(
    runners: Runners, seq: list[Request]
) -> None:
    for req in seq:
        full = Request(req.prompt, req.n, None, req.scored, req.end_id, True, req.min_tokens)
        want = run(runners.plain, full)
        for runner in (runners.reuse, runners.spec, runners.graphs):
            got = run(runner, req)
            check(got, want, req)
            if req.cancel_after is not None and got.tokens == want.tokens[: req.cancel_after]:
                # The cancelled request's prompt again, now to the end.
                check(run(runner, full), want, full)


@pytest.mark.parametrize("n", [1, 2])
def test_prompt_one_short_of_the_cache(runners: Runners, n: int) -> None:
    req = Request([(7 * i) % 90 + 3 for i in range(SEQ - n)], n, None, True, None)
    want = run(runners.plain, req)
    assert len(want.tokens) == n
    for runner in (runners.reuse, runners.spec, runners.graphs):
        check(run(runner, req), want, req)
        check(run(runner, req), want, req)  # its prompt reused, all but the last token


def test_end_id_as_the_first_token_then_its_prompt_again(runners: Runners) -> None:
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    want = run(runners.plain, Request(prompt, 6, None, True, None))
    first = want.tokens[0]
    for runner in (runners.reuse, runners.spec, runners.graphs):
        for streaming in (True, False):
            ended = run(runner, Request(prompt, 6, None, True, first, streaming))
            assert (ended.tokens, ended.errors, ended.finals) == ([], [], 1)
        # The prompt's blocks were stored by the request that ended at once.
        check(
            run(runner, Request(prompt, 6, None, True, None)),
            want,
            Request(prompt, 6, None, True, None),
        )
