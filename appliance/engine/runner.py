"""Runs generation jobs one at a time on a compute thread, like a batch-1 TensorRT-LLM executor.

The gRPC side lives on an asyncio loop; compute runs on its own thread so a forward pass never blocks
the loop. Each job reports back through a callback that the server makes thread-safe. Cancellation is a
flag the generation loop polls before every step, so a cancelled job stops within one forward pass.

Nothing is allocated per request: the runner owns one KV cache sized to the repository's
`max_seq_len`, which every job overwrites, and (with `enable_kv_cache_reuse`) a pool of finished
requests' blocks from which a job's matching prefix is copied in instead of recomputed. With a
`Capture` (CUDA graphs on a GPU), the decode step, short prefills and speculative decoding's verify
steps are captured once on that cache at start-up.

Prompts are prefilled in chunks of `prefill_chunk_tokens`, and cancellation is checked between
chunks, so stopping the engine (or a cancelled request) waits for at most one chunk's forward pass.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from appliance.engine import fused
from appliance.engine.decode import Capture, DecodeStep, EagerDecode, GraphDecode, decode_spans
from appliance.engine.device import enter_device
from appliance.engine.guided import CompiledGuide, GuideOverrun
from appliance.engine.llama import LlamaConfig, LlamaModel
from appliance.engine.prefill import PREFILL_BUCKETS, GraphPrefill
from appliance.engine.prefix_cache import KvCacheStats, PrefixCache, RequestKvStats, pool_blocks
from appliance.engine.repository import KvCacheParams
from appliance.engine.sampling import SamplingParams, TopLogprobs, generate
from appliance.engine.speculative import Drafter, SpecCounts
from appliance.engine.verify import GraphVerify
from engine_build.kv_blocks import DEFAULT_TOKENS_PER_BLOCK

log = logging.getLogger(__name__)

# How long `Runner.close` waits for the running step to finish before giving up on the thread.
CLOSE_TIMEOUT_S = 30.0


def prefill_chunk_tokens(device: torch.device) -> int:
    """Most prompt tokens in one forward pass on `device`.

    On a GPU, 2,048 (TensorRT-LLM's default max_num_tokens for a build here) keeps a prefill
    compute-bound while bounding its activations; on a CPU a 256-token chunk is already an efficient
    matrix product and takes about a second on a busy core, which bounds how long a cancellation or a
    shutdown waits.
    """
    return 2048 if device.type == "cuda" else 256


@dataclass(frozen=True)
class RequestPerf:
    """What TensorRT-LLM's `RequestPerfMetrics` holds for a request so far (`return_perf_metrics`).

    Times are CLOCK_MONOTONIC nanoseconds, the clock of the executor's steady_clock time points.
    """

    kv: RequestKvStats
    arrival_ns: int
    first_scheduled_ns: int
    first_token_ns: int
    last_token_ns: int
    # Speculative decoding so far: draft tokens proposed to verify steps, and those accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(frozen=True)
class Emission:
    """One response's worth of output. `tokens is None` is a flag-only (null) final response."""

    tokens: list[int] | None
    final: bool
    error: str | None = None
    perf: RequestPerf | None = None
    # The log-probabilities of every token generated so far (return_log_probs), as TensorRT-LLM's
    # executor returns them with each streamed result.
    log_probs: list[float] | None = None
    # The most likely alternatives of this response's tokens only (not every token so far).
    top_logprobs: TopLogprobs | None = None


@dataclass(eq=False)  # identity: jobs live in sets and are compared by who they are
class Job:
    request_id: str
    prompt_ids: Sequence[int]
    max_new_tokens: int
    end_id: int | None
    params: SamplingParams
    streaming: bool
    emit: Callable[[Emission], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)
    return_perf: bool = False
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    guide: CompiledGuide | None = None
    min_tokens: int = 0
    return_log_probs: bool = False
    # False: this request decodes without drafts whatever the runner's drafter.
    speculate: bool = True
    # Alternatives returned per generated token (0: none).
    top_logprobs: int = 0


def _watch_final(job: Job) -> threading.Event:
    """Set once the job's final response is emitted: a fault after it is no failure of the
    request, which has its answer (a second final would be dropped, and counted twice)."""
    answered = threading.Event()
    emit = job.emit

    def emitting(e: Emission) -> None:
        if e.final:
            answered.set()
        emit(e)

    job.emit = emitting
    return answered


@dataclass
class EngineStats:
    """What tests and ModelStatistics read: counts only move forward."""

    started: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    tokens_generated: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    spec_switched_off: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    running: str | None = None
    kv: KvCacheStats = field(default_factory=KvCacheStats)
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)


class Runner:
    """A single compute thread serving jobs in arrival order."""

    def __init__(
        self,
        model: LlamaModel,
        max_seq_len: int | None = None,
        tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK,
        prefix: PrefixCache | None = None,
        capture: Capture | None = None,
        prefill_buckets: Sequence[int] = PREFILL_BUCKETS,
        speculation: Drafter | None = None,
        verify_counts: Sequence[int] = (),
    ) -> None:
        """`max_seq_len` sizes the one working KV cache (default: the model's context); `capture`
        (None: all eager) captures the decode step, and a prefill of each of `prefill_buckets`
        lengths (none when empty), on it before the compute thread starts. `speculation` runs
        speculative decoding with that drafter; with a captured step, its verify step is captured
        for each of `verify_counts` draft counts (`appliance.engine.verify`), and without any
        speculation is off."""
        self.model = model
        self.cache = model.new_cache(max_seq_len or model.config.max_position_embeddings)
        self.decode: DecodeStep = EagerDecode(model, self.cache)
        self.speculation = speculation
        if capture is not None and speculation is not None and not verify_counts:
            log.warning("no verify step is captured: speculative decoding is off with CUDA graphs")
            self.speculation = None
        if capture is not None:
            spans = decode_spans(self.cache.max_seq_len)
            prefill = (
                GraphPrefill(model, self.cache, capture, prefill_buckets, spans)
                if prefill_buckets
                else None
            )
            verify = (
                GraphVerify(model, self.cache, capture, verify_counts, spans)
                if self.speculation is not None
                else None
            )
            self.decode = GraphDecode(model, self.cache, capture, prefill=prefill, verify=verify)
            self._warm_long_prefill()
        self.prefill_chunk = prefill_chunk_tokens(model.device)
        self.prefix = prefix
        self.tokens_per_block = prefix.tokens_per_block if prefix else tokens_per_block
        # The compute thread's own counters; EngineStats.kv is a copy published under the lock.
        self._kv = prefix.stats if prefix else KvCacheStats(tokens_per_block=self.tokens_per_block)
        self.stats = EngineStats(kv=dataclasses.replace(self._kv))
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._current: Job | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="engine-compute", daemon=True)
        self._thread.start()

    def _warm_long_prefill(self) -> None:
        """Runs one prefill longer than the captured steps' rows on the working cache, so the
        kernels only a long prefill launches (`fused.prefill`) are compiled now, not at the first
        long prompt (on a GPU, Triton also builds each one's C launcher). Its K/V are overwritten
        by the first request, as every request overwrites a position before reading it."""
        tokens = fused.FUSED_ROWS + 1
        if self.model.kernels == "triton" and tokens <= self.cache.max_seq_len:
            self.model.forward([0] * tokens, self.cache, 0)

    def submit(self, job: Job) -> None:
        if self._closed:
            job.cancel.set()
        self._jobs.put(job)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Cancel the running and queued jobs and join the compute thread; True if it ended.

        The process must not exit while this thread is inside torch: interpreter shutdown would
        tear down what torch's native threads still use, and the C++ runtime aborts
        ("terminate called without an active exception"). A cancelled job stops after its
        current forward pass (one prefill chunk or one decode step).
        """
        self._closed = True
        current = self._current
        if current is not None:
            current.cancel.set()
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the compute thread did not stop within %.0f s", timeout)
            return False
        return True

    def _loop(self) -> None:
        enter_device(self.model.device)  # the current CUDA device is per thread
        while (job := self._jobs.get()) is not None:
            if self._closed:
                job.cancel.set()
            if job.cancel.is_set():
                self._count(cancelled=1)
                job.emit(Emission(None, final=True))
                continue
            started = time.monotonic()
            with self.stats.changed:  # a waiter may wait for a request to start running
                self.stats.started += 1
                self.stats.running = job.request_id
                self.stats.queue_ns += int((started - job.enqueued) * 1e9)
                self.stats.changed.notify_all()
            self._current = job
            if self._closed:  # close() may have looked before this job became current
                job.cancel.set()
            answered = _watch_final(job)
            try:
                self._run(job)
            except GuideOverrun as exc:  # the request's guide, not a fault of this server
                log.warning("request %s ended: %s", job.request_id, exc)
                self._count(failed=1)
                job.emit(Emission(None, final=True, error=str(exc)))
            except Exception as exc:  # a failed request must not take the engine down
                if answered.is_set():  # its bookkeeping after the final response failed
                    log.exception("request %s: after its final response", job.request_id)
                else:
                    log.exception("request %s failed", job.request_id)
                    self._count(failed=1)
                    job.emit(Emission(None, final=True, error=f"engine failure: {exc}"))
            finally:
                self._current = None
                with self.stats.changed:
                    self.stats.running = None
                    self.stats.compute_ns += int((time.monotonic() - started) * 1e9)
                    self.stats.changed.notify_all()

    def _reuse(self, prompt: Sequence[int]) -> RequestKvStats:
        """Copy the longest pooled prefix of `prompt` into the working cache; say how much."""
        b = self.tokens_per_block
        prompt_blocks = -(-len(prompt) // b)
        if self.prefix is None:
            return RequestKvStats(total_blocks=prompt_blocks)
        slots = self.prefix.match(prompt)
        # The last prompt token is always recomputed: its forward pass yields the first logits.
        reused_tokens = min(len(slots) * b, len(prompt) - 1)
        reused_blocks = -(-reused_tokens // b)
        self.prefix.load(slots[:reused_blocks], self.cache)
        return RequestKvStats(prompt_blocks, reused_blocks, reused_tokens)

    def _run(self, job: Job) -> None:
        scheduled_ns = time.monotonic_ns()
        kv = self._reuse(job.prompt_ids)
        history: list[int] = []
        log_probs: list[float] | None = [] if job.return_log_probs else None
        top = TopLogprobs(job.top_logprobs) if job.top_logprobs > 0 else None
        spec = SpecCounts()
        published = SpecCounts()
        tokens = generate(
            self.model,
            job.prompt_ids,
            job.max_new_tokens,
            job.end_id,
            job.params,
            should_stop=job.cancel.is_set,
            cache=self.cache,
            start_pos=kv.reused_tokens,
            history=history,
            decode=self.decode,
            prefill_chunk=self.prefill_chunk,
            guide=job.guide,
            min_tokens=job.min_tokens,
            logprobs=log_probs,
            speculation=self.speculation if job.speculate else None,
            spec_counts=spec,
            top_logprobs=top,
        )
        produced: list[int] = []
        first_token_ns = 0

        def perf() -> RequestPerf | None:
            if not job.return_perf:
                return None
            now = time.monotonic_ns()
            # The KV blocks as counted when the sequence was added to the cache: the same on
            # every response, as TensorRT-LLM counts them only then.
            return RequestPerf(
                kv,
                job.arrival_ns,
                scheduled_ns,
                first_token_ns or now,
                now,
                spec.proposed,
                spec.accepted,
            )

        finished = False
        for token in tokens:
            produced.append(token)
            first_token_ns = first_token_ns or time.monotonic_ns()
            published = self._publish(spec, published, tokens=1)
            if job.streaming:
                finished = len(produced) == job.max_new_tokens
                if finished:  # counted before the final response leaves, so statistics never lag it
                    self._count(completed=1)
                job.emit(
                    Emission([token], finished, None, perf(), _copy(log_probs), _since(top, -1))
                )
                if finished:
                    break
        # A verify step whose first accepted token is the end id yields nothing: its counts are
        # published here, before the final response that reports them.
        self._publish(spec, published)
        cancelled = not finished and job.cancel.is_set()
        if not finished:
            # Ended by the end id, or cancelled: the executor's final result either way, holding
            # every token generated so far (non-streaming) or none not yet sent (streaming; not a
            # null response).
            if cancelled:
                self._count(cancelled=1)
            else:
                self._count(completed=1)
            if not job.streaming:
                job.emit(Emission(produced, True, None, perf(), _copy(log_probs), _since(top, 0)))
            else:
                job.emit(
                    Emission([], True, None, perf(), _copy(log_probs), _since(top, len(produced)))
                )
        self._account(job, kv, produced, None if cancelled else history)

    def _publish(self, spec: SpecCounts, published: SpecCounts, tokens: int = 0) -> SpecCounts:
        """Adds `tokens` and the speculation counts since `published` to the engine's counters;
        returns the counts now published."""
        with self.stats.lock:
            self.stats.tokens_generated += tokens
            self.stats.spec_draft_tokens += spec.proposed - published.proposed
            self.stats.spec_accepted_tokens += spec.accepted - published.accepted
            self.stats.spec_verify_steps += spec.verify_steps - published.verify_steps
            self.stats.spec_switched_off += spec.switched_off - published.switched_off
        return dataclasses.replace(spec)

    def _account(
        self, job: Job, kv: RequestKvStats, produced: list[int], history: list[int] | None
    ) -> None:
        """After the final response: pool a finished request's blocks, publish the counters.

        `history` is None for a cancelled request, which stores nothing.
        """
        b = self.tokens_per_block
        total = -(-(len(job.prompt_ids) + len(produced)) // b)
        self._kv.record(dataclasses.replace(kv, total_blocks=total), -(-len(job.prompt_ids) // b))
        if self.prefix is not None and history is not None:
            self.prefix.store(history, self.cache)
        with self.stats.lock:
            self.stats.kv = dataclasses.replace(self._kv)

    def _count(self, completed: int = 0, cancelled: int = 0, failed: int = 0) -> None:
        with self.stats.changed:
            self.stats.completed += completed
            self.stats.cancelled += cancelled
            self.stats.failed += failed
            self.stats.changed.notify_all()


def _copy(values: list[float] | None) -> list[float] | None:
    return None if values is None else values[:]


def _since(top: TopLogprobs | None, start: int) -> TopLogprobs | None:
    """The alternatives of the tokens from `start` on (negative: counted from the end)."""
    return None if top is None else top.since(start)


def working_seq_len(config: LlamaConfig, params: KvCacheParams) -> int:
    """Tokens of the one working cache: the repository's limit (what an engine was built for),
    within the checkpoint's context."""
    limit = config.max_position_embeddings
    return min(params.max_seq_len or limit, limit)


def build_runner(
    model: LlamaModel,
    params: KvCacheParams,
    fingerprint: str,
    capture: Capture | None = None,
    prefill_buckets: Sequence[int] = PREFILL_BUCKETS,
    speculation: Drafter | None = None,
    verify_counts: Sequence[int] = (),
) -> Runner:
    """The runner a repository's KV-cache parameters ask for."""
    max_seq_len = working_seq_len(model.config, params)
    prefix = None
    if params.enable_reuse:
        blocks = pool_blocks(
            model.config,
            model.dtype,
            model.device,
            params.tokens_per_block,
            max_seq_len,
            params.max_tokens,
            params.free_mem_fraction,
        )
        if blocks:
            prefix = PrefixCache(
                model.config,
                blocks,
                params.tokens_per_block,
                fingerprint,
                model.device,
                model.dtype,
            )
            log.info("KV cache reuse: %d blocks of %d tokens", blocks, params.tokens_per_block)
        else:
            log.warning(
                "KV cache reuse is on but max_tokens_in_paged_kv_cache (%s) leaves no block "
                "beyond the running request's %d tokens: reuse is off",
                params.max_tokens,
                max_seq_len,
            )
    return Runner(
        model,
        max_seq_len,
        params.tokens_per_block,
        prefix,
        capture,
        prefill_buckets,
        speculation,
        verify_counts,
    )
