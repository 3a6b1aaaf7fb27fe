"""Client of Triton's GRPCInferenceService for the `tensorrt_llm` model, called with token ids.

Builds `ModelInferRequest` itself (tritonclient's stream helper refuses `triton_*` parameters, and
`triton_enable_empty_final_response` is what lets a stream end on a flag-only final response), streams
over `ModelStreamInfer`, and turns in-band errors into gRPC statuses. One persistent channel per model;
one request at a time per HTTP/2 stream, streams kept open between requests (stream_pool.py). With
the engine server's stream socket (stream_socket.py) the streams go there, the rest over gRPC.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import grpc
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as ts
from tritonclient.grpc import service_pb2_grpc as ts_grpc

from appliance.backends import wire
from appliance.backends.base import (
    CONTEXT_LENGTH_EXCEEDED,
    NO_ENGINE_LIMITS,
    NO_SPECULATION,
    Alternative,
    Backend,
    BackendError,
    EngineLimits,
    GenerationRequest,
    Speculation,
    Tokens,
    top_logprobs_refusal,
    unserved_refusal,
)
from appliance.backends.stream_pool import StreamPool
from appliance.backends.stream_socket import SocketStream
from appliance.logline import Throttled
from appliance.textfile import TextFileError, read_text
from engine_build.kv_blocks import DEFAULT_TOKENS_PER_BLOCK, TOKENS_PER_BLOCK_PARAMETER
from engine_build.pbtxt import (
    ACCEPTED_DRAFT_TOKENS_OUTPUT,
    DRAFT_TOKENS_OUTPUT,
    GUIDED_DECODING_INPUTS,
    KV_CACHE_REUSED_BLOCKS_OUTPUT,
    MAX_TOP_LOGPROBS,
    PERF_METRICS_INPUT,
    SPECULATION_INPUT,
    SPECULATIVE_DECODING_MODES,
    TOP_LOGPROB_IDS_OUTPUT,
    TOP_LOGPROBS_INPUT,
    TOP_LOGPROBS_OUTPUT,
)

if TYPE_CHECKING:
    from appliance.config import ModelConfig

log = logging.getLogger(__name__)
# An engine that answers for requests it was not sent on a stream does it for many.
_foreign = Throttled(log)

StreamCall: TypeAlias = (
    "grpc.aio.StreamStreamCall[ts.ModelInferRequest, ts.ModelStreamInferResponse] | SocketStream"
)

# Largest message read from the inference server, over gRPC or the stream socket.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# Reconnect quickly after the inference server restarts, instead of gRPC's default backoff of up to
# two minutes; keepalive stays off (Triton's defaults GOAWAY clients that ping idle connections).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
)
STOP_REQUEST_TIMEOUT_S = 2.0
# Streams kept open between requests (stream_pool.py): at most this many, each for this long idle.
KEPT_STREAMS = 4
KEPT_STREAM_IDLE_S = 30.0
# While waiting for the inference server at start-up, a line this often says so.
WAIT_NOTE_S = 5.0


# Words of an in-band error refusing the request's guide: the engine server's (a guide that does
# not compile, or whose masks overran their time), and xgrammar's own for a grammar or a regular
# expression that does not parse.
GUIDE_REFUSED = (
    "cannot be compiled",
    "the guide's grammar took",
    "ebnf parser error",
    "regex parsing error",
)
# In-band error texts of Triton and the TensorRT-LLM backend, first match wins.
_INBAND_CODES = (
    # A guide for a model whose config sets up no guided decoder: the request's fault, not the
    # engine's (the executor reports it as an assertion).
    ("guideddecoder is not setup", grpc.StatusCode.INVALID_ARGUMENT),
    # A guide its compiler refuses: the request's fault, never a retry.
    *((words, grpc.StatusCode.INVALID_ARGUMENT) for words in GUIDE_REFUSED),
    # The engine server's words for a guide that waited too long for a compile slot: a retry
    # later may be served, and the engine is not unwell.
    ("other guides were being compiled", grpc.StatusCode.RESOURCE_EXHAUSTED),
    # Sent on a stream that was open when the server began to stop.
    ("shutting down", grpc.StatusCode.UNAVAILABLE),
    ("cancel", grpc.StatusCode.CANCELLED),
    ("unknown model", grpc.StatusCode.UNAVAILABLE),
    ("not found", grpc.StatusCode.UNAVAILABLE),
    ("exceed", grpc.StatusCode.INVALID_ARGUMENT),
    ("invalid", grpc.StatusCode.INVALID_ARGUMENT),
    ("expected", grpc.StatusCode.INVALID_ARGUMENT),
    ("must", grpc.StatusCode.INVALID_ARGUMENT),
)


def status_for_inband_error(message: str, request_id: str) -> grpc.StatusCode:
    """The status of an in-band error, from its words; the id that starts Triton core's messages
    (`wire.log_request`) is not among them, whatever words the id holds."""
    lowered = message.removeprefix(wire.log_request(request_id)).lower()
    return next((code for key, code in _INBAND_CODES if key in lowered), grpc.StatusCode.INTERNAL)


# TensorRT-LLM's words for a prompt longer than the engine's max_input_len ("Prompt length (N)
# exceeds maximum input length (M).").
_PROMPT_TOO_LONG = "exceeds maximum input length"


def inband_error(message: str, request_id: str) -> BackendError:
    """The BackendError of an engine's in-band error message to the request with this id."""
    reason = CONTEXT_LENGTH_EXCEEDED if _PROMPT_TOO_LONG in message else None
    lowered = message.lower()
    field = "guide" if any(words in lowered for words in GUIDE_REFUSED) else None
    return BackendError(
        status_for_inband_error(message, request_id),
        f"inference server: {message}",
        reason=reason,
        field=field,
    )


# The config.pbtxt parameter naming the engine directory (the template's `${engine_dir}`).
ENGINE_DIR_PARAMETER = "gpt_model_path"
# The values of a bool parameter the tensorrtllm backend reads as true
# (ModelState::GetParameter<bool>, which neither strips nor folds case).
BACKEND_TRUE = ("True", "true", "TRUE", "1")
# Largest engine config.json read; trtllm-build writes a few KiB.
MAX_ENGINE_CONFIG_BYTES = 2**20


class _EngineConfigError(ValueError):
    """Why an engine directory's config.json gives no limits, in words for the log."""


def _positive(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _EngineConfigError(f"build_config.{key} is {value!r}, not a positive integer")
    return value


def _engine_dir_limits(engine_dir: Path, chunked_context: bool) -> EngineLimits:
    """The limits TensorRT-LLM's executor applies to an engine built by trtllm-build, from the
    `build_config` of the engine directory's config.json (Engine.save): max_seq_len, less the
    max_draft_len a request leaves room for (LlmRequest::validate); the prompt limit
    (TrtGptModelInflightBatching) max_seq_len - 1 with chunked context, min(max_seq_len - 1,
    max_num_tokens) with context FMHA on packed input, else the build's max_input_len."""
    path = engine_dir / "config.json"
    if not path.is_file():  # not there, or not a plain file (a FIFO would block the read)
        raise _EngineConfigError("not there, or not a plain file")
    try:
        raw = json.loads(read_text(path, MAX_ENGINE_CONFIG_BYTES))
    except TextFileError as exc:
        raise _EngineConfigError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise _EngineConfigError(f"not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except RecursionError:
        raise _EngineConfigError("not valid JSON (nested too deeply)") from None
    build = raw.get("build_config") if isinstance(raw, dict) else None
    if not isinstance(build, dict):
        raise _EngineConfigError("no build_config object; not an engine of trtllm-build")
    plugin = build.get("plugin_config", {})
    if not isinstance(plugin, dict):
        raise _EngineConfigError(f"build_config.plugin_config is {type(plugin).__name__}")
    max_seq = _positive(build.get("max_seq_len"), "max_seq_len")
    draft = build.get("max_draft_len") or 0
    if isinstance(draft, bool) or not isinstance(draft, int) or not 0 <= draft < max_seq - 1:
        raise _EngineConfigError(f"build_config.max_draft_len is {draft!r}")
    if chunked_context:
        max_input = max_seq - 1
    elif plugin.get("context_fmha") is True and plugin.get("remove_input_padding") is True:
        max_input = min(max_seq - 1, _positive(build.get("max_num_tokens"), "max_num_tokens"))
    else:
        max_input = _positive(build.get("max_input_len"), "max_input_len")
    return EngineLimits(max_input, max_seq - draft)


def engine_limits(params: Mapping[str, mc.ModelParameter]) -> EngineLimits:
    """The engine's limits from its config.pbtxt parameters max_input_len and max_seq_len (None
    where one is absent or not a positive number); where one is absent and gpt_model_path names
    an engine directory, from that engine's config.json (a file that cannot be used: one log
    line, and the limit stays unknown). max_input_len at most max_seq_len - 1, as the engine
    applies it."""

    def value(name: str) -> str:
        return params[name].string_value.strip() if name in params else ""

    given = [value(name) for name in ("max_input_len", "max_seq_len")]
    max_input, max_seq = (int(v) if v.isdigit() and int(v) > 0 else None for v in given)
    engine_dir = value(ENGINE_DIR_PARAMETER)
    if (max_input is None or max_seq is None) and engine_dir and not engine_dir.startswith("${"):
        try:
            engine = _engine_dir_limits(
                Path(engine_dir), value("enable_chunked_context") in BACKEND_TRUE
            )
        except _EngineConfigError as exc:
            log.warning(
                "engine config %s: %s; the engine's max_input_len and max_seq_len are unknown "
                "(set them as config.pbtxt parameters)",
                Path(engine_dir) / "config.json",
                exc,
            )
        else:
            max_input = engine.max_input_len if max_input is None else max_input
            max_seq = engine.max_seq_len if max_seq is None else max_seq
    if max_seq is not None:
        max_input = max_seq - 1 if max_input is None else min(max_input, max_seq - 1)
    return EngineLimits(max_input, max_seq)


def _tokens_per_block(params: Mapping[str, mc.ModelParameter]) -> int:
    """The model's KV block size: its tokens_per_block parameter, or TensorRT-LLM's build default
    where it records none (or none that is a power of two, as TensorRT-LLM's are)."""
    text = (
        params[TOKENS_PER_BLOCK_PARAMETER].string_value.strip()
        if TOKENS_PER_BLOCK_PARAMETER in params
        else ""
    )
    value = int(text) if text.isdigit() and len(text) <= 6 else 0
    return value if value > 1 and not value & (value - 1) else DEFAULT_TOKENS_PER_BLOCK


def cached_tokens(reused_blocks: int, tokens_per_block: int, prompt_tokens: int) -> int:
    """The prompt tokens a request's reused KV blocks hold: whole blocks, but never the last
    prompt token, which the engine always computes (its forward pass yields the first logits; a
    partially reused last block holds the tokens before it)."""
    return max(0, min(reused_blocks * tokens_per_block, prompt_tokens - 1))


REQUIRED_INPUTS = ("input_ids", "input_lengths", "request_output_len")
LOG_PROBS_INPUT = "return_log_probs"
# [batch 1, beams, tokens] FP32. Streamed, TensorRT-LLM's executor returns the log-probabilities
# of every token generated so far (LlmRequest::createResult does not slice them as it slices the
# output ids), so a response's new tokens own the last entries of the first beam's row.
LOG_PROBS_OUTPUT = "output_log_probs"
# TensorRT-LLM's end id that no token matches: the generation ends at request_output_len only.
NO_END_ID = -1
GUIDE_INPUTS = frozenset(GUIDED_DECODING_INPUTS)


@dataclass(frozen=True)
class InputNames:
    """Input names of this model revision (several were renamed across TensorRT-LLM versions)."""

    present: frozenset[str]
    seed: str | None
    min_tokens: str | None
    batch_dim: bool
    # The model takes guides: both inputs declared and a guided decoder configured (the backend
    # sets one up only when `guided_decoding_backend` and `xgrammar_tokenizer_info_path` are set).
    guided: bool = False
    # The model returns log-probabilities: input return_log_probs and output output_log_probs.
    log_probs: bool = False
    # The model reports draft tokens: input return_perf_metrics, outputs total_draft_tokens and
    # total_accepted_draft_tokens.
    draft_counts: bool = False
    # The model reports the KV blocks a request reused: input return_perf_metrics, output
    # kv_cache_reused_blocks; its blocks hold `tokens_per_block` tokens (parameter
    # tokens_per_block, which engine-build writes, else TensorRT-LLM's build default).
    kv_reuse: bool = False
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
    speculation: Speculation = NO_SPECULATION
    # Most alternatives per token the model returns: MAX_TOP_LOGPROBS with the input
    # TOP_LOGPROBS_INPUT and both outputs declared (the appliance engine server's models), else 0
    # (the tensorrtllm backend returns the chosen token's log-probability alone).
    top_logprobs: int = 0
    # The engine's max_input_len and max_seq_len, where its parameters declare them.
    limits: EngineLimits = NO_ENGINE_LIMITS

    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> InputNames:
        present = frozenset(i.name for i in config.input)
        params = config.parameters
        configured = all(
            params[name].string_value if name in params else ""
            for name in ("guided_decoding_backend", "xgrammar_tokenizer_info_path")
        )
        outputs = {o.name for o in config.output}
        decoding_mode = params["decoding_mode"].string_value if "decoding_mode" in params else ""
        switchable = SPECULATION_INPUT in present
        return cls(
            present=present,
            seed=next((n for n in ("random_seed", "seed") if n in present), None),
            min_tokens=next((n for n in ("min_length", "min_tokens") if n in present), None),
            batch_dim=config.max_batch_size > 0,
            guided=configured and present >= GUIDE_INPUTS,
            log_probs=LOG_PROBS_INPUT in present and LOG_PROBS_OUTPUT in outputs,
            draft_counts=PERF_METRICS_INPUT in present
            and {DRAFT_TOKENS_OUTPUT, ACCEPTED_DRAFT_TOKENS_OUTPUT} <= outputs,
            kv_reuse=PERF_METRICS_INPUT in present and KV_CACHE_REUSED_BLOCKS_OUTPUT in outputs,
            tokens_per_block=_tokens_per_block(params),
            speculation=Speculation(
                drafts=switchable or decoding_mode.lower() in SPECULATIVE_DECODING_MODES,
                switchable=switchable,
            ),
            top_logprobs=MAX_TOP_LOGPROBS
            if TOP_LOGPROBS_INPUT in present
            and {TOP_LOGPROB_IDS_OUTPUT, TOP_LOGPROBS_OUTPUT} <= outputs
            else 0,
            limits=engine_limits(params),
        )

    @functools.cached_property
    def unserved(self) -> Mapping[str, str]:
        """The request fields this model takes no input for, with what its config lacks."""
        lacks: dict[str, str] = {}
        if self.seed is None:
            lacks["seed"] = "takes no seed (its config.pbtxt has no input random_seed or seed)"
        if self.min_tokens is None:
            lacks["min_tokens"] = (
                "takes no min_tokens (its config.pbtxt has no input min_length or min_tokens)"
            )
        if not self.log_probs:
            lacks["logprobs"] = (
                f"returns no log-probabilities (its config.pbtxt needs the input "
                f"{LOG_PROBS_INPUT} and the output {LOG_PROBS_OUTPUT})"
            )
        if "end_id" not in self.present:
            lacks["ignore_eos"] = (
                "cannot ignore the end token (its config.pbtxt has no input end_id)"
            )
        return lacks


def check_model_config(config: mc.ModelConfig, address: str) -> InputNames:
    """Refuses a model the gateway cannot stream from, saying what to change in its config.pbtxt."""
    name = config.name
    if not config.model_transaction_policy.decoupled:
        raise BackendError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"model '{name}' at {address} is not decoupled; streaming needs "
            "'model_transaction_policy { decoupled: true }' in its config.pbtxt "
            "(decoupled_mode:true when filled from the inflight_batcher_llm template)",
        )
    names = InputNames.from_config(config)
    missing = [n for n in REQUIRED_INPUTS if n not in names.present]
    if missing:
        raise BackendError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"model '{name}' at {address} has no input {', '.join(missing)}: "
            "the gateway calls the tensorrt_llm model directly with token ids, not an ensemble",
        )
    if "output_ids" not in {o.name for o in config.output}:
        raise BackendError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"model '{name}' at {address} has no output output_ids",
        )
    return names


class _Inputs:
    """Appends a model's inputs to a ModelInferRequest (raw little-endian contents)."""

    def __init__(self, request: ts.ModelInferRequest, batch_dim: bool) -> None:
        self.request = request
        self.batch_dim = batch_dim

    def add(self, name: str, datatype: str, values: Sequence[wire.Value]) -> None:
        wire.add_input(self.request, name, datatype, values, self.batch_dim)

    def flag(self, name: str, value: bool) -> None:
        wire.add_input(self.request, name, "BOOL", [value], self.batch_dim)


def _output_tokens(response: ts.ModelInferResponse) -> list[int]:
    try:
        tokens = wire.output_values(response, "output_ids")
    except wire.TensorError as exc:
        raise BackendError(
            grpc.StatusCode.UNAVAILABLE, f"inference server sent a malformed output_ids: {exc}"
        ) from exc
    return [int(t) for t in tokens] if tokens else []


def _output_log_probs(response: ts.ModelInferResponse, count: int) -> list[float]:
    """The log-probabilities of a response's `count` new tokens (see LOG_PROBS_OUTPUT)."""
    shape: list[int] = []
    for output in response.outputs:
        if output.name == LOG_PROBS_OUTPUT:
            shape = list(output.shape)
    try:
        values = wire.output_values(response, LOG_PROBS_OUTPUT)
    except wire.TensorError as exc:
        raise BackendError(
            grpc.StatusCode.UNAVAILABLE,
            f"inference server sent a malformed {LOG_PROBS_OUTPUT}: {exc}",
        ) from exc
    if values is None:
        values = []
    row = values[: shape[-1]] if shape and shape[-1] >= 0 else values
    if len(row) < count:
        raise BackendError(
            grpc.StatusCode.UNAVAILABLE,
            f"inference server sent {len(row)} {LOG_PROBS_OUTPUT} for {count} new tokens",
        )
    return [float(v) for v in row[len(row) - count :]]


def _output_top(response: ts.ModelInferResponse, count: int, k: int) -> list[list[Alternative]]:
    """The alternatives of a response's `count` new tokens: the last `count` rows of
    TOP_LOGPROB_IDS_OUTPUT and TOP_LOGPROBS_OUTPUT, [batch, beam, tokens, k]."""
    try:
        ids = wire.output_values(response, TOP_LOGPROB_IDS_OUTPUT) or []
        values = wire.output_values(response, TOP_LOGPROBS_OUTPUT) or []
    except wire.TensorError as exc:
        raise BackendError(
            grpc.StatusCode.UNAVAILABLE, f"inference server sent malformed alternatives: {exc}"
        ) from exc
    if len(ids) != len(values) or len(ids) < count * k:
        raise BackendError(
            grpc.StatusCode.UNAVAILABLE,
            f"inference server sent {len(ids)} alternative ids and {len(values)} log-probabilities "
            f"for {count} new tokens of {k} alternatives each",
        )
    start = len(ids) - count * k
    return [
        [(int(ids[j]), float(values[j])) for j in range(start + i * k, start + (i + 1) * k)]
        for i in range(count)
    ]


def _count(response: ts.ModelInferResponse, name: str) -> int | None:
    """A count output's value (shape [1, 1]); None when the response carries none."""
    try:
        values = wire.output_values(response, name)
    except wire.TensorError as exc:
        raise BackendError(
            grpc.StatusCode.UNAVAILABLE, f"inference server sent a malformed {name}: {exc}"
        ) from exc
    if not values:
        return None
    return max(0, int(values[0]))


def _is_final(response: ts.ModelInferResponse) -> bool:
    params = response.parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


class TritonBackend(Backend):
    """One model on one Triton-protocol server, behind one persistent channel."""

    @classmethod
    def from_config(cls, config: ModelConfig) -> TritonBackend:
        return cls(config.backend, config.triton_model, config.stream_socket)

    def __init__(self, address: str, model: str, stream_socket: Path | None = None) -> None:
        """stream_socket: the engine server's (stream_socket.py), which then carries every
        generation; gRPC at `address` carries the rest."""
        self._address = address
        self.model = model
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = ts_grpc.GRPCInferenceServiceStub(self._channel)
        self._names: InputNames | None = None
        self._background: set[asyncio.Task[None]] = set()
        # Streams carrying a request now (cancel_all ends them), and those kept between requests.
        self._calls: set[StreamCall] = set()
        open_stream: Callable[[], StreamCall] = (
            functools.partial(SocketStream, str(stream_socket), MAX_RESPONSE_BYTES)
            if stream_socket is not None
            else self._stub.ModelStreamInfer
        )
        self._streams: StreamPool[StreamCall] = StreamPool(
            open_stream, KEPT_STREAMS, KEPT_STREAM_IDLE_S
        )
        # cancel_all was called: every generation, running or starting, ends CANCELLED.
        self._shutting_down = False
        self._closed = False
        # Generations the server runs at once (its model's max_batch_size; 1 until read).
        self._max_batch_size = 1

    @property
    def address(self) -> str:
        return self._address

    @property
    def max_batch_size(self) -> int:
        """The model's max_batch_size as last read (1 before)."""
        return self._max_batch_size

    @property
    def speculation(self) -> Speculation:
        """From the model's configuration as last read (NO_SPECULATION before)."""
        return self._names.speculation if self._names is not None else NO_SPECULATION

    @property
    def max_top_logprobs(self) -> int:
        """From the model's configuration as last read (0 before)."""
        return self._names.top_logprobs if self._names is not None else 0

    @property
    def guided(self) -> bool:
        """From the model's configuration as last read (False before)."""
        return self._names.guided if self._names is not None else False

    @property
    def unserved(self) -> Mapping[str, str]:
        """From the model's configuration as last read (empty before)."""
        return self._names.unserved if self._names is not None else {}

    @property
    def engine_limits(self) -> EngineLimits:
        """From the model's configuration as last read (NO_ENGINE_LIMITS before)."""
        return self._names.limits if self._names is not None else NO_ENGINE_LIMITS

    async def wait_ready(self, timeout_s: float) -> None:
        """Waits for ServerReady and ModelReady, then reads and checks the model's configuration.

        Says every few seconds what it is waiting for, so a start-up that waits is never silent."""
        started = time.monotonic()
        deadline = started + timeout_s
        next_note = started + WAIT_NOTE_S
        last = "no answer yet"
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                raise BackendError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"inference server at {self.address} not ready for model '{self.model}' "
                    f"after {timeout_s:g} s ({last})",
                )
            if now >= next_note:
                log.info(
                    "waiting for model '%s' on the inference server at %s: %.0f s so far, "
                    "up to %g s (%s)",
                    self.model,
                    self.address,
                    now - started,
                    timeout_s,
                    last,
                )
                next_note = now + WAIT_NOTE_S
            ready, last = await self.readiness(min(remaining, 2.0), read_config=True)
            if ready:
                return
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    async def readiness(self, timeout_s: float, read_config: bool = False) -> tuple[bool, str]:
        """One ServerReady + ModelReady round: (ready, why not). With read_config, or when the
        server's configuration was not read since it was last unreachable (it may have restarted
        with another revision), the model's configuration is read and checked again."""
        # One time budget for the round, not one per call: an answer (ready or not) comes within
        # it, and a round that takes all of it got none (HealthMonitor counts on that).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def left() -> float:
            return max(0.001, deadline - loop.time())

        try:
            server = await self._stub.ServerReady(ts.ServerReadyRequest(), timeout=left())
            if not server.ready:
                self._streams.close_idle()  # a stopping server waits for its streams to close
                return False, "server not ready"
            ready = await self._stub.ModelReady(
                ts.ModelReadyRequest(name=self.model), timeout=left()
            )
            if not ready.ready:
                return False, f"model '{self.model}' not ready"
            if read_config or self._names is None:
                reply = await self._stub.ModelConfig(
                    ts.ModelConfigRequest(name=self.model), timeout=left()
                )
                self._names = check_model_config(reply.config, self.address)
                self._max_batch_size = max(1, reply.config.max_batch_size)
        except grpc.aio.AioRpcError as exc:
            self._names = None if exc.code() == grpc.StatusCode.UNAVAILABLE else self._names
            self._streams.close_idle()
            return False, f"{exc.code().name}: {exc.details()}"
        except BackendError as exc:
            return False, exc.message
        return True, ""

    def _request(self, g: GenerationRequest) -> ts.ModelInferRequest:
        names = self._names
        if names is None:
            raise BackendError(
                grpc.StatusCode.UNAVAILABLE,
                f"inference server at {self.address} is not ready for model '{self.model}'",
            )
        prompt_ids, end_id, pad_id, sampling = g.prompt_ids, g.end_id, g.pad_id, g.sampling
        req = ts.ModelInferRequest(model_name=self.model, id=g.request_id)
        req.parameters["triton_enable_empty_final_response"].bool_param = True
        t = _Inputs(req, names.batch_dim)
        t.add("input_ids", "INT32", prompt_ids)
        t.add("input_lengths", "INT32", [len(prompt_ids)])
        t.add("request_output_len", "INT32", [g.max_tokens])
        # The gateway refuses these before this (request.check_inputs, with the client's model
        # and field); this is a configuration read again since.
        unserved = unserved_refusal(self.model, names.unserved, g)
        if unserved is not None:
            raise BackendError(grpc.StatusCode.INVALID_ARGUMENT, unserved[1])
        present = names.present
        if g.ignore_eos:
            t.add("end_id", "INT32", [NO_END_ID])
        elif end_id is not None and "end_id" in present:
            t.add("end_id", "INT32", [end_id])
        if pad_id is not None and "pad_id" in present:
            t.add("pad_id", "INT32", [pad_id])
        if "streaming" in present:
            t.flag("streaming", True)
        if "exclude_input_in_output" in present:
            t.flag("exclude_input_in_output", True)
        if "temperature" in present:
            t.add("temperature", "FP32", [sampling.temperature])
        if "runtime_top_k" in present:
            t.add("runtime_top_k", "INT32", [sampling.top_k])
        if "runtime_top_p" in present:
            t.add("runtime_top_p", "FP32", [sampling.top_p])
        if sampling.seed is not None and names.seed is not None:
            t.add(names.seed, "UINT64", [sampling.seed])
        if g.min_tokens and names.min_tokens is not None:
            t.add(names.min_tokens, "INT32", [g.min_tokens])
        if g.logprobs:
            t.flag(LOG_PROBS_INPUT, True)
        if g.top_logprobs:
            refused = top_logprobs_refusal(self.model, names.top_logprobs, g.top_logprobs)
            if refused is not None:
                raise BackendError(grpc.StatusCode.INVALID_ARGUMENT, refused)
            t.add(TOP_LOGPROBS_INPUT, "INT32", [g.top_logprobs])
        if names.draft_counts or names.kv_reuse:
            t.flag(PERF_METRICS_INPUT, True)
            # With perf metrics on, every response carries ten outputs more, of which the gateway
            # reads three at most: the request names the outputs it reads.
            wanted = ["output_ids"]
            if g.logprobs:
                wanted.append(LOG_PROBS_OUTPUT)
            if g.top_logprobs:
                wanted += [TOP_LOGPROB_IDS_OUTPUT, TOP_LOGPROBS_OUTPUT]
            if names.draft_counts:
                wanted += [DRAFT_TOKENS_OUTPUT, ACCEPTED_DRAFT_TOKENS_OUTPUT]
            if names.kv_reuse:
                wanted.append(KV_CACHE_REUSED_BLOCKS_OUTPUT)
            for name in wanted:
                req.outputs.add(name=name)
        refusal = names.speculation.refusal(self.model, g.speculation)
        if refusal is not None:
            raise BackendError(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        if g.speculation is not None and g.speculation != names.speculation.drafts:
            t.flag(SPECULATION_INPUT, g.speculation)
        if g.guide is not None:
            if not names.guided:
                raise BackendError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    # The gateway refuses a guide for a model without guided decoding before
                    # this (request.check_guide, with the client's model and field); this is a
                    # configuration read again since.
                    f"the inference server's model '{self.model}' has no guided decoding (its "
                    "config.pbtxt needs the "
                    f"inputs {', '.join(sorted(GUIDE_INPUTS))} and the parameters "
                    "guided_decoding_backend and xgrammar_tokenizer_info_path): send the request "
                    "without response_format, a forcing tool_choice or a guide",
                )
            t.add("guided_decoding_guide_type", "BYTES", [g.guide.kind.encode()])
            t.add("guided_decoding_guide", "BYTES", [g.guide.text.encode()])
        return req

    async def stream(self, g: GenerationRequest) -> AsyncGenerator[Tokens, None]:
        """Yields the new token ids of each response until the final one.

        The request goes out on a kept stream when there is one (stream_pool.py), which carries no
        deadline of its own: `g.timeout_s` bounds each wait for a response here. Leaving early
        (the caller stopped iterating, was cancelled, hit a stop string or the deadline) cancels
        the HTTP/2 stream and also sends `stop=true` with the same request id, so the engine stops
        generating even where stream cancellation is not propagated; on the engine server's stream
        socket closing the connection is that cancellation.
        """
        if self._shutting_down or self._closed:
            raise BackendError(grpc.StatusCode.CANCELLED, "gateway shutting down")
        request = self._request(g)
        names = self._names
        counts = names is not None and names.draft_counts
        # The reused blocks, counted once when the engine added the sequence to its cache, are
        # read from the first response that carries them.
        reuse = names is not None and names.kv_reuse
        block = names.tokens_per_block if names is not None else DEFAULT_TOKENS_PER_BLOCK
        deadline = None if g.timeout_s is None else asyncio.get_running_loop().time() + g.timeout_s
        call, kept = self._streams.take()
        self._calls.add(call)
        # The final response arrived (the stream may carry the next request), or an in-band error
        # did (the engine ended the request; the stream is closed, as more may follow the error).
        finished = reusable = False
        try:
            message = await self._first(call, request, deadline, kept)
            if message is None:  # the kept stream had ended while idle: once more, on a new one
                self._calls.discard(call)
                call.cancel()
                call = self._streams.new()
                self._calls.add(call)
                message = await self._first(call, request, deadline, False)
            while True:
                if not isinstance(message, ts.ModelStreamInferResponse):  # EOF
                    raise BackendError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"inference server at {self.address} closed the stream before the end",
                    )
                if message.infer_response.id not in ("", request.id):
                    # Another request's (a duplicate final of the one this kept stream carried
                    # before, or an id never sent): none of it is this request's answer.
                    _foreign.warning(
                        "inference server at %s sent a response for another request on the "
                        "stream of request %s; ignored",
                        self.address,
                        request.id,
                    )
                    message = await self._read(call, deadline)
                    continue
                if message.error_message:
                    finished = True
                    raise inband_error(message.error_message, request.id)
                response = message.infer_response
                tokens = Tokens(_output_tokens(response))
                if g.logprobs and tokens:
                    tokens.logprobs = _output_log_probs(response, len(tokens))
                if g.top_logprobs and tokens:
                    tokens.top = _output_top(response, len(tokens), g.top_logprobs)
                counted = False
                if counts:
                    tokens.draft_tokens = _count(response, DRAFT_TOKENS_OUTPUT)
                    tokens.accepted_draft_tokens = _count(response, ACCEPTED_DRAFT_TOKENS_OUTPUT)
                    counted = tokens.draft_tokens is not None
                if reuse:
                    reused = _count(response, KV_CACHE_REUSED_BLOCKS_OUTPUT)
                    if reused is not None:
                        reuse = False
                        tokens.cached_tokens = cached_tokens(reused, block, len(g.prompt_ids))
                        counted = True
                if _is_final(response):
                    finished = reusable = True
                    if tokens or counted:
                        yield tokens
                    return
                if tokens or tokens.cached_tokens is not None:
                    yield tokens
                message = await self._read(call, deadline)
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc) from exc
        except asyncio.CancelledError:
            if self._shutting_down and call.cancelled():
                raise BackendError(grpc.StatusCode.CANCELLED, "gateway shutting down") from None
            raise
        finally:
            self._calls.discard(call)
            if reusable and not self._shutting_down and not self._closed:
                self._streams.give_back(call)
            else:
                call.cancel()
                # Closing a socket stream cancels what runs on it (the engine server's own
                # contract); a gRPC stream's cancellation may not reach the engine (Triton).
                if not finished and not isinstance(call, SocketStream):
                    self._spawn(self._send_stop(g.request_id, g.prompt_ids[:1]))

    async def _first(
        self, call: StreamCall, request: ts.ModelInferRequest, deadline: float | None, kept: bool
    ) -> object:
        """Sends the request and reads the first response (or EOF). None: the kept stream had
        ended while idle (the server restarted or stopped; a server ends a stream only once
        nothing runs on it), so the request was not taken."""
        try:
            await call.write(request)
            message = await self._read(call, deadline)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            if kept and not self._shutting_down:
                return None
            if isinstance(exc, asyncio.InvalidStateError):  # written to a stream already ended
                raise BackendError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"inference server at {self.address} closed the stream before the end",
                ) from None
            raise
        return None if kept and message is grpc.aio.EOF else message

    @staticmethod
    async def _read(call: StreamCall, deadline: float | None) -> object:
        if deadline is None:
            return await call.read()
        try:
            async with asyncio.timeout_at(deadline):
                return await call.read()
        except TimeoutError:
            raise BackendError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline_exceeded while generating"
            ) from None

    def _rpc_error(self, exc: grpc.aio.AioRpcError) -> BackendError:
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            return BackendError(
                code, f"inference server at {self.address} unavailable: {exc.details()}"
            )
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return BackendError(code, f"request {code.name.lower()} while generating")
        return BackendError(code, f"inference server: {exc.details()}")

    def _spawn(self, coro: Coroutine[None, None, None]) -> None:
        """Runs coro beside the caller; not once closed (closing the channel cancels its calls)."""
        if self._closed:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_stop(self, request_id: str, some_ids: Sequence[int]) -> None:
        """`stop=true` with the same id cancels the request in the TensorRT-LLM backend."""
        names = self._names
        if names is None or "stop" not in names.present:
            return
        req = ts.ModelInferRequest(model_name=self.model, id=request_id)
        req.parameters["triton_enable_empty_final_response"].bool_param = True
        t = _Inputs(req, names.batch_dim)
        # Triton checks required inputs before the backend sees `stop`, so they must be present.
        t.add("input_ids", "INT32", list(some_ids) or [0])
        t.add("input_lengths", "INT32", [len(some_ids) or 1])
        t.add("request_output_len", "INT32", [1])
        if "streaming" in names.present:
            t.flag("streaming", True)
        t.flag("stop", True)
        call = self._stub.ModelStreamInfer(timeout=STOP_REQUEST_TIMEOUT_S)
        try:
            await call.write(req)
            await call.done_writing()
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            log.debug("stop request %s: %s", request_id, exc.details())
        except asyncio.CancelledError:
            call.cancel()
            raise

    def cancel_all(self) -> None:
        """Ends every request in flight (the drain period is over), and every one that starts
        from now on, before it reaches the server."""
        self._shutting_down = True
        self._streams.close_idle()
        for call in list(self._calls):
            call.cancel()

    async def close(self) -> None:
        """Ends the stop requests under way, then closes the channel: a generation that ends
        later (its task was cancelled and has yet to run) sends none on the closed channel."""
        self._closed = True
        self._streams.close_idle()
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._channel.close()
