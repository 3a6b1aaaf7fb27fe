"""Runs generation jobs one at a time on a compute thread, like a batch-1 TensorRT-LLM executor.

The gRPC side lives on an asyncio loop; compute runs on its own thread so a forward pass never blocks
the loop. Each job reports back through a callback that the server makes thread-safe. Cancellation is a
flag the generation loop polls before every step, so a cancelled job stops within one forward pass.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from appliance.engine.llama import LlamaModel
from appliance.engine.sampling import SamplingParams, generate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Emission:
    """One response's worth of output. `tokens is None` is a flag-only (null) final response."""

    tokens: list[int] | None
    final: bool
    error: str | None = None


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


@dataclass
class EngineStats:
    """What tests and ModelStatistics read: counts only move forward."""

    started: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    tokens_generated: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    running: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)


class Runner:
    """A single compute thread serving jobs in arrival order."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.stats = EngineStats()
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="engine-compute", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancel.is_set():
                self._count(cancelled=1)
                job.emit(Emission(None, final=True))
                continue
            started = time.monotonic()
            with self.stats.lock:
                self.stats.started += 1
                self.stats.running = job.request_id
                self.stats.queue_ns += int((started - job.enqueued) * 1e9)
            try:
                self._run(job)
            except Exception as exc:  # a failed request must not take the engine down
                log.exception("request %s failed", job.request_id)
                self._count(failed=1)
                job.emit(Emission(None, final=True, error=f"engine failure: {exc}"))
            finally:
                with self.stats.changed:
                    self.stats.running = None
                    self.stats.compute_ns += int((time.monotonic() - started) * 1e9)
                    self.stats.changed.notify_all()

    def _run(self, job: Job) -> None:
        tokens = generate(
            self.model,
            job.prompt_ids,
            job.max_new_tokens,
            job.end_id,
            job.params,
            should_stop=job.cancel.is_set,
        )
        produced: list[int] = []
        for token in tokens:
            produced.append(token)
            with self.stats.lock:
                self.stats.tokens_generated += 1
            if job.streaming:
                last = len(produced) == job.max_new_tokens
                if last:  # counted before the final response leaves, so statistics never lag it
                    self._count(completed=1)
                job.emit(Emission([token], final=last))
                if last:
                    return
        if job.cancel.is_set():
            self._count(cancelled=1)
            job.emit(Emission(None, final=True))
            return
        self._count(completed=1)
        if not job.streaming:
            job.emit(Emission(produced, final=True))
        else:
            # Ended by the end id: a final response with no new tokens (not a null response).
            job.emit(Emission([], final=True))

    def _count(self, completed: int = 0, cancelled: int = 0, failed: int = 0) -> None:
        with self.stats.changed:
            self.stats.completed += completed
            self.stats.cancelled += cancelled
            self.stats.failed += failed
            self.stats.changed.notify_all()
