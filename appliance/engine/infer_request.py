"""Turns a Triton `ModelInferRequest` for the `tensorrt_llm` model into the engine's validated
request, `Decoded`, or refuses it with an `InferError`.

Named after Triton core's infer_request.cc, whose checks it mirrors. The decision: a request is
checked in the order Triton checks it, and refused in Triton's words with Triton's status, so a
client sees from this engine the error it would see from Triton with the TensorRT-LLM backend.
First what Triton's gRPC frontend and core check before a request is issued (inputs named once,
their data found, the requested outputs declared, the count of inputs, then input by input its
name, batch dimension, datatype, shape and byte size), each refused INVALID_ARGUMENT; then what
the backend and TensorRT-LLM's executor check as they read an issued request's inputs, each
refused as the backend refuses it after core (`refused_after_core`: INTERNAL, a final error
response). Checks of this engine's own (token ids within the vocabulary, inputs it does not
compute) are refused the same way, at the point where the backend would read that input.
"""

from __future__ import annotations

import array
import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from math import prod
from typing import Any

import grpc
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as ts

from appliance.backends import wire
from appliance.engine.guided import (
    NOT_SETUP_MESSAGE,
    CompiledGuide,
    Grammars,
    Guide,
    GuideError,
    parse_guide,
)
from appliance.engine.repository import ModelEntry
from appliance.engine.sampling import SamplingParams
from engine_build.pbtxt import MAX_TOP_LOGPROBS, SPECULATION_INPUT, TOP_LOGPROBS_INPUT


class InferError(Exception):
    """A request Triton would answer with an error; `code` is used when errors go out of band."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.message = message
        self.code = code
        # The id of the request it answers: an in-band error carries it, as Triton's do for a
        # request that could not be issued, so a client with several requests on a stream knows.
        self.request_id = ""
        # A failure of an issued request: Triton's in-band error also names the model and says
        # whether it is the request's last response.
        self.issued: tuple[str, str, bool] | None = None  # model name, version, final
        # Refused by TensorRT-LLM's executor: it arrives as the request's error response, whose
        # statistics the backend reports (a failed execution); nothing else refused is counted.
        self.executor = False

    def in_band(self) -> ts.ModelStreamInferResponse:
        """The error as a stream's response (`error_message`, the request's id)."""
        response = ts.ModelInferResponse(id=self.request_id)
        if self.issued is not None:
            response.model_name, response.model_version, final = self.issued
            response.parameters["triton_final_response"].bool_param = final
        return ts.ModelStreamInferResponse(error_message=self.message, infer_response=response)


def refused_after_core(request: ts.ModelInferRequest, error: InferError) -> InferError:
    """A request refused once Triton core has issued it: by the TensorRT-LLM backend as it reads
    it (ModelInstanceState::enqueue, handleStopRequest: sendEnqueueResponse), by the executor, or
    by this server where either would compute. The backend sends an error response flagged final,
    INTERNAL (TRITONSERVER_ERROR_INTERNAL); Triton's stream handler
    (StreamInferResponseComplete) writes it as `error_message` with the request's id, model name
    and version and `triton_final_response`, and ModelInfer ends with its status."""
    error.code = grpc.StatusCode.INTERNAL
    error.issued = (request.model_name, request.model_version, True)
    return error


def _executor_error(message: str) -> InferError:
    """A request TensorRT-LLM's executor refuses: the backend answers with the executor's message
    after its own prefix."""
    error = InferError(f"Executor failed process requestId 0 due to the following error: {message}")
    error.executor = True
    return error


# Inputs of the TensorRT-LLM template this engine does not compute, with the value that changes
# nothing (None: any value would change the output). Anything else is refused, not ignored.
# `pad_id` is not among them: the backend hands it to the executor's Request (TensorRT-LLM
# triton_backend/inflight_batcher_llm/src/utils.cc, createRequestsFromInputTensors), which pads
# with it only a beam shorter than the others and an encoder-decoder request without decoder ids;
# a beam-1 answer of a decoder-only model, streamed or not, holds the same ids whatever it is.
_NOT_IMPLEMENTED: dict[str, float | None] = {
    "stop_words_list": None,
    "bad_words_list": None,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def dtype_name(value: int) -> str:
    return str(mc.DataType.Name(value)).removeprefix("TYPE_").replace("STRING", "BYTES")


@dataclass(frozen=True)
class InputSpec:
    """A declared input as each request is checked against it."""

    datatype: str  # the wire name: INT32, BOOL, BYTES, ...
    dims: tuple[int, ...]  # without the batch dimension; -1: any size


@dataclass
class ModelSpec:
    """One model of the repository as each request is checked against it."""

    entry: ModelEntry
    max_len: int  # max_seq_len: prompt and generated tokens
    vocab_size: int  # input_ids and end_id are checked against it
    output_names: frozenset[str] = frozenset()
    grammars: Grammars | None = None  # None: the model has no guided decoder
    # What every request is checked against, read once from the config: protobuf field reads
    # cost about a microsecond each, and a request has ten inputs or so.
    specs: dict[str, InputSpec] = field(init=False)
    required: tuple[str, ...] = field(init=False)
    max_batch_size: int = field(init=False)
    batch_dim: bool = field(init=False)
    exclude_input_default: bool = field(init=False)
    # The longest prompt served: the repository's max_input_len, below max_seq_len so that at
    # least one token can be generated.
    max_input_len: int = field(init=False)

    def __post_init__(self) -> None:
        given = self.entry.parameter("max_input_len", "")
        limit = self.max_len - 1
        self.max_input_len = min(int(given), limit) if given.isdigit() and int(given) else limit
        declared = self.entry.config.input
        self.specs = {i.name: InputSpec(dtype_name(i.data_type), tuple(i.dims)) for i in declared}
        self.required = tuple(i.name for i in declared if not i.optional)
        self.max_batch_size = self.entry.config.max_batch_size
        self.batch_dim = self.max_batch_size > 0
        self.exclude_input_default = (
            self.entry.parameter("exclude_input_in_output", "false") == "true"
        )


@dataclass
class Decoded:
    """The tensorrt_llm inputs of one request, with TensorRT-LLM's defaults filled in."""

    prompt_ids: list[int]
    max_new_tokens: int
    end_id: int | None
    params: SamplingParams
    streaming: bool
    stop: bool
    exclude_input: bool
    return_perf: bool = False
    guide: Guide | None = None
    compiled: CompiledGuide | None = None  # the guide, compiled by `compile_guide`
    min_tokens: int = 0
    return_log_probs: bool = False
    # False: decode without drafts (SPECULATION_INPUT); only a speculating model declares it.
    speculation: bool = True
    # Alternatives returned per generated token (TOP_LOGPROBS_INPUT; 0: none).
    top_logprobs: int = 0


_BATCH_NOTE = (
    "NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
    "prepended to each input shape. If you want to specify the full shape including the batch dim "
    "in your input dims config, try setting max_batch_size to zero. See the model configuration "
    "docs for more info on max_batch_size."
)


def _dims(shape: list[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


_LENGTH_PREFIX = 4  # bytes before each BYTES element: its length, little-endian uint32
# Bytes per element of the datatypes a config may declare that wire.read_input does not decode
# (Triton's GetDataTypeByteSize): their byte size is checked as Triton checks it, then read_input
# refuses them (INVALID_ARGUMENT); it refuses any other datatype (INVALID: none declared) too.
_UNDECODED_SIZES = {"FP16": 2, "BF16": 2}


def _element_size(datatype: str) -> int | None:
    code = wire.DATATYPES.get(datatype)
    return array.array(code).itemsize if code else _UNDECODED_SIZES.get(datatype)


def check_byte_size(
    name: str, datatype: str, raw: bytes, count: int, model_name: str, request_id: str
) -> None:
    """Triton core's check that an input's bytes hold what its shape and datatype promise
    (core's Normalize and ValidateBytesInputs)."""
    where = f"for inference input '{name}' for model '{model_name}'"
    logged = wire.log_request(request_id)
    if datatype != "BYTES":
        size = _element_size(datatype)
        expected = count * (size or 0)
        if size is not None and len(raw) != expected:
            raise InferError(
                f"{logged}input byte size mismatch for input '{name}' for model '{model_name}'. "
                f"Expected {expected}, got {len(raw)}"
            )
        return
    at = checked = 0
    while at < len(raw):
        if len(raw) - at < _LENGTH_PREFIX:
            raise InferError(
                f"{logged}incomplete string length indicator {where}, expecting {_LENGTH_PREFIX} "
                f"bytes but only {len(raw) - at} bytes available. Please make sure the string "
                "length indicator is in one buffer."
            )
        checked += 1
        if checked > count:
            raise InferError(
                f"{logged}unexpected number of string elements {checked} {where}, expecting {count}"
            )
        at += _LENGTH_PREFIX + int.from_bytes(raw[at : at + _LENGTH_PREFIX], "little")
    if checked != count:
        raise InferError(f"{logged}expected {count} string elements {where}, got {checked}")


def _data(
    tensor: ts.ModelInferRequest.InferInputTensor, raw: list[bytes], index: int, model_name: str
) -> bytes | None:
    """Where an input's values are, as Triton's gRPC frontend finds them (its
    InferGRPCToInput): its typed contents (None), or its raw_input_contents entry;
    entries past the last input are not read."""
    name = tensor.name
    if tensor.HasField("contents"):
        if raw:
            raise InferError(
                "contents field must not be specified when using raw_input_contents for "
                f"'{name}' for model '{model_name}'"
            )
        return None
    if index >= len(raw):
        raise InferError(
            f"unable to find data for input tensor '{name}' for model '{model_name}' in request."
        )
    return raw[index]


def _checked_inputs(
    request: ts.ModelInferRequest, model: ModelSpec, data: list[bytes | None]
) -> dict[str, list[Any]]:
    """The request's input values, checked in Triton core's order (its
    Normalize): input by input its name, batch dimension and batch size (the first non-zero one,
    held as core's uint32), the batch size against max_batch_size, then input by input its
    datatype, shape and byte size.
    Which error a client sees when several are wrong is therefore Triton's, except that core
    walks the inputs in its hash map's order and this server in the request's."""
    model_name = model.entry.name
    logged = wire.log_request(request.id)
    full: list[list[int]] = []
    batch = 0
    for tensor in request.inputs:
        if tensor.name not in model.specs:
            raise InferError(f"unexpected inference input '{tensor.name}' for model '{model_name}'")
        shape = list(tensor.shape)
        full.append(shape)
        if not model.batch_dim:
            continue
        if not shape:
            raise InferError(
                f"{logged}input '{tensor.name}' has no shape but model requires batch dimension for "
                f"'{model_name}'"
            )
        if batch == 0:
            batch = shape[0] & 0xFFFF_FFFF
        elif shape[0] != batch:
            raise InferError(
                f"{logged}input '{tensor.name}' batch size does not match other inputs for "
                f"'{model_name}'"
            )
    if batch > model.max_batch_size:
        # The repository admits max_batch_size 1 at most (read_repository): this server computes
        # one sequence per request, so core's own refusal covers every batch of several.
        raise InferError(
            f"{logged}inference request batch-size must be <= {model.max_batch_size} for "
            f"'{model_name}'"
        )
    tensors: dict[str, list[Any]] = {}
    for tensor, shape, given in zip(request.inputs, full, data, strict=True):
        name = tensor.name
        spec = model.specs[name]
        if tensor.datatype != spec.datatype:
            raise InferError(
                f"{logged}inference input '{name}' data-type is '{tensor.datatype}', but model "
                f"'{model_name}' expects '{spec.datatype}'"
            )
        dims = shape[1:] if model.batch_dim else shape
        if len(dims) == len(spec.dims) and -1 in dims:
            raise InferError(
                f"{logged}All input dimensions should be specified for input '{name}' for model "
                f"'{model_name}', got {_dims(shape)}"
            )
        if len(dims) != len(spec.dims) or any(
            d != -1 and d != s for d, s in zip(spec.dims, dims, strict=True)
        ):
            # Triton core's words: the expected shape with the batch dimension (-1) when the
            # model batches, both shapes written [d0,d1,...], and its note on the batch dimension.
            expected = [-1, *spec.dims] if model.batch_dim else list(spec.dims)
            raise InferError(
                f"{logged}unexpected shape for input '{name}' for model '{model_name}'. "
                f"Expected {_dims(expected)}, got {_dims(shape)}. "
                f"{_BATCH_NOTE if model.batch_dim else ''}"
            )
        count = prod(shape)
        if given is not None:
            check_byte_size(name, spec.datatype, given, count, model_name, request.id)
        try:
            tensors[name] = wire.read_input(tensor, given, shape).values
        except wire.TensorError as exc:
            raise InferError(f"input '{name}' for model '{model_name}': {exc}") from exc
    return tensors


def _listed(names: Iterable[str]) -> str:
    """Names as Triton core lists them: ['a','b'], without spaces."""
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


def _check_input_count(request: ts.ModelInferRequest, model: ModelSpec, given: set[str]) -> None:
    """Triton core's ValidateRequestInputs: it refuses a request whose count of inputs is outside
    [required, declared] only; one within it that lacks a required input is issued, and the
    backend answers it (`decode_request`). The given inputs are listed sorted (core lists them
    in its hash map's order, which nothing fixes); the missing ones in the config's order, and,
    when none is, as core writes an empty list there: `]`."""
    required, declared = model.required, len(model.specs)
    if len(required) <= len(given) <= declared:
        return
    missing = [n for n in required if n not in given]
    absent = _listed(missing) if missing else "]"
    expected = (
        f"{declared} inputs"
        if declared == len(required)
        else f"number of inputs between {len(required)} and {declared}"
    )
    raise InferError(
        f"{wire.log_request(request.id)}expected {expected} but got {len(given)} inputs for model "
        f"'{model.entry.name}'. Got input(s) {_listed(sorted(given))}, but missing required "
        f"input(s) {absent}. Please provide all required input(s)."
    )


# The request parameters Triton's gRPC frontend reads itself (SetInferenceRequestMetadata), with
# the value types it takes for each; of the keys starting with "triton_" it allows only these.
_PARAMETER_TYPES = {
    "sequence_id": ("int64_param", "string_param"),
    "sequence_start": ("bool_param",),
    "sequence_end": ("bool_param",),
    "priority": ("int64_param", "uint64_param"),
    "timeout": ("int64_param",),
    "triton_enable_empty_final_response": ("bool_param",),
}
_ANY_PARAMETER = ("int64_param", "bool_param", "string_param", "double_param")


def _check_parameters(request: ts.ModelInferRequest) -> None:
    """Triton's gRPC frontend's checks of a request's parameters, before its inputs."""
    for key, value in request.parameters.items():
        kind = value.WhichOneof("parameter_choice")
        if key.startswith("triton_") and key not in _PARAMETER_TYPES:
            allowed = " ".join(k for k in _PARAMETER_TYPES if k.startswith("triton_"))
            raise InferError(
                "parameter keys starting with 'triton_' are reserved for Triton usage. Only the "
                f"following keys starting with 'triton_' are allowed: {allowed}"
            )
        kinds = _PARAMETER_TYPES.get(key, _ANY_PARAMETER)
        if kind not in kinds:
            # Triton's words list the types it takes, but for other keys not double_param.
            expected = (
                " or ".join(kinds)
                if key in _PARAMETER_TYPES
                else ("int64_param, bool_param, or string_param")
            )
            raise InferError(f"invalid value type for '{key}' parameter, expected {expected}.")
        if key == "priority" and kind == "int64_param" and value.int64_param < 0:
            raise InferError("invalid value for 'priority', expected value >= 0.")


def decode_request(request: ts.ModelInferRequest, model: ModelSpec) -> Decoded:
    """Validates a ModelInferRequest against the model's config like Triton does: its gRPC
    frontend checks the parameters, adds the inputs (a name given twice is refused) and
    finds their data; core checks the requested outputs (kept as a set: a name given twice is
    one output), then the inputs (`_checked_inputs`)."""
    _check_parameters(request)
    seen: set[str] = set()
    for tensor in request.inputs:
        if tensor.name in seen:
            # Triton core's AddOriginalInput, after the gRPC frontend has set the request's id.
            raise InferError(
                f"{wire.log_request(request.id)}input '{tensor.name}' already exists in request"
            )
        seen.add(tensor.name)
    raw = list(request.raw_input_contents)
    data = [_data(t, raw, i, model.entry.name) for i, t in enumerate(request.inputs)]
    for output in request.outputs:
        if output.name not in model.output_names:
            raise InferError(
                f"unexpected inference output '{output.name}' for model '{model.entry.name}'"
            )
    _check_input_count(request, model, seen)
    tensors = _checked_inputs(request, model, data)
    try:
        return _read_tensors(model, tensors)
    except InferError as exc:
        raise refused_after_core(request, exc) from None


def _read_tensors(model: ModelSpec, tensors: dict[str, list[Any]]) -> Decoded:
    """The backend's reading of an issued request's inputs, with the executor's checks and this
    server's; an InferError here is refused after core (`refused_after_core`)."""

    def scalar(name: str, default: Any) -> Any:
        values = tensors.get(name)
        return values[0] if values else default

    for name, no_op in _NOT_IMPLEMENTED.items():
        declared = tensors.get(name)
        if declared and (no_op is None or any(v != no_op for v in declared)):
            raise InferError(
                f"input '{name}' is declared by model '{model.entry.name}' but the engine server "
                "does not implement it; omit it (stop strings are applied by the gateway)"
            )
    stop = bool(scalar("stop", False))
    # The backend reads a stop request's `stop` and id only; any other first goes through its
    # readInputsTensors (splitBatchInputsTensors: input_ids, or encoder_input_features that this
    # engine does not declare) and createRequestsFromInputTensors (streaming on a model that is
    # not decoupled, then request_output_len), in this order. (The backend's TLLM_THROW appends
    # its source file, line and a stack trace to the first two messages; this engine does not.)
    if not stop and "input_ids" not in tensors:
        raise InferError("inputTokens or encoderInputFeatures tensor not provided")
    streaming = bool(scalar("streaming", False))
    if streaming and not stop and not model.entry.decoupled:
        raise InferError("Streaming is only supported if model is deployed using decoupled mode.")
    if not stop and "request_output_len" not in tensors:
        raise InferError("request_output_len is not present in the request")
    ids: list[int] = tensors.get("input_ids", [])
    if ids and type(ids[0]) is not int:  # a config that declares them other than an integer type
        ids = [int(v) for v in ids]
    # input_lengths is not read: the backend reads it only to split a batch of several
    # sequences (splitBatchInputsTensors), and core refuses any batch of several here.
    if not stop:
        if not ids:  # the executor's Request refuses an empty prompt
            raise InferError("input_ids must hold at least one token id")
        vocab = model.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InferError(f"input_ids must be token ids in [0, {vocab})")
    max_new = int(scalar("request_output_len", 0))
    end_id = scalar("end_id", None)
    if not stop:
        if max_new <= 0:
            raise InferError(f"request_output_len must be > 0, got {max_new}")
        # The executor refuses a prompt longer than max_input_len, and shortens a
        # request_output_len that does not fit max_seq_len after the prompt (a warning, no error).
        if len(ids) > model.max_input_len:
            raise _executor_error(
                f"Prompt length ({len(ids)}) exceeds maximum input length "
                f"({model.max_input_len}). Set log level to info and check TRTGptModel logs for "
                "how maximum input length is set"
            )
        max_new = min(max_new, model.max_len - len(ids))
        # The executor accepts an end id in [-1, vocabulary size) only.
        if end_id is not None and not -1 <= end_id < vocab:
            raise _executor_error(f"EndId ({end_id}) is not within acceptable range [-1, {vocab}).")
    seed = scalar("random_seed", scalar("seed", None))
    # The backend takes a top_p <= 0 as none given; the executor refuses a negative top_k.
    top_p = float(scalar("runtime_top_p", 0.0))
    top_p = 0.0 if top_p <= 0.0 else top_p  # NaN stays, and is refused below
    top_k = int(scalar("runtime_top_k", 0))
    if top_k < 0 and not stop:
        raise InferError(f"runtime_top_k must be >= 0, got {top_k}")
    temperature = float(scalar("temperature", 1.0))
    if not 0.0 <= top_p <= 1.0 or not temperature >= 0:  # NaN is refused too
        raise InferError(
            f"runtime_top_p must be in [0, 1] and temperature >= 0 for '{model.entry.name}'"
        )
    min_tokens = int(scalar("min_tokens", scalar("min_length", 0)))
    if min_tokens < 0:
        raise InferError(f"min_tokens must be >= 0, got {min_tokens}")
    top_logprobs = int(scalar(TOP_LOGPROBS_INPUT, 0))
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InferError(
            f"{TOP_LOGPROBS_INPUT} must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}"
        )
    guide = None if stop else _guide(tensors, model)
    return Decoded(
        prompt_ids=ids,
        max_new_tokens=max_new,
        end_id=end_id,
        params=SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=int(seed) if seed is not None else None,
        ),
        streaming=streaming,
        stop=stop,
        exclude_input=bool(scalar("exclude_input_in_output", model.exclude_input_default)),
        return_perf=bool(scalar("return_perf_metrics", False)),
        guide=guide,
        min_tokens=min_tokens,
        return_log_probs=bool(scalar("return_log_probs", False)),
        speculation=bool(scalar(SPECULATION_INPUT, True)),
        top_logprobs=top_logprobs,
    )


def _text(tensors: dict[str, list[Any]], name: str) -> str | None:
    values = tensors.get(name)
    if not values:
        return None
    try:
        return bytes(values[0]).decode("utf-8")
    except UnicodeDecodeError:
        raise InferError(f"input '{name}' must be UTF-8 text") from None


def _guide(tensors: dict[str, list[Any]], model: ModelSpec) -> Guide | None:
    """The request's guided-decoding inputs. A guide on a model without a guided decoder is the
    executor's error, with the backend's status and wording (it arrives as an error response)."""
    try:
        guide = parse_guide(
            _text(tensors, "guided_decoding_guide_type"), _text(tensors, "guided_decoding_guide")
        )
    except GuideError as exc:
        raise InferError(str(exc)) from None
    if guide is not None and model.grammars is None:
        raise _executor_error(NOT_SETUP_MESSAGE)
    return guide


async def compile_guide(decoded: Decoded, model: ModelSpec, request: ts.ModelInferRequest) -> None:
    """Compile the request's guide (from the model's cache, or off the event loop) before the
    request is queued, so a guide that does not compile is refused, after core, before anything
    runs."""
    if decoded.guide is None or model.grammars is None:
        return
    decoded.compiled = model.grammars.cached(decoded.guide)
    if decoded.compiled is not None:
        return
    try:
        decoded.compiled = await asyncio.to_thread(model.grammars.compile, decoded.guide)
    except GuideError as exc:
        raise refused_after_core(request, InferError(str(exc))) from None
