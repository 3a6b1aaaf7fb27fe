"""Typed tensors in KServe v2 / Triton messages: the one codec of the gateway's client and the engine.

A tensor travels as metadata (``name``, ``datatype``, ``shape``) plus its values, either packed in
``raw_input_contents``/``raw_output_contents`` (one bytes entry per tensor, same order as the
metadata) or in the typed ``contents`` fields. Raw values are little-endian whatever the host;
BOOL is one byte per element; BYTES is, per element, a 4-byte little-endian length and the
bytes. A model with ``max_batch_size > 0`` sees a leading batch dimension of 1 on every tensor.

No torch and no numpy: both sides move a handful of scalars and one token list per message.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from tritonclient.grpc import service_pb2 as ts

__all__ = [
    "DATATYPES",
    "Tensor",
    "TensorError",
    "add_input",
    "add_output",
    "batched",
    "decode",
    "encode",
    "input_tensor",
    "log_request",
    "output_values",
    "read_input",
]

Value = int | float | bool | bytes

# Datatype -> array typecode of one element (BYTES is variable-length and handled apart).
DATATYPES: dict[str, str] = {
    "BOOL": "B",
    "INT8": "b",
    "UINT8": "B",
    "INT16": "h",
    "UINT16": "H",
    "INT32": "i",
    "UINT32": "I",
    "INT64": "q",
    "UINT64": "Q",
    "FP32": "f",
    "FP64": "d",
}
# Where values go when a client sends them typed instead of raw.
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "INT64": "int64_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_SWAP = sys.byteorder != "little"
_LENGTH = struct.Struct("<I")


class TensorError(ValueError):
    """Tensor bytes that do not match their datatype and shape; the message says how."""


@dataclass(frozen=True)
class Tensor:
    """One decoded tensor; ``shape`` is as sent (batch dimension included)."""

    name: str
    datatype: str
    shape: list[int]
    values: list[Any]


def batched(dims: Sequence[int], batch_dim: bool) -> list[int]:
    """The shape on the wire: ``dims`` behind a batch dimension of 1 when the model batches."""
    return [1, *dims] if batch_dim else list(dims)


def _typecode(datatype: str) -> str:
    code = DATATYPES.get(datatype)
    if code is None:
        raise TensorError(
            f"datatype {datatype!r} is not supported; use one of {', '.join([*DATATYPES, 'BYTES'])}"
        )
    return code


def encode(datatype: str, values: Sequence[Value]) -> bytes:
    """Raw little-endian bytes of ``values`` as ``datatype``."""
    if datatype == "BYTES":
        out = bytearray()
        for v in values:
            item = v.encode() if isinstance(v, str) else bytes(v)  # type: ignore[arg-type]
            out += _LENGTH.pack(len(item)) + item
        return bytes(out)
    code = _typecode(datatype)
    if datatype == "BOOL":
        values = [1 if v else 0 for v in values]
    try:
        data = array.array(code, values)  # type: ignore[type-var]
    except (OverflowError, TypeError) as exc:
        raise TensorError(f"values do not fit {datatype}: {exc}") from exc
    if _SWAP:
        data.byteswap()
    return data.tobytes()


def _decode_bytes(raw: bytes) -> list[bytes]:
    items: list[bytes] = []
    at = 0
    while at < len(raw):
        if len(raw) - at < _LENGTH.size:
            raise TensorError(
                f"BYTES element {len(items)}: {len(raw) - at} trailing byte(s) where a 4-byte "
                "length prefix was expected"
            )
        (length,) = _LENGTH.unpack_from(raw, at)
        at += _LENGTH.size
        if length > len(raw) - at:
            raise TensorError(
                f"BYTES element {len(items)}: length prefix says {length} bytes but only "
                f"{len(raw) - at} remain"
            )
        items.append(bytes(raw[at : at + length]))
        at += length
    return items


def decode(datatype: str, raw: bytes, count: int | None = None) -> list[Any]:
    """Values of ``raw`` read as ``datatype``; ``count`` (when given) is the element count the
    shape promises, and a different size is an error rather than a silent truncation."""
    if datatype == "BYTES":
        items = _decode_bytes(raw)
        if count is not None and len(items) != count:
            raise TensorError(f"{len(items)} BYTES elements where the shape holds {count}")
        return items
    data = array.array(_typecode(datatype))
    if count is not None and len(raw) != count * data.itemsize:
        raise TensorError(
            f"{len(raw)} bytes where {count} {datatype} element(s) need {count * data.itemsize}"
        )
    if len(raw) % data.itemsize:
        raise TensorError(f"{len(raw)} bytes is not a whole number of {datatype} elements")
    data.frombytes(raw)
    if _SWAP:
        data.byteswap()
    if datatype == "BOOL":
        return [bool(v) for v in data]
    return data.tolist()


def add_input(
    request: ts.ModelInferRequest,
    name: str,
    datatype: str,
    values: Sequence[Value],
    batch_dim: bool,
) -> None:
    """Append a 1-D input tensor with raw contents (shape [n], or [1, n] when the model batches)."""
    request.inputs.add(name=name, datatype=datatype, shape=batched([len(values)], batch_dim))
    request.raw_input_contents.append(encode(datatype, values))


def add_output(
    response: ts.ModelInferResponse,
    name: str,
    datatype: str,
    values: Sequence[Value],
    shape: Sequence[int],
) -> None:
    """Append an output tensor with raw contents; ``shape`` is the full wire shape."""
    if prod(shape) != len(values):
        raise TensorError(
            f"output {name!r}: shape {list(shape)} does not hold {len(values)} values"
        )
    response.outputs.add(name=name, datatype=datatype, shape=list(shape))
    response.raw_output_contents.append(encode(datatype, values))


def input_tensor(request: ts.ModelInferRequest, index: int) -> Tensor:
    """The request's ``index``-th input, from raw contents when the request uses them."""
    raw = request.raw_input_contents
    meta = request.inputs[index]
    if raw and index >= len(raw):
        raise TensorError(f"input {meta.name!r} has no raw_input_contents entry")
    return read_input(meta, raw[index] if raw else None)


def read_input(
    meta: ts.ModelInferRequest.InferInputTensor,
    raw: bytes | None,
    shape: list[int] | None = None,
) -> Tensor:
    """One input from its raw contents (None: the request sends typed contents instead).
    ``shape``: the input's shape when the caller has read it already."""
    name, datatype = meta.name, meta.datatype
    shape = list(meta.shape) if shape is None else shape
    if any(d < 0 for d in shape):
        raise TensorError(f"input {name!r}: negative dimension in shape {shape}")
    count = prod(shape)
    if raw is not None:
        values = decode(datatype, raw, count)
    else:
        field = _CONTENTS_FIELD.get(datatype)
        if field is None:
            _typecode(datatype)  # raises the unsupported-datatype error
            raise AssertionError("unreachable")
        values = list(getattr(meta.contents, field))
        if len(values) != count:
            raise TensorError(
                f"input {name!r}: {len(values)} element(s) where shape {shape} holds {count}"
            )
    return Tensor(name, datatype, shape, values)


def output_values(response: ts.ModelInferResponse, name: str) -> list[Any] | None:
    """The values of output ``name`` (flattened), or None when the response does not carry it."""
    for index, output in enumerate(response.outputs):
        if output.name != name:
            continue
        if index < len(response.raw_output_contents):
            return decode(output.datatype, response.raw_output_contents[index])
        field = _CONTENTS_FIELD.get(output.datatype)
        return list(getattr(output.contents, field)) if field else []
    return None


def log_request(request_id: str) -> str:
    """What starts every message of Triton core's checks of a request (InferenceRequest's
    LogRequest): the request's id, `<id_unknown>` when it has none. The model's name lookups
    (Model::GetInput, GetOutput), the gRPC frontend and the backend do not add it."""
    return f"[request id: {request_id or '<id_unknown>'}] "
