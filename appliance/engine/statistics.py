"""Per-model inference statistics with Triton's breakdown, for the ModelStatistics RPC.

Triton counts a request when the backend reports it, at its end: the tensorrtllm backend calls
``TRITONBACKEND_ModelInstanceReportStatistics`` (and the batch variant, batch size 1) once the
final response of a request has been sent, with four timestamps: ``exec_start`` (the backend
takes the request), ``compute_start`` (enqueued at the executor), ``compute_end`` (the final
result is back) and ``exec_end``. Triton turns them into queue = exec_start - arrival,
compute_input = compute_start - exec_start, compute_infer = compute_end - compute_start (the
executor's own queue, prefill and decode), compute_output = exec_end - compute_end, and success
(or fail) = exec_end - arrival. A request that ends with an error is a failure; a stopped or
cancelled one ends with a final result and is a success.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from tritonclient.grpc import service_pb2 as ts


@dataclass
class RequestClock:
    """The timestamps of one request, in ``time.monotonic_ns()``."""

    arrival: int = field(default_factory=time.monotonic_ns)
    exec_start: int = 0
    compute_start: int = 0
    compute_end: int = 0

    def taken(self) -> None:
        """The request is valid and about to be enqueued."""
        self.exec_start = time.monotonic_ns()

    def enqueued(self) -> None:
        self.compute_start = time.monotonic_ns()

    def computed(self) -> None:
        self.compute_end = time.monotonic_ns()


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += max(0, ns)

    def write(self, out: ts.StatisticDuration) -> None:
        out.count = self.count
        out.ns = self.ns


@dataclass
class ModelStatistics:
    """What Triton's ModelStatistics reports for one model version; updated from any thread."""

    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)
    # The batch statistics (batch size 1): every request reported, failed ones too.
    batch_input: _Duration = field(default_factory=_Duration)
    batch_infer: _Duration = field(default_factory=_Duration)
    batch_output: _Duration = field(default_factory=_Duration)
    last_inference_ms: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def finished(self, clock: RequestClock, ok: bool) -> None:
        """Report one request whose final response has just been sent."""
        end = time.monotonic_ns()
        # Steps a request never reached (it failed before) take no time.
        exec_start = clock.exec_start or end
        compute_start = clock.compute_start or exec_start
        compute_end = clock.compute_end or compute_start
        with self.lock:
            self.last_inference_ms = time.time_ns() // 1_000_000
            # The backend reports the batch (TRITONBACKEND_ModelInstanceReportBatchStatistics)
            # whether the request failed or not.
            self.batch_input.add(compute_start - exec_start)
            self.batch_infer.add(compute_end - compute_start)
            self.batch_output.add(end - compute_end)
            if not ok:
                self.fail.add(end - clock.arrival)
                return
            self.success.add(end - clock.arrival)
            self.queue.add(exec_start - clock.arrival)
            self.compute_input.add(compute_start - exec_start)
            self.compute_infer.add(compute_end - compute_start)
            self.compute_output.add(end - compute_end)

    @property
    def inference_count(self) -> int:
        """Triton's inference count: the successful requests, batch size 1 each."""
        return self.success.count

    @property
    def execution_count(self) -> int:
        """Triton's execution count: every request that ended, as the TensorRT-LLM backend
        reports batch statistics for failed ones too."""
        return self.success.count + self.fail.count

    def write(self, out: ts.ModelStatistics) -> None:
        with self.lock:
            out.inference_count = self.inference_count
            out.execution_count = self.execution_count
            out.last_inference = self.last_inference_ms
            stats = out.inference_stats
            self.success.write(stats.success)
            self.fail.write(stats.fail)
            self.queue.write(stats.queue)
            self.compute_input.write(stats.compute_input)
            self.compute_infer.write(stats.compute_infer)
            self.compute_output.write(stats.compute_output)
            if self.batch_infer.count:
                # Every execution is one request (batch size 1).
                batch = out.batch_stats.add(batch_size=1)
                self.batch_input.write(batch.compute_input)
                self.batch_infer.write(batch.compute_infer)
                self.batch_output.write(batch.compute_output)
