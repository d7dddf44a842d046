"""TokenArray <-> numpy and protobuf decoding."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.proto.v1 import common_pb2, rollout_pb2
from treadle.services.codecs import decode_message, to_array, to_token_array
from treadle.services.errors import DecodeError


@pytest.mark.parametrize(
    "dtype", ["int32", "int64", "float32", "float16", "uint8", "int8", "uint32", "float64"]
)
def test_codecs_round_trip_every_dtype(dtype: str) -> None:
    arr = (np.arange(-5, 11) % 7).astype(dtype)
    back = to_array(to_token_array(arr))
    assert back.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(back, arr)


def test_codecs_decode_is_a_zero_copy_view() -> None:
    ta = to_token_array(np.arange(1000, dtype=np.int32))
    arr = to_array(ta)
    assert not arr.flags.owndata
    assert not arr.flags.writeable


def test_codecs_big_endian_and_bool_inputs_are_normalized() -> None:
    big = np.arange(4, dtype=">i4")
    ta = to_token_array(big)
    assert ta.data == np.arange(4, dtype="<i4").tobytes()
    mask = to_token_array(np.array([True, False, True]))
    assert mask.dtype == common_pb2.DType.DTYPE_UINT8
    assert list(to_array(mask)) == [1, 0, 1]


def test_codecs_shape_is_kept_for_nd_arrays() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    ta = to_token_array(arr)
    assert list(ta.shape) == [3, 4]
    np.testing.assert_array_equal(to_array(ta), arr)


def test_codecs_bfloat16_travels_as_bits() -> None:
    bits = np.array([0x3F80, 0x4000], dtype=np.uint16)  # 1.0, 2.0
    ta = to_token_array(bits, bfloat16=True)
    assert ta.dtype == common_pb2.DType.DTYPE_BFLOAT16
    np.testing.assert_array_equal(to_array(ta), bits)


def test_codecs_reject_inconsistent_arrays() -> None:
    with pytest.raises(DecodeError, match="not a whole number of int32"):
        to_array(common_pb2.TokenArray(data=b"\x00" * 5, dtype=common_pb2.DType.DTYPE_INT32))
    with pytest.raises(DecodeError, match="unspecified dtype"):
        to_array(common_pb2.TokenArray(data=b"\x00" * 4))
    with pytest.raises(DecodeError, match=r"shape \(3,\) does not hold 2"):
        to_array(
            common_pb2.TokenArray(data=b"\x00" * 8, dtype=common_pb2.DType.DTYPE_INT32, shape=[3])
        )
    ta = to_token_array(np.zeros(3, np.float32))
    with pytest.raises(DecodeError, match="logprobs: expected dtype int32"):
        to_array(ta, field="logprobs", expect_dtype="int32")
    with pytest.raises(DecodeError, match="expected 4 elements, got 3"):
        to_array(ta, expect_len=4)


def test_codecs_unsupported_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no TokenArray encoding"):
        to_token_array(np.array(["a"]))


def test_codecs_malformed_protobuf_is_a_decode_error() -> None:
    with pytest.raises(
        DecodeError, match=r"bytes from subject x are not a valid treadle.proto.v1.Rollout"
    ):
        decode_message(rollout_pb2.Rollout, b"\xff\xff\xff\xff garbage", where="subject x")
