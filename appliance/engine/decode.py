"""The single-token decode step: eager, or captured once into CUDA graphs and replayed per token.

At batch 1 a Llama decode step is a few hundred small kernels (eight per block and more); launched
one by one from Python, their launch gaps are a large share of a step on a GPU that reads 8B
parameters in a few milliseconds. A CUDA graph records the launches once and replays them with one
call. That needs every shape and every device address fixed: the step reads its token and position
from one static input buffer, writes its logits into one static output buffer, and attends over a
fixed number of cache positions, selecting out those after its own (`LlamaModel.decode_static`).

A greedy request's steps are chained: each captured step also writes its argmax and the next
position back into its input buffer, so the next step can be queued on the device before the host
has read this step's token (`DecodeStep.launch`). The device then never waits for the host between
tokens as long as the host takes less than a step to read a token and queue the next one; the price
is one step computed in vain when a token turns out to be the end id.

The attention span is not one fixed length: a step attends over the smallest of a few "spans"
(powers of two from 256 up to the cache size) that covers its position, each captured as its own
graph at start-up, so a short request does not read a 128k-token cache every step.

`torch.cuda.CUDAGraph` is used directly rather than `torch.compile(mode="reduce-overhead")`: the
eager kernels are replayed as they are (no compile step at start-up, which takes minutes for an 8B
model, and no recompilation when a shape changes), the capture is one small function the CPU tests
can drive with a fake (`Capture`). Short prefills are captured the same way
(`appliance.engine.prefill`), and so are speculative decoding's verify steps
(`appliance.engine.verify`); longer prefills stay plain eager torch. What compile would
add, fusing the small elementwise kernels (norms, RoPE, SiLU), moves far fewer bytes than the
weight reads that bound a batch-1 step.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch

from appliance.engine.llama import KVCache, LlamaModel

if TYPE_CHECKING:
    from appliance.engine.prefill import GraphPrefill
    from appliance.engine.verify import GraphVerify

__all__ = [
    "Capture",
    "DecodeStep",
    "EagerDecode",
    "GraphDecode",
    "cuda_graph_capture",
    "decode_and_choose",
    "decode_spans",
    "read_later",
]

# The shortest attention span captured; shorter contexts attend (masked) over this many positions.
SMALLEST_SPAN = 256
# Runs of the step before capture: cuBLAS and the caching allocator set themselves up on first use,
# which must not happen inside a capture.
WARMUP_RUNS = 2

# Turns a step body into its replay: the real one captures a CUDA graph, a test's may just record.
Capture = Callable[[Callable[[], None]], Callable[[], None]]


class DecodeStep(Protocol):
    """A request's forward passes on one preallocated cache: prefill chunks and decode steps."""

    cache: KVCache

    def prefill(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Logits (vocab,) float32 of the last of `token_ids` at positions start..; positions
        before start must be in the cache. Valid until the next call."""
        ...

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        """Logits (vocab,) float32 of `token` at `pos`; valid until the next call."""
        ...

    def rows(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Logits (n, vocab) float32 of every one of `token_ids` at positions start.. (a verify
        step of speculative decoding); valid until the next call."""
        ...

    def launch(self, pos: int, token: int | None = None) -> Callable[[], int]:
        """Queues the step of `token` at `pos`, or, when None, of the token the previous launch
        chose (at the position after it); returns a read of this step's greedy choice (the
        argmax of its logits), which waits for the step. A later launch may be queued before
        the read: it runs after this step."""
        ...


class EagerDecode:
    """The step launched call by call, no graph: on the model's fused Triton kernels when it runs
    them (over the smallest span above the position, as a captured step does, so the kernels are
    compiled once per span), else as plain torch calls attending over exactly the positions
    written so far."""

    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self._chosen = 0  # the last launch's choice
        self._spans: list[int] = []
        if model.kernels == "triton":
            self._spans = decode_spans(cache.max_seq_len)
            self._step_in = torch.zeros(2, dtype=torch.long, device=model.device)
            self._logits = torch.empty(
                model.config.vocab_size, dtype=torch.float32, device=model.device
            )

    def prefill(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        return self.model.forward(token_ids, self.cache, start)

    def rows(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        return self.model.forward_rows(token_ids, self.cache, start)

    def launch(self, pos: int, token: int | None = None) -> Callable[[], int]:
        """Runs the step now (an eager step has nothing to overlap with)."""
        logits = self(self._chosen if token is None else token, pos)
        chosen = self._chosen = int(torch.argmax(logits).item())
        return lambda: chosen

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        if not self._spans:
            return self.model.forward((token,), self.cache, pos)
        if not 0 <= pos < self.cache.max_seq_len:
            raise ValueError(f"position {pos} is outside the cache of {self.cache.max_seq_len}")
        if not 0 <= token < self.model.config.vocab_size:
            raise ValueError(
                f"token id must be in [0, {self.model.config.vocab_size}), got {token}"
            )
        span = self._spans[bisect.bisect_right(self._spans, pos)]
        with torch.inference_mode():
            self._step_in.copy_(torch.tensor((token, pos), dtype=torch.long))
            self.model.decode_static(self._step_in, self.cache, span, self._logits)
        return self._logits


def parse_counts(text: str, off: str, unit: str) -> tuple[int, ...] | None:
    """A command-line list of the sizes to capture graphs of: comma-separated `unit`s, sorted and
    without repeats; None for the word `off` (or nothing). ValueError says what was expected."""
    if text.strip().lower() in ("", off):
        return None
    try:
        return tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise ValueError(f"expected comma-separated {unit} or {off}, got {text!r}") from None


def decode_spans(max_seq_len: int, smallest: int = SMALLEST_SPAN) -> list[int]:
    """Attention spans to capture: smallest, 2x, 4x ... below max_seq_len, then max_seq_len."""
    spans = []
    span = smallest
    while span < max_seq_len:
        spans.append(span)
        span *= 2
    spans.append(max_seq_len)
    return spans


class GraphDecode:
    """The fixed-shape step, captured once per attention span and replayed per token.

    The contract with a capture: `step_in` (token, position) and `logits` are allocated once here
    and never reallocated; each call copies its inputs into `step_in`, replays the graph of the
    smallest span above the position, and returns `logits`, which the graph wrote.
    """

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        capture: Capture,
        smallest_span: int = SMALLEST_SPAN,
        prefill: GraphPrefill | None = None,
        verify: GraphVerify | None = None,
    ) -> None:
        """`prefill` (captured on the same cache) serves the prefills it has a bucket for; the
        others, and all of them without it, run eager. `verify` (likewise) serves the verify
        steps of speculative decoding it has a graph for."""
        if prefill is not None and prefill.cache is not cache:
            raise ValueError("the captured prefill must run on the decode step's cache")
        if verify is not None and verify.cache is not cache:
            raise ValueError("the captured verify step must run on the decode step's cache")
        self.model = model
        self.cache = cache
        self.graph_prefill = prefill
        self.graph_verify = verify
        device = model.device
        self.step_in = torch.zeros(2, dtype=torch.long, device=device)
        self.logits = torch.empty(model.config.vocab_size, dtype=torch.float32, device=device)
        self.spans = decode_spans(cache.max_seq_len, smallest_span)
        started = time.perf_counter()
        with torch.inference_mode():
            self._replays = [
                capture(partial(decode_and_choose, model, self.step_in, cache, span, self.logits))
                for span in self.spans
            ]
        self.capture_seconds = time.perf_counter() - started

    def prefill(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        if self.graph_prefill is not None:
            logits = self.graph_prefill(token_ids, start)
            if logits is not None:
                return logits
        return self.model.forward(token_ids, self.cache, start)

    def rows(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        if self.graph_verify is not None:
            logits = self.graph_verify(token_ids, start)
            if logits is not None:
                return logits
        return self.model.forward_rows(token_ids, self.cache, start)

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        self._replay(pos, token)
        return self.logits

    def launch(self, pos: int, token: int | None = None) -> Callable[[], int]:
        self._replay(pos, token)
        with torch.inference_mode():
            return read_later(self.step_in[:1])

    def _replay(self, pos: int, token: int | None) -> None:
        """Replays the step of `pos` on `token`, copied into `step_in` first, or when None on the
        token `step_in` holds (the previous step's choice)."""
        if not 0 <= pos < self.cache.max_seq_len:
            raise ValueError(f"position {pos} is outside the cache of {self.cache.max_seq_len}")
        with torch.inference_mode():
            if token is not None:
                self.step_in.copy_(torch.tensor((token, pos), dtype=torch.long))
            self.replay_for(pos)()

    def replay_for(self, pos: int) -> Callable[[], None]:
        """The captured step of the smallest span above `pos` (it reads `step_in` when replayed)."""
        return self._replays[bisect.bisect_right(self.spans, pos)]


def decode_and_choose(
    model: LlamaModel, step_in: torch.Tensor, cache: KVCache, span: int, logits: torch.Tensor
) -> None:
    """`LlamaModel.decode_static`, then its greedy choice written back as the next step's input:
    `step_in` becomes (argmax of the logits, position + 1). A step whose token is chosen on the
    host overwrites both before it runs."""
    model.decode_static(step_in, cache, span, logits)
    torch.argmax(logits, dim=0, keepdim=True, out=step_in[:1])
    step_in[1:].add_(1)


def read_later(value: torch.Tensor) -> Callable[[], int]:
    """A read of the one-element `value` as the work queued so far leaves it. On a GPU the copy
    to the host is queued now (into pinned memory, behind that work) and waited for at the read,
    so work queued after this call does not delay the read; elsewhere it is read now."""
    if value.device.type != "cuda":
        now = int(value.item())
        return lambda: now
    host = value.to("cpu", non_blocking=True)
    copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
    copied.record(torch.cuda.current_stream(value.device))

    def read() -> int:
        copied.synchronize()
        return int(host.item())

    return read


def cuda_graph_capture(device: torch.device) -> Capture:
    """A `Capture` recording CUDA graphs on `device`, all drawing on one memory pool.

    Sharing the pool is safe because no graph leaves a live tensor in it: inputs and outputs are
    allocated outside, and only one graph replays at a time (the runner's compute thread).
    """
    with torch.cuda.device(device):
        pool = torch.cuda.graph_pool_handle()

    def capture(body: Callable[[], None]) -> Callable[[], None]:
        # The capture stream and the graph belong to the current device: make it the model's.
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    body()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                body()
            torch.cuda.synchronize(device)
        replay: Callable[[], None] = graph.replay
        return replay

    return capture
