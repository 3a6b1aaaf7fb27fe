"""The tensor wire codec both sides of the Triton protocol use (appliance.backends.wire)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as ts

from appliance.backends import wire

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
UINT64 = st.integers(min_value=0, max_value=2**64 - 1)
FP32 = st.floats(width=32, allow_nan=False)


@given(st.lists(INT32, max_size=64))
def test_int32_round_trip(values: list[int]) -> None:
    assert wire.decode("INT32", wire.encode("INT32", values), len(values)) == values


@given(st.lists(UINT64, max_size=8))
def test_uint64_round_trip(values: list[int]) -> None:
    assert wire.decode("UINT64", wire.encode("UINT64", values)) == values


@given(st.lists(FP32, max_size=8))
def test_fp32_round_trip(values: list[float]) -> None:
    assert wire.decode("FP32", wire.encode("FP32", values)) == values


@given(st.lists(st.binary(max_size=40), max_size=8))
def test_bytes_round_trip(values: list[bytes]) -> None:
    assert wire.decode("BYTES", wire.encode("BYTES", values), len(values)) == values


def test_bool_is_one_byte_per_element() -> None:
    assert wire.encode("BOOL", [True, False, True]) == b"\x01\x00\x01"
    assert wire.decode("BOOL", b"\x01\x00\x02") == [True, False, True]


def test_byte_order_is_little_endian_whatever_the_host() -> None:
    assert wire.encode("INT32", [1, -2]) == struct.pack("<ii", 1, -2)
    assert wire.encode("UINT64", [2**40 + 3]) == struct.pack("<Q", 2**40 + 3)
    assert wire.encode("FP32", [0.5]) == struct.pack("<f", 0.5)
    assert wire.decode("INT32", struct.pack("<i", 0x01020304)) == [0x01020304]
    assert wire.encode("BYTES", [b"ab", b""]) == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"


def test_batch_dim_is_a_leading_one() -> None:
    batched = ts.ModelInferRequest()
    wire.add_input(batched, "input_ids", "INT32", [5, 6, 7], batch_dim=True)
    wire.add_input(batched, "streaming", "BOOL", [True], batch_dim=True)
    assert [list(t.shape) for t in batched.inputs] == [[1, 3], [1, 1]]
    plain = ts.ModelInferRequest()
    wire.add_input(plain, "input_ids", "INT32", [5, 6, 7], batch_dim=False)
    assert list(plain.inputs[0].shape) == [3]
    assert wire.batched([2, -1], True) == [1, 2, -1]
    tensor = wire.input_tensor(batched, 0)
    assert (tensor.name, tensor.datatype, tensor.shape, tensor.values) == (
        "input_ids",
        "INT32",
        [1, 3],
        [5, 6, 7],
    )
    assert wire.input_tensor(batched, 1).values == [True]


def test_typed_contents_are_read_when_raw_is_absent() -> None:
    request = ts.ModelInferRequest()
    t = request.inputs.add(name="temperature", datatype="FP32", shape=[1, 1])
    t.contents.fp32_contents.append(0.25)
    assert wire.input_tensor(request, 0).values == [0.25]
    t.contents.fp32_contents.append(0.5)
    with pytest.raises(wire.TensorError, match=r"2 element\(s\) where shape \[1, 1\] holds 1"):
        wire.input_tensor(request, 0)


def test_outputs_round_trip_and_absent_outputs_are_none() -> None:
    response = ts.ModelInferResponse()
    wire.add_output(response, "output_ids", "INT32", [9, 8], [1, 1, 2])
    wire.add_output(response, "sequence_length", "INT32", [2], [1, 1])
    assert wire.output_values(response, "output_ids") == [9, 8]
    assert wire.output_values(response, "sequence_length") == [2]
    assert wire.output_values(response, "cum_log_probs") is None
    with pytest.raises(wire.TensorError, match="does not hold"):
        wire.add_output(response, "output_ids", "INT32", [1, 2, 3], [1, 1, 2])


@pytest.mark.parametrize(
    ("datatype", "raw", "count", "message"),
    [
        ("INT32", b"\x01\x00\x00", None, "not a whole number of INT32"),
        ("INT32", b"\x01\x00\x00\x00", 2, r"4 bytes where 2 INT32 element\(s\) need 8"),
        ("BYTES", b"\x05\x00\x00\x00abc", None, "length prefix says 5 bytes but only 3 remain"),
        ("BYTES", b"\x01\x00\x00\x00a\x02\x00", None, "2 trailing byte"),
        ("BYTES", b"\x01\x00\x00\x00a", 2, "1 BYTES elements where the shape holds 2"),
        ("FP16", b"\x00\x00", None, "datatype 'FP16' is not supported"),
    ],
)
def test_malformed_contents_are_a_clear_error(
    datatype: str, raw: bytes, count: int | None, message: str
) -> None:
    with pytest.raises(wire.TensorError, match=message):
        wire.decode(datatype, raw, count)


def test_values_out_of_range_are_refused() -> None:
    with pytest.raises(wire.TensorError, match="do not fit INT32"):
        wire.encode("INT32", [2**31])
